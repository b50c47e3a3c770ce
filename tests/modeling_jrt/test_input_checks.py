"""Inputs that used to give a silent wrong answer or a raw error deep inside: one line naming what is wrong."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import tiny_config

from modeling_jrt import JRTRNNForCausalLM


@pytest.fixture(scope="module")
def model() -> JRTRNNForCausalLM:
    torch.manual_seed(0)
    return JRTRNNForCausalLM(tiny_config()).eval()


def ids(batch: int = 2, length: int = 10) -> torch.Tensor:
    return torch.randint(4, 99, (batch, length), generator=torch.Generator().manual_seed(1))


def test_float_input_ids_and_ids_outside_the_vocabulary(model):
    with pytest.raises(ValueError, match=r"`input_ids` must be integer token ids, got torch.float32"):
        model(ids().float())
    bad = ids()
    bad[0, 3], bad[1, 5] = 99, -4
    with pytest.raises(ValueError, match=r"ids outside the vocabulary \[0, 99\): \[-4, 99\]"):
        model(bad)


def test_labels_and_loss_arguments(model):
    input_ids = ids()
    with pytest.raises(ValueError, match=r"`labels` must be integer token ids .* got torch.float32"):
        model(input_ids, labels=input_ids.float())
    with pytest.raises(ValueError, match=r"`shift_labels` \(2, 9\) must have the shape .* \(2, 10\).*one column short"):
        model(input_ids, labels=input_ids, shift_labels=input_ids[:, 1:])
    with pytest.raises(ValueError, match=r"`shift_labels` without `labels`"):
        model(input_ids, shift_labels=input_ids)
    for items in (0, -5, torch.tensor(0)):
        with pytest.raises(ValueError, match=r"`num_items_in_batch` must be > 0"):
            model(input_ids, labels=input_ids, num_items_in_batch=items)
    shifted = torch.cat([input_ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    torch.testing.assert_close(model(input_ids, labels=input_ids, shift_labels=shifted).loss,
                               model(input_ids, labels=input_ids).loss)


def test_an_empty_row_is_named(model):
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"Rows \[1\] of the batch are empty"):
        model.generate(ids(), attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_completion_only_labels_of_a_one_token_prompt_warn(model, caplog):
    input_ids = ids(1, 12)
    labels = input_ids.clone()
    labels[:, 0] = -100  # a one-token prompt: after the shift this is labels=input_ids
    with caplog.at_level(logging.WARNING):
        model(input_ids, labels=labels)
    assert any("prompt_lengths=1" in record.getMessage() for record in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model(input_ids, labels=input_ids)  # the default: no warning
    assert not any("prompt_lengths=1" in record.getMessage() for record in caplog.records)
