"""Edges of `forward` and `generate`: no tokens, no prompt, padding masks that do not describe the input."""

from __future__ import annotations

import pytest
import torch

from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt.compat import CACHE_FIELD, output_cache

KINDS = ["prefix", "causal"]


@pytest.fixture
def model(make_config):
    return JRTRNNForCausalLM(make_config()).eval()


def test_zero_tokens_raise_a_clear_error(model):
    with pytest.raises(ValueError, match=r"The input has 0 tokens \(shape \(1, 0\)\): pass at least one token"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"The input has 0 tokens"):
        model(inputs_embeds=torch.zeros(2, 0, 32))


def test_zero_rows_raise_a_clear_error(model):
    with pytest.raises(ValueError, match=r"The input has 0 rows \(shape \(0, 5\)\): pass a batch of at least one row"):
        model(torch.zeros(0, 5, dtype=torch.long))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labels_shape", [(2, 6), (2, 8), (1, 7), (14,)])
def test_labels_of_another_shape_are_refused(make_config, kind, labels_shape):
    """Labels must hold one target per input token: a prefix model used to mask them against the wrong prompt ends
    and return a zero loss ("no scored target") instead of an error."""
    model = JRTRNNForCausalLM(make_config(linear_attention_type=kind, prefix_length=0 if kind == "causal" else 4))
    input_ids = torch.randint(4, 99, (2, 7))
    labels = torch.randint(4, 99, labels_shape)
    match = rf"`labels` \({', '.join(map(str, labels_shape))},?\) must have the shape \(batch, seq_len\) of the input, \(2, 7\)"
    with pytest.raises(ValueError, match=match):
        model(input_ids, labels=labels)
    with pytest.raises(ValueError, match=match):
        model(inputs_embeds=model.get_input_embeddings()(input_ids), labels=labels)


