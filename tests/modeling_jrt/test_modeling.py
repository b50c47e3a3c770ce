"""JRTRNNForCausalLM: Auto classes, full-sequence forward semantics, save/load, training mechanics."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from conftest import enable_activation_checkpointing, saved_for_backward_bytes
from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM, JRTRNNModel
from modeling_jrt.compat import output_cache
from modeling_jrt.modeling_jrt import JRTRNNLinearAttention, JRTRNNShortConv, JRTRNNSlidingWindowAttention

ALL_KINDS = [
    pytest.param(dict(linear_attention_type="prefix"), id="jrt-prefix"),
    pytest.param(dict(linear_attention_type="causal"), id="based"),
    pytest.param(dict(linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True), id="based-decay"),
]


def build(make_config, **overrides) -> JRTRNNForCausalLM:
    return AutoModelForCausalLM.from_config(make_config(**overrides)).eval()


def test_auto_classes(make_config, tmp_path):
    config = make_config()
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, JRTRNNForCausalLM)
    assert isinstance(AutoModel.from_config(config), JRTRNNModel)
    config.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), JRTRNNConfig)
    kinds = [type(layer.mixer) for layer in model.model.layers]
    assert kinds == [JRTRNNShortConv, JRTRNNLinearAttention, JRTRNNSlidingWindowAttention, JRTRNNShortConv]


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_forward_shapes_and_loss_is_shifted_cross_entropy(make_config, kind):
    """The loss is the next-token cross-entropy over the targets after each row's prefix: the JRT encoder reads the
    first prefix_length = 8 tokens, or a row's prompt (the tokens before its first scored target: 4 in row 0), and
    their targets are not scored; a causal (Based) model scores every target."""
    model = build(make_config, **kind)
    input_ids = torch.randint(0, 99, (3, 13))
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[1, 10] = -100
    out = model(input_ids, labels=labels, use_cache=False)
    assert out.logits.shape == (3, 13, 99) and output_cache(out) is None
    targets = labels[:, 1:].clone()  # (B, T - 1): the target of position t is the label at index t + 1
    if kind["linear_attention_type"] == "prefix":
        targets[1:, : 8 - 1] = -100  # label indices 1..7 lie inside the prefix of rows 1 and 2
        targets[0, : 4 - 1] = -100  # row 0's prompt is its 4 leading ignored labels' tokens (already -100)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 99), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def test_loss_ignores_the_targets_of_each_rows_own_prefix(make_config):
    """Per-row prefixes and left padding: the loss equals a hand-computed cross-entropy over the targets after each
    row's prefix."""
    model = build(make_config)
    input_ids = torch.randint(4, 99, (2, 12))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0
    position_ids = ((mask.cumsum(-1) - 1) * mask).clamp(min=0)
    labels = input_ids.masked_fill(mask == 0, -100)
    prefix = torch.tensor([5, 2])  # row 1: prefix end at index 3 + 2 = 5
    inputs = dict(attention_mask=mask, position_ids=position_ids, prefix_length=prefix)
    out = model(input_ids, labels=labels, **inputs)
    log_probs = out.logits.double().log_softmax(-1)
    terms = [-log_probs[b, j - 1, input_ids[b, j]] for b, end in ((0, 5), (1, 5)) for j in range(end, 12)]
    torch.testing.assert_close(out.loss.double(), torch.stack(terms).mean())
    # Pre-shifted labels (shift_labels, as some trainers pass them) are masked the same way.
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(model(input_ids, labels=labels, shift_labels=shifted, **inputs).loss, out.loss)


