"""Input edge cases of `JRTDataCollator` and `pack_token_blocks`: clear errors, and pads that are never targets."""

from __future__ import annotations

import pytest
import torch

from jrt_train import JRTDataCollator, pack_token_blocks
from modeling_jrt import JRTRNNForCausalLM

MASK_ID = 98
IGNORE = -100


@pytest.mark.parametrize(
    "examples, message",
    [
        ([], r"got no examples"),
        ([list(range(12)), list(range(13))], r"blocks of one length, got lengths \[12, 13\]"),
        ([[[1, 2], [3, 4]]], r"Example 0 must be a 1-D sequence of integer token ids, got \(2, 2\)"),
        ([[0.5] * 12], r"Example 0 must be a 1-D sequence of integer token ids, got \(12,\) torch.float32"),
        ([{"ids": list(range(12))}], r"Example 0 has no 'input_ids' entry \(keys: \['ids'\]\)"),
        ([{"input_ids": list(range(12)), "attention_mask": [1] * 11}], r"`attention_mask` has shape \(11,\)"),
        # Pads before tokens: the prefix must start the block.
        ([{"input_ids": list(range(12)), "attention_mask": [0] + [1] * 11}], r"padding must come after the tokens"),
        # Pads that leave fewer than prefix_length + 2 real tokens.
        ([{"input_ids": list(range(12)), "attention_mask": [1] * 9 + [0] * 3}], r"Examples \[0\] have fewer than"),
    ],
)
def test_collator_refuses_bad_examples_with_a_clear_error(examples, message):
    with pytest.raises(ValueError, match=message):
        JRTDataCollator(8, MASK_ID, seed=0)(examples)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prefix_length=2.5), r"^`prefix_length` must be an integer >= 1 .* got 2.5 \(float\)"),
        (dict(prefix_length=True), r"^`prefix_length` must be an integer >= 1 .* got True \(bool\)"),
        (dict(prefix_length="8"), r"^`prefix_length` must be an integer >= 1 .* got '8' \(str\)"),
        (dict(prefix_length=0), r"^`prefix_length` must be an integer >= 1 .* got 0 \(int\)"),
        (dict(mask_token_id=None), r"^`mask_token_id` is None: the JRT objective writes a \[MASK\] token"),
        (dict(mask_token_id=1.0), r"^`mask_token_id` must be a token id \(an integer >= 0\), got 1.0 \(float\)"),
        (dict(mask_token_id=-1), r"^`mask_token_id` must be a token id"),
        (dict(pad_token_id="0"), r"^`pad_token_id` must be None or an integer >= 0, got '0' \(str\)"),
        (dict(seed=0.5), r"^`seed` must be None or an integer >= 0"),
        (dict(mlm_probability="0.15"), r"^`mlm_probability` must be a number in \[0, 1\], got '0.15'"),
        (dict(mlm_probability=1.5), r"^`mlm_probability` must be a number in \[0, 1\], got 1.5"),
    ],
)
def test_collator_arguments_are_checked_on_construction(kwargs, message):
    """They failed later inside torch with raw TypeErrors (`prefix_length=2.5`, `mask_token_id=None`)."""
    arguments = {"prefix_length": 8, "mask_token_id": MASK_ID, **kwargs}
    with pytest.raises(ValueError, match=message):
        JRTDataCollator(**arguments)


@pytest.mark.parametrize("empty", [[], torch.tensor([], dtype=torch.long), {"input_ids": []}])
def test_an_empty_example_is_named(empty):
    """It failed with "must be a 1-D sequence of integer token ids, got (0,) torch.float32"."""
    with pytest.raises(ValueError, match=r"^Example 1 is empty: every example needs at least prefix_length \+ 2 = 10"):
        JRTDataCollator(8, MASK_ID, seed=0)([list(range(12)), empty])


def test_pads_from_the_attention_mask_are_never_targets():
    ids = torch.arange(4, 18)  # 14 tokens; the last 3 are padding
    attention_mask = torch.tensor([1] * 11 + [0] * 3)
    batch = JRTDataCollator(8, MASK_ID, mlm_probability=1.0, seed=0)(
        [{"input_ids": ids, "attention_mask": attention_mask}, {"input_ids": ids}]
    )
    assert batch["labels"][0, 11:].eq(IGNORE).all() and batch["labels"][0, 9:11].tolist() == [13, 14]
    assert batch["labels"][1, 9:].tolist() == ids[9:].tolist()
    assert batch["mlm_labels"][:, 8:].eq(IGNORE).all()
    assert batch["attention_mask"].tolist() == [attention_mask.tolist(), [1] * 14]


def test_trailing_pad_token_ids_are_padding_and_inner_ones_are_tokens():
    """GPT-2 pads with its end-of-text id, which also separates packed documents: only the trailing run is padding."""
    pad = 2
    ids = [5, 6, 7, 8, 9, pad, 10, 11, 12, 13, pad, pad]
    batch = JRTDataCollator(4, MASK_ID, pad_token_id=pad, seed=0)([ids])
    assert batch["labels"][0].tolist() == [IGNORE] * 5 + [pad, 10, 11, 12, 13, IGNORE, IGNORE]
    assert batch["attention_mask"][0].tolist() == [1] * 10 + [0, 0]
    unpadded = JRTDataCollator(4, MASK_ID, pad_token_id=pad, seed=0)([ids[:10]])
    assert "attention_mask" not in unpadded


def test_padded_batch_trains_on_the_real_tokens_only(make_config):
    """The loss of a right-padded example equals its loss without the pads."""
    model = JRTRNNForCausalLM(make_config(mask_token_id=MASK_ID)).eval()
    ids = torch.randint(4, 90, (14,))
    padded = JRTDataCollator(8, MASK_ID, seed=3)([{"input_ids": ids, "attention_mask": [1] * 11 + [0] * 3}])
    alone = JRTDataCollator(8, MASK_ID, seed=3)([ids[:11]])
    with torch.no_grad():
        torch.testing.assert_close(model(**padded).loss, model(**alone).loss)


@pytest.mark.parametrize(
    "token_ids, block_size, message",
    [
        (list(range(10)), 0, r"`block_size` must be a positive integer, got 0"),
        (list(range(10)), -3, r"`block_size` must be a positive integer, got -3"),
        (list(range(10)), 2.5, r"`block_size` must be a positive integer, got 2.5"),
        ([], 4, r"0 tokens make no block of 4"),
        (torch.zeros(2, 6, dtype=torch.long), 4, r"one 1-D stream of integer token ids .* got \(2, 6\)"),
        ([0.5, 1.5, 2.5, 3.5], 2, r"one 1-D stream of integer token ids .* torch.float32"),
    ],
)
def test_pack_token_blocks_refuses_bad_input(token_ids, block_size, message):
    with pytest.raises(ValueError, match=message):
        pack_token_blocks(token_ids, block_size)