@pytest.mark.parametrize("empty", ["inputs", "input_ids", "inputs_embeds"])
def test_generate_refuses_an_empty_prompt(model, empty):
    prompt = torch.zeros(1, 0, 32) if empty == "inputs_embeds" else torch.zeros(1, 0, dtype=torch.long)
    kwargs = {"inputs": prompt} if empty == "inputs" else {empty: prompt}
    with pytest.raises(ValueError, match=r"The input has 0 tokens"):
        model.generate(**kwargs, max_new_tokens=3)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_without_inputs_starts_from_bos(make_config, kind):
    """As transformers does: the sequence starts with `bos_token_id` and continues greedily from it."""
    model = JRTRNNForCausalLM(make_config(linear_attention_type=kind, prefix_length=0 if kind == "causal" else 8))
    model.eval()
    output = model.generate(max_new_tokens=4, do_sample=False, eos_token_id=None)
    expected = model.generate(torch.tensor([[1]]), max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert output[0, 0].item() == model.config.bos_token_id
    assert torch.equal(output, expected)


def test_generate_without_inputs_or_bos_is_refused(make_config):
    model = JRTRNNForCausalLM(make_config(bos_token_id=None)).eval()
    with pytest.raises(ValueError, match=r"`bos_token_id` has to be defined when no `input_ids` are provided"):
        model.generate(max_new_tokens=2)


@pytest.mark.parametrize("width", [5, 9, 12])
def test_forward_refuses_a_mask_of_the_wrong_width(model, width):
    input_ids = torch.randint(4, 99, (2, 7))
    with pytest.raises(ValueError, match=rf"`attention_mask` has {width} columns but the cache holds 0 tokens and the input 7"):
        model(input_ids, attention_mask=torch.ones(2, width, dtype=torch.long))


def test_forward_refuses_a_mask_that_does_not_cover_the_cache(make_config):
    model = JRTRNNForCausalLM(make_config(prefix_length=4)).eval()  # the prefill covers the whole prefix
    input_ids = torch.randint(4, 99, (1, 9))
    cache = output_cache(model(input_ids[:, :6], use_cache=True))
    with pytest.raises(ValueError, match=r"the cache holds 6 tokens and the input 1: pass one mask column per token, cached and new \(7\)"):
        model(input_ids[:, 6:7], cache=cache, attention_mask=torch.ones(1, 1, dtype=torch.long))
    # The right width is accepted and gives the parallel logits.
    step = model(input_ids[:, 6:7], cache=cache, attention_mask=torch.ones(1, 7, dtype=torch.long)).logits
    parallel = model(input_ids[:, :7], use_cache=False).logits
    torch.testing.assert_close(step[:, -1], parallel[:, -1], rtol=1e-4, atol=1e-4)


def test_purely_recurrent_cache_counts_its_tokens_for_the_mask(make_config):
    """Without sliding layers the cache still counts the tokens it read: the mask must cover exactly those and the
    input."""
    model = JRTRNNForCausalLM(make_config(mixer_types=["conv", "linear_attention", "conv", "conv"])).eval()
    input_ids = torch.randint(4, 99, (1, 8))
    cache = output_cache(model(input_ids[:, :6], use_cache=True))
    assert cache.get_seq_length() == 6
    for width in (1, 9):
        with pytest.raises(ValueError, match=rf"has {width} columns but the cache holds 6 tokens and the input 2"):
            model(input_ids[:, 6:8], cache=cache, attention_mask=torch.ones(1, width, dtype=torch.long))
    model(input_ids[:, 6:8], cache=cache, attention_mask=torch.ones(1, 8, dtype=torch.long))


@pytest.mark.parametrize("mask", [[[1, 1, 2, 1, 1]], [[0.5, 1, 1, 1, 1]], [[1, -1, 1, 1, 1]]])
def test_forward_refuses_non_binary_masks(model, mask):
    with pytest.raises(ValueError, match=r"`attention_mask` must hold only 0 \(padding\) and 1 \(token\)"):
        model(torch.randint(4, 99, (1, 5)), attention_mask=torch.tensor(mask))


def test_forward_refuses_a_mask_of_the_wrong_shape(model):
    with pytest.raises(ValueError, match=r"`attention_mask` must be a 2D \(batch_size, past \+ seq_len\) = \(2, \.\.\.\)"):
        model(torch.randint(4, 99, (2, 5)), attention_mask=torch.ones(1, 5, dtype=torch.long))


def test_binary_masks_of_any_dtype_are_accepted(model):
    input_ids = torch.randint(4, 99, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = model(input_ids, attention_mask=mask).logits
    for dtype in (torch.bool, torch.float32, torch.int32):
        torch.testing.assert_close(model(input_ids, attention_mask=mask.to(dtype)).logits, expected)


def test_a_batch_without_scored_targets_gives_a_zero_loss_and_a_warning(make_config, caplog):
    """Every target inside the prefix (rows shorter than prefix_length = 8): no NaN reaches an optimizer."""
    from transformers.utils import logging as hf_logging

    model = JRTRNNForCausalLM(make_config(prefix_length=8))
    ids = torch.randint(4, 99, (2, 6))
    hf_logging.enable_propagation()
    with caplog.at_level("WARNING"):
        loss = model(ids, labels=ids).loss
    assert loss.item() == 0.0 and loss.requires_grad
    assert "no scored target" in caplog.text
    loss.backward()  # a zero gradient, not NaN
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("value", [0.5, 2, -1])
def test_non_binary_masks_are_refused_for_prompts_shorter_than_the_prefix(model, value):
    """The same check as for long prompts: the mask is checked before the model fills the prefix."""
    prompt = torch.randint(4, 99, (1, 5))
    with pytest.raises(ValueError, match=r"`attention_mask` must hold only 0 \(padding\) and 1 \(token\)"):
        model.generate(prompt, attention_mask=torch.full((1, 5), value), max_new_tokens=2)


@pytest.mark.parametrize(
    "field, value",
    [("rope_theta", 500.0), ("linear_attention_decay", True), ("decay_const", -5.0),
     ("prefix_pad_masking", "reference"), ("sliding_window", 7)],
)
def test_a_cache_made_under_other_contents_is_refused(make_config, field, value):
    """Every config field that changes what a cache holds is checked, not only its shapes: the same weights with
    another `rope_theta` used to continue a cache with logits off by 1.6e-2 (keys rotated two ways)."""
    base = dict(linear_attention_type="causal", linear_attention_decay=True) if field == "decay_const" else {}
    if field == "linear_attention_decay":
        base = dict(linear_attention_type="causal")
    model = JRTRNNForCausalLM(make_config(**base)).eval()
    other = JRTRNNForCausalLM(make_config(**{**base, field: value})).eval()
    other.load_state_dict(model.state_dict())
    input_ids = torch.randint(4, 99, (1, 9))
    cache = output_cache(other(input_ids[:, :8], use_cache=True))
    with pytest.raises(ValueError, match=rf"The cache was built for {field}={value!r}, but this model has {field}="):
        model(input_ids[:, 8:], cache=cache)
    with pytest.raises(ValueError, match=rf"built for {field}="):
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=1, **{CACHE_FIELD: cache})


@pytest.mark.parametrize("kind", ["prefix", "causal"])
def test_a_cache_continues_in_another_dtype(make_config, kind):
    """An fp32 cache continued by a bf16 copy of the model (and back): the conv window and the sliding keys are read
    in the model's dtype (the recurrent state is fp32 in both), so the step runs instead of failing in SDPA."""
    model = JRTRNNForCausalLM(make_config(linear_attention_type=kind)).eval()
    half = JRTRNNForCausalLM(make_config(linear_attention_type=kind)).eval()
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)
    input_ids = torch.randint(4, 99, (2, 10))
    expected = model(input_ids).logits[:, -1]
    for first, second in ((model, half), (half, model)):
        cache = output_cache(first(input_ids[:, :9], use_cache=True))
        logits = second(input_ids[:, 9:], cache=cache).logits[:, -1]
        assert logits.dtype == second.dtype
        torch.testing.assert_close(logits.float(), expected, rtol=0.1, atol=0.1)