def test_logits_to_keep_and_inputs_embeds(make_config):
    model = build(make_config)
    input_ids = torch.randint(0, 99, (2, 11))
    full = model(input_ids, use_cache=False).logits
    last = model(input_ids, use_cache=False, logits_to_keep=1).logits
    torch.testing.assert_close(last, full[:, -1:])
    embeds = model.get_input_embeddings()(input_ids)
    torch.testing.assert_close(model(inputs_embeds=embeds, use_cache=False).logits, full)
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model(input_ids, inputs_embeds=embeds)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_chunked_and_quadratic_implementations_agree(make_config, kind):
    model = build(make_config, **kind)
    oracle = copy.deepcopy(model)
    oracle.config.linear_attention_implementation = "quadratic"
    input_ids = torch.randint(0, 99, (2, 19))
    torch.testing.assert_close(model(input_ids).logits, oracle(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_eager_and_sdpa_attention_agree(make_config):
    eager = AutoModelForCausalLM.from_config(make_config(), attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_config(make_config(), attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    input_ids = torch.randint(0, 99, (2, 17))  # longer than the window (5)
    mask = torch.ones_like(input_ids)
    mask[1, :6] = 0
    for attention_mask in (None, mask):
        valid = mask.bool()  # outputs at padded query positions are don't-care
        torch.testing.assert_close(
            eager(input_ids, attention_mask=attention_mask).logits[valid],
            sdpa(input_ids, attention_mask=attention_mask).logits[valid],
            rtol=1e-5, atol=1e-5,
        )


def test_sliding_window_limits_what_a_token_sees(make_config):
    """Only conv + sliding attention: a token more than window + conv reach back cannot change the output."""
    model = build(make_config, mixer_types=["sliding_attention", "sliding_attention", "conv", "conv"])
    input_ids = torch.randint(4, 99, (1, 30))
    changed = input_ids.clone()
    changed[0, 3] = 4 if input_ids[0, 3] != 4 else 5
    a, b = model(input_ids).logits, model(changed).logits
    reach = 2 * (5 - 1) + 2 * (3 - 1)  # two windows of 5 keys, two convolutions of 3 taps
    torch.testing.assert_close(a[:, 3 + reach + 1 :], b[:, 3 + reach + 1 :], rtol=0, atol=0)
    assert (a[:, 3:] - b[:, 3:]).abs().max() > 1e-4


def test_prefix_is_read_non_causally_by_the_model(make_config):
    """JRT: a token inside the prefix changes logits at earlier positions; a token after it changes none."""
    model = build(make_config, prefix_length=8)
    input_ids = torch.randint(4, 99, (1, 16))
    base = model(input_ids).logits
    inside = input_ids.clone()
    inside[0, 6] = (input_ids[0, 6] + 1) % 95 + 4
    assert (model(inside).logits[:, :6] - base[:, :6]).abs().max() > 1e-5
    after = input_ids.clone()
    after[0, 12] = (input_ids[0, 12] + 1) % 95 + 4
    changed = model(after).logits
    torch.testing.assert_close(changed[:, :12], base[:, :12], rtol=0, atol=0)
    # A causal (Based) model never looks ahead.
    based = build(make_config, linear_attention_type="causal")
    torch.testing.assert_close(based(inside).logits[:, :6], based(input_ids).logits[:, :6], rtol=0, atol=0)


def test_prefix_longer_than_input_uses_the_whole_input(make_config):
    """Without a fill (`prefix_strategy="none"`) a prefix longer than the input reads the whole input."""
    long_prefix = build(make_config, prefix_length=1000, prefix_strategy="none")
    exact = JRTRNNForCausalLM(make_config(prefix_length=13)).eval()
    exact.load_state_dict(long_prefix.state_dict())
    input_ids = torch.randint(0, 99, (2, 13))
    torch.testing.assert_close(long_prefix(input_ids).logits, exact(input_ids).logits, rtol=0, atol=0)
    # The per-call override equals a config with that prefix length.
    torch.testing.assert_close(
        exact(input_ids, prefix_length=5).logits, _with_prefix(exact, 5)(input_ids).logits, rtol=0, atol=0
    )


def _batch_of(rows: list[torch.Tensor], length: int, left: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads 1-D rows to `length` (on the left or the right, per row) with id 0; returns ids and attention mask."""
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, (row, on_left) in enumerate(zip(rows, left)):
        where = slice(length - row.numel(), length) if on_left else slice(0, row.numel())
        ids[index, where], mask[index, where] = row, 1
    return ids, mask


@pytest.mark.parametrize("masking", ["strict", "reference"])
def test_per_row_prefix_lengths_equal_each_row_alone(make_config, masking):
    """forward(prefix_length=(B,) tensor): each row of a left- and right-padded batch gives the logits of the row
    alone with its own prefix length (0, 1, shorter than, equal to and longer than the row)."""
    model = build(make_config, prefix_length=8, prefix_pad_masking=masking)
    rows = [torch.randint(4, 99, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 9, 11, 6, 13)]
    prefix = torch.tensor([0, 1, 5, 6, 13])
    input_ids, mask = _batch_of(rows, 13, left=[True, True, False, True, False])
    position_ids = ((mask.cumsum(-1) - 1) * mask).clamp(min=0)  # left pads: positions count from the first token
    batched = model(input_ids, attention_mask=mask, position_ids=position_ids, prefix_length=prefix).logits
    for index, row in enumerate(rows):
        alone = model(row[None], prefix_length=int(prefix[index])).logits[0]
        torch.testing.assert_close(batched[index][mask[index].bool()], alone, rtol=1e-5, atol=1e-5)
    # An int is the same prefix for every row; padding never enters the encoder (a prefix past the row's end).
    as_int = model(input_ids, attention_mask=mask, position_ids=position_ids, prefix_length=12).logits
    as_tensor = model(input_ids, attention_mask=mask, position_ids=position_ids, prefix_length=torch.full((5,), 12))
    torch.testing.assert_close(as_int, as_tensor.logits, rtol=0, atol=0)


def test_no_logit_after_the_prefix_reads_a_later_token(make_config):
    """Changing the token at index j changes no logit at a position p < j with p >= the row's prefix end - 1; inside
    the prefix it does (the non-causal encoder)."""
    model = build(make_config, prefix_length=8)
    rows = [torch.randint(4, 99, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 10)]
    input_ids, mask = _batch_of(rows, 12, left=[True, True])
    position_ids = ((mask.cumsum(-1) - 1) * mask).clamp(min=0)
    prefix = torch.tensor([3, 6])
    prefix_end = (mask.argmax(-1) + prefix).tolist()  # absolute index after each row's prefix
    forward = lambda ids: model(ids, attention_mask=mask, position_ids=position_ids, prefix_length=prefix).logits
    base = forward(input_ids)
    read_ahead = False
    for j in range(12):
        changed_ids = input_ids.clone()
        changed_ids[:, j] = (input_ids[:, j] + 7) % 95 + 4
        changed = forward(changed_ids)
        for row in range(2):
            first_free = max(prefix_end[row] - 1, 0)
            if j > first_free:
                torch.testing.assert_close(changed[row, first_free:j], base[row, first_free:j], rtol=0, atol=1e-6)
            start = int(mask[row].argmax())
            if start + 2 < j < prefix_end[row]:
                read_ahead |= bool((changed[row, start:j] - base[row, start:j]).abs().max() > 1e-5)
    assert read_ahead  # the test can see a look-ahead: the encoder does read forward inside the prefix


def test_bad_prefix_lengths_raise_clear_errors(make_config):
    model = build(make_config)
    input_ids = torch.randint(4, 99, (2, 7))
    with pytest.raises(ValueError, match=r"\(B,\) = \(2,\) integer tensor"):
        model(input_ids, prefix_length=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"\(B,\) = \(2,\) integer tensor"):
        model(input_ids, prefix_length=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=">= 0 in every row"):
        model(input_ids, prefix_length=torch.tensor([1, -1]))
    with pytest.raises(ValueError, match=">= 0"):
        model(input_ids, prefix_length=-2)
    with pytest.raises(TypeError, match="int or a \\(B,\\) LongTensor"):
        model(input_ids, prefix_length=2.5)


def _with_prefix(model: JRTRNNForCausalLM, prefix_length: int) -> JRTRNNForCausalLM:
    clone = copy.deepcopy(model)
    clone.config.prefix_length = prefix_length
    return clone


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_left_padding_with_strict_masking_matches_unpadded(make_config, kind):
    """attention_mask: conv, sliding attention and linear attention ignore left pads entirely; the encoder covers
    each row's own first `prefix_length` tokens."""
    model = build(make_config, prefix_length=12, **kind)
    real = torch.randint(4, 99, (1, 15))
    pads = 4
    padded = torch.cat([torch.zeros(1, pads, dtype=torch.long), real], dim=1)
    mask = torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones(1, 15, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    padded_logits = model(padded, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(padded_logits[:, pads:], model(real).logits, rtol=1e-5, atol=1e-5)


def test_reference_pad_masking_leaks_only_when_there_is_padding(make_config):
    strict = build(make_config, prefix_length=12)
    reference = _with_prefix(strict, 12)
    reference.config.prefix_pad_masking = "reference"
    input_ids = torch.randint(4, 99, (2, 14))
    torch.testing.assert_close(strict(input_ids).logits, reference(input_ids).logits, rtol=0, atol=0)
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    # JRT prefix pads (linear_attention_mask) leak through the constant feature under "reference" ...
    difference = (
        strict(input_ids, linear_attention_mask=mask).logits - reference(input_ids, linear_attention_mask=mask).logits
    )
    assert difference[0, 3:].abs().max() > 1e-4
    assert difference[1].abs().max() == 0  # the unpadded row is unaffected
    # ... batch padding (attention_mask) is removed entirely under both.
    # (no fill here: the fill's pads are masked like any JRT prefix pad)
    torch.testing.assert_close(
        strict(input_ids, attention_mask=mask, prefix_strategy="none").logits,
        reference(input_ids, attention_mask=mask, prefix_strategy="none").logits, rtol=0, atol=0,
    )


def test_save_and_load_round_trip_keeps_logits_and_tied_weights(make_config, tmp_path):
    model = build(make_config, mask_token_id=98)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    input_ids = torch.randint(0, 99, (2, 21))
    torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


def test_untied_embeddings_round_trip(make_config, tmp_path):
    model = build(make_config, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_init_weights_covers_every_parameter(make_config):
    """Every parameter is re-initialised by transformers' default `_init_weights` (the model declares no init of its
    own: nothing is left uninitialised after meta construction)."""
    model = build(make_config, linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True)
    for parameter in model.parameters():
        parameter.data.fill_(float("nan"))
    for module in model.modules():
        model._init_weights(module)
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter).all(), name


def test_bf16_forward_keeps_fp32_residual_and_is_close(make_config):
    model = build(make_config)
    input_ids = torch.randint(0, 99, (2, 13))
    reference = model(input_ids).logits
    low = copy.deepcopy(model).to(torch.bfloat16)
    logits = low(input_ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, rtol=5e-2, atol=5e-2)


def test_loss_decreases_with_a_few_optimizer_steps(make_config):
    model = build(make_config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    input_ids = torch.randint(0, 99, (4, 24))
    losses = []
    for _ in range(15):
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_gradient_checkpointing_gives_the_same_gradients(make_config):
    model = build(make_config).train()
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed, use_reentrant=False)
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    input_ids = torch.randint(0, 99, (2, 17))
    model(input_ids, labels=input_ids, use_cache=False).loss.backward()
    checkpointed(input_ids, labels=input_ids).loss.backward()
    for (name, a), (_, b) in zip(model.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_training_keeps_memory_linear_in_the_sequence(make_config, attn_implementation):
    """What autograd keeps from a training forward (every layer kind: conv, linear and sliding-window attention,
    MLP, loss) grows linearly with T: the bytes per token at 1024 tokens are within 5% of those at 256. A (T, T)
    tensor adds 4 T bytes per token: with a window of 4096 instead of 32 (eager attention over the whole sequence)
    this test fails."""
    model = JRTRNNForCausalLM(make_config(
        mixer_types=["conv", "linear_attention", "sliding_attention", "linear_attention"], sliding_window=32,
        prefix_length=40, linear_attention_chunk_size=16, attn_implementation=attn_implementation,
    )).train()
    per_token = []
    for length in (256, 1024):
        input_ids = torch.randint(4, 99, (1, length), generator=torch.Generator().manual_seed(length))
        saved, output = saved_for_backward_bytes(
            lambda: model(input_ids, labels=input_ids), exclude=list(model.parameters())
        )
        per_token.append(saved / length)
        output.loss.backward()
    assert per_token[1] <= 1.05 * per_token[0], per_token
