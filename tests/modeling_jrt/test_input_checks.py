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


@pytest.mark.parametrize("kind", ["prefix", "causal"])
def test_labels_of_any_integer_dtype_and_ids_outside_the_vocabulary(kind):
    """int32 / int16 labels (and shift_labels) give the int64 loss; ids outside [0, vocab) other than -100 and float
    shift labels are one line naming them, for both model kinds (the labels rule runs for prefix models only)."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(linear_attention_type=kind)).eval()
    input_ids = ids(length=12)
    labels = input_ids.clone()
    labels[:, :3] = -100
    expected = model(input_ids, labels=labels).loss
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(model(input_ids, labels=labels.clamp(min=0).to(dtype)).loss,
                                   model(input_ids, labels=labels.clamp(min=0)).loss)
    torch.testing.assert_close(model(input_ids, labels=labels.to(torch.int32)).loss, expected)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    torch.testing.assert_close(
        model(input_ids, labels=labels, shift_labels=shifted.to(torch.int32)).loss,
        model(input_ids, labels=labels, shift_labels=shifted).loss,
    )
    for bad_id in (99, 150, -1, -99):
        bad = labels.clone()
        bad[1, 7] = bad_id
        with pytest.raises(ValueError, match=rf"`labels` holds ids outside the vocabulary \[0, 99\) that are not -100 "
                                             rf"\(ignored\): \[{bad_id}\]"):
            model(input_ids, labels=bad)
        with pytest.raises(ValueError, match=rf"`shift_labels` holds ids outside the vocabulary .*\[{bad_id}\]"):
            model(input_ids, labels=labels, shift_labels=torch.where(bad != labels, bad, shifted))
    with pytest.raises(ValueError, match=r"`shift_labels` must be integer token ids .* got torch.float32"):
        model(input_ids, labels=labels, shift_labels=shifted.float())


def test_logits_to_keep_with_labels_and_out_of_range(model):
    input_ids = ids()
    for keep in (1, 3, torch.tensor([0, 4])):
        with pytest.raises(ValueError, match=r"`logits_to_keep` \((1|3|a tensor)\) with `labels`: the loss needs"):
            model(input_ids, labels=input_ids, logits_to_keep=keep)
    for keep, position in ((torch.tensor([0, 10]), 10), (torch.tensor([-11]), -11), (torch.tensor([[0], [12]]), 12),
                           (torch.tensor([[0], [-1]]), -1)):
        with pytest.raises(ValueError, match=rf"`logits_to_keep` selects position {position}, outside the 10 positions"):
            model(input_ids, logits_to_keep=keep)
    with pytest.raises(ValueError, match=r"`logits_to_keep` must be >= 0"):
        model(input_ids, logits_to_keep=-2)
    with pytest.raises(ValueError, match=r"has 3 rows for a batch of 2"):
        model(input_ids, logits_to_keep=torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer positions"):
        model(input_ids, logits_to_keep=torch.tensor([0.5]))
    logits = model(input_ids).logits
    torch.testing.assert_close(model(input_ids, logits_to_keep=torch.tensor([-1, 2])).logits, logits[:, [-1, 2]])
    torch.testing.assert_close(model(input_ids, logits_to_keep=2).logits, logits[:, -2:])


@pytest.mark.parametrize("kind", ["prefix", "causal"])
def test_labels_are_checked_once_per_step(monkeypatch, kind):
    """One check of the targets per call (`inputs.check_labels`): the labels rule checks them when it plans a JRT
    prefix, and the forward trusts labels that come with its plan; otherwise the forward checks them."""
    import modeling_jrt.inputs as inputs
    import modeling_jrt.labels as labels_rule
    import modeling_jrt.modeling_jrt as modeling

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return inputs.check_labels(*args, **kwargs)

    monkeypatch.setattr(labels_rule, "check_labels", counted)
    monkeypatch.setattr(modeling, "check_labels", counted)
    overrides = {} if kind == "prefix" else dict(linear_attention_type="causal")
    model = JRTRNNForCausalLM(tiny_config(**overrides)).train()
    model(ids(), labels=ids())
    assert len(calls) == 1
    bad = ids()
    bad[1, 4] = 99
    with pytest.raises(ValueError, match=r"`labels` holds ids outside the vocabulary \[0, 99\) that are not -100"):
        model(ids(), labels=bad)
    shifted = ids()[:, 1:]
    with pytest.raises(ValueError, match=r"`shift_labels` \(2, 9\) must have the shape"):
        model(ids(), labels=ids(), shift_labels=shifted)