def test_a_bogus_prefix_strategy_is_refused_on_a_continuation_too(model):
    input_ids = torch.randint(4, 99, (1, 6))
    cache = output_cache(model(input_ids[:, :5], use_cache=True))
    for strategy in ("bogus", "", 3):
        with pytest.raises(ValueError, match=r"`prefix_strategy` must be one of \['pad', 'repeat', 'none'\]"):
            model(input_ids[:, 5:], cache=cache, prefix_strategy=strategy)
        with pytest.raises(ValueError, match=r"`prefix_strategy` must be one of"):
            model.generate(input_ids, max_new_tokens=2, prefix_strategy=strategy)
    model(input_ids[:, 5:], cache=cache, prefix_strategy="repeat")  # a valid one is accepted (and changes nothing)


@pytest.mark.parametrize("rows", [[0, 2], [-1, 0], [5], [0, 1, 2, 3, 4, 7]])
def test_reordering_a_cache_by_rows_it_lacks_is_refused(model, rows):
    cache = output_cache(model(torch.randint(4, 99, (2, 6)), use_cache=True))
    with pytest.raises(ValueError, match=r"The cache holds rows 0 \.\.\. 1; row -?\d+ does not exist"):
        cache.reorder_cache(torch.tensor(rows))
    with pytest.raises(ValueError, match=r"1D tensor of integer row indices"):
        cache.reorder_cache(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"1D tensor of integer row indices"):
        cache.batch_select_indices(torch.tensor([0.0, 1.0]))
    cache.reorder_cache(torch.tensor([1, 0]))  # the cache is unchanged by the refusals and still reorders
    assert cache.num_rows == 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("length", [3, 12], ids=["needs-the-fill", "longer-than-the-prefix"])
@pytest.mark.parametrize("hole", [[4], [4, 5], [1, 9]])
def test_padding_between_real_tokens_is_refused_in_every_row(make_config, kind, length, hole):
    """A hole in a row's mask (padding between its real tokens) was refused in a row that needs the prefix fill and
    run in other rows, where the result matched neither "token removed" nor "mask ignored": refused everywhere."""
    model = JRTRNNForCausalLM(make_config(linear_attention_type=kind)).eval()
    input_ids = torch.randint(4, 99, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, : 12 - length] = 0  # row 1: left padding only, fine
    mask[0, [column for column in hole if column < 12]] = 0
    with pytest.raises(ValueError, match=r"Rows \[0\] of `attention_mask` have padding between real tokens"):
        model(input_ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"padding between real tokens"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=2)
    mask[0] = 1
    model(input_ids, attention_mask=mask)  # left padding, and a right-padded row, are one run each
    mask[0, -2:] = 0
    model(input_ids, attention_mask=mask)


def test_a_continuation_mask_that_removes_a_read_token_is_refused(model):
    """The cache counts the real tokens it read per row: a continuation's mask that turns one of them into padding
    (or padding into a token) would be ignored without a word; it is refused."""
    input_ids = torch.randint(4, 99, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    cache = output_cache(model(input_ids[:, :8], attention_mask=mask[:, :8], use_cache=True))
    changed = mask.clone()
    changed[0, 0] = 0  # a token read as real, now padding (one run: still left padding)
    with pytest.raises(ValueError, match=r"other tokens as padding among those the cache already read .* \[8, 5\] read, "
                                         r"\[7, 5\] in this mask"):
        model(input_ids[:, 8:], attention_mask=changed, cache=cache)
    changed = mask.clone()
    changed[1, :3] = 1  # padding read as padding, now tokens
    with pytest.raises(ValueError, match=r"\[8, 5\] read, \[8, 8\] in this mask"):
        model(input_ids[:, 8:], attention_mask=changed, cache=cache)
    model(input_ids[:, 8:], attention_mask=mask, cache=cache)  # the mask the cache read, then the new columns
    assert cache.real_tokens.tolist() == [10, 7]


def test_a_cache_of_an_earlier_release_is_refused(model):
    """A cache unpickled from a release before the fixed-shape buffers (no format mark, growing states, a Python
    counter) is refused in one line, by a forward and by generate()."""
    import pickle

    input_ids = torch.randint(4, 99, (1, 6))
    cache = output_cache(model(input_ids[:, :5], use_cache=True))
    old = pickle.loads(pickle.dumps(cache))
    del old.format, old.positions, old.real_tokens
    old.__dict__['num_read'] = 5
    for run in (lambda: model(input_ids[:, 5:], cache=old),
                lambda: model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **{CACHE_FIELD: old},
                                       max_new_tokens=1)):
        with pytest.raises(ValueError, match=r"This cache was made by an earlier jrt-rnn release"):
            run()
    continued = pickle.loads(pickle.dumps(cache))  # a pickle of this release continues
    torch.testing.assert_close(model(input_ids[:, 5:], cache=continued).logits,
                               model(input_ids[:, 5:], cache=cache).logits)
