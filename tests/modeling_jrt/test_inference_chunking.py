"""Inference-time token chunking (RMSNorm, MLP, whole conv and sliding-window layers): equal to one pass."""

from __future__ import annotations

import copy

import pytest
import torch

import modeling_jrt.inference_chunking as chunking
from modeling_jrt.short_conv import causal_depthwise_conv
from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt import JRTRNNCache

ATOL = RTOL = 1e-5  # fp32
CPU = torch.device("cpu")


def set_chunking(monkeypatch: pytest.MonkeyPatch, elements: int) -> None:
    """Chunks of `elements // width` rows (no floor), so tiny shapes split into several uneven chunks."""
    monkeypatch.setattr(chunking, "INFERENCE_CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(chunking, "MIN_INFERENCE_CHUNK", 1)


def projection_lengths(model: JRTRNNForCausalLM, layer_type: str = "conv") -> list[int]:
    """A list that records the token count of every later call of the first projection (conv `in_proj`, sliding
    `q_proj`) of `model`'s `layer_type` layers."""
    lengths: list[int] = []
    for layer in model.model.layers:
        if layer.layer_type == layer_type:
            projection = layer.mixer.in_proj if layer_type == "conv" else layer.mixer.q_proj
            projection.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    return lengths


def in_proj_lengths(model: JRTRNNForCausalLM) -> list[int]:
    return projection_lengths(model, "conv")


def run(model: JRTRNNForCausalLM, input_ids: torch.Tensor, mask: torch.Tensor, decode: int = 3) -> list[torch.Tensor]:
    """Logits of a full prefill (all positions) through a fresh cache, then of `decode` greedy single-token steps."""
    cache = JRTRNNCache(model.config)
    out = model(input_ids, attention_mask=mask, cache=cache)
    logits = [out.logits]
    for _ in range(decode):
        token = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, cache=cache)
        logits.append(out.logits)
    return logits


CHUNKED_CONFIGS = [
    pytest.param({"conv_kernel_size": 4}, id="K4"),
    pytest.param({"conv_kernel_size": 1}, id="K1"),
    pytest.param({"prefix_length": 30}, id="prefix-over-chunks"),
    pytest.param(
        {"linear_attention_type": "causal", "linear_attention_decay": True, "use_decay_proj": True}, id="based-decay"
    ),
]


@pytest.mark.parametrize("overrides", CHUNKED_CONFIGS)
def test_chunked_prefill_equals_one_pass(monkeypatch, make_config, overrides):
    """Left-padded batch of 2, 50 tokens: conv layers in chunks of 3 tokens, the sliding-window layer (window 5) in
    chunks of 6 (uneven last chunks), the linear-attention layer's norm and projections in chunks of 12 (its
    encoder rows across several chunks with a prefix of 30), its MLP in chunks; prefill logits at the real tokens
    (a padded query is don't-care), cached decode after it and the forward without a cache all match."""
    model = JRTRNNForCausalLM(make_config(**overrides)).eval()
    input_ids = torch.randint(4, 99, (2, 50))
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, :9] = 0
    real = mask.bool()
    with torch.no_grad():
        set_chunking(monkeypatch, 1 << 40)
        reference = run(model, input_ids, mask)
        reference_nocache = model(input_ids, attention_mask=mask, use_cache=False).logits
        set_chunking(monkeypatch, 3 * 2 * 2 * 64)  # conv width B * 2 * D = 256 -> 3 rows
        lengths = in_proj_lengths(model)
        sliding_lengths = projection_lengths(model, "sliding_attention")
        chunked = run(model, input_ids, mask)
        chunked_nocache = model(input_ids, attention_mask=mask, use_cache=False).logits
    assert max(lengths) == 3  # the conv really ran in chunks (decode steps are single tokens)
    assert max(sliding_lengths) == 6  # sliding width B * H * Dh * 2 slabs = 128 -> 6 rows
    torch.testing.assert_close(chunked[0][real], reference[0][real], atol=ATOL, rtol=RTOL)
    for expected, actual in zip(reference[1:], chunked[1:]):
        torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(chunked_nocache[real], reference_nocache[real], atol=ATOL, rtol=RTOL)


def test_autograd_forward_is_not_chunked(monkeypatch, make_config):
    """With autograd on (training, or eval without `no_grad`) every op sees the whole sequence."""
    model = JRTRNNForCausalLM(make_config())
    set_chunking(monkeypatch, 1)
    lengths = in_proj_lengths(model)
    input_ids = torch.randint(4, 99, (2, 30))
    model(input_ids, labels=input_ids).loss.backward()
    assert lengths and set(lengths) == {30}
    assert chunking.inference_chunk_rows(1000, 8, CPU) is None
    with torch.no_grad():
        assert chunking.inference_chunk_rows(1000, 8, CPU) == 1


def test_default_chunk_bounds_intermediates():
    """The CPU budget: at most 2**21 elements (8 MiB in fp32) per chunk, never fewer than 64 rows."""
    with torch.inference_mode():
        assert chunking.inference_chunk_rows(65536, 1024, CPU) == 2048
        assert chunking.inference_chunk_rows(2048, 1024, CPU) is None  # fits one chunk: the one-pass forward
        assert chunking.inference_chunk_rows(65536, 1 << 20, CPU) == 64


def test_accelerator_chunks_are_larger():
    """On an accelerator the budget is 2**27 elements: a 64k-token prefill at hidden 256 runs unchunked (one launch
    per op, not 32), a 1M-token one in chunks of 128k rows. The device is only looked at, not used."""
    cuda = torch.device("cuda")
    with torch.inference_mode():
        assert chunking.inference_chunk_rows(65536, 1024, cuda) is None
        assert chunking.inference_chunk_rows(1 << 20, 1024, cuda) == 1 << 17
        assert chunking.inference_chunk_rows(65536, 1 << 27, cuda) == 64
    assert chunking.inference_chunk_rows(1 << 20, 1024, cuda) is None  # autograd on: never chunked


@pytest.mark.parametrize("kernel_size", [1, 2, 3, 4])
def test_causal_depthwise_conv_equals_conv1d(kernel_size):
    """The shifted multiply-adds in the (B, t, D) layout equal `F.conv1d` over the transposed [history, inputs] (zeros
    before them), for every history length and inputs shorter than the kernel; gradients too."""
    torch.manual_seed(0)
    weight = torch.randn(6, 1, kernel_size, requires_grad=True)
    for seq_len in (1, 2, 3, 7):
        for past in range(kernel_size):
            inputs = torch.randn(2, seq_len, 12)[..., ::2].requires_grad_()  # a strided view, as in_proj's chunk
            history = torch.randn(2, past, 6) if past else None
            full = inputs if history is None else torch.cat([history, inputs], dim=1)
            expected = torch.nn.functional.conv1d(
                torch.nn.functional.pad(full.transpose(1, 2), (kernel_size - 1, 0)), weight, groups=6
            )[..., -seq_len:].transpose(1, 2)
            actual = causal_depthwise_conv(inputs, history, weight)
            torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)
            grads = torch.autograd.grad(actual.square().sum(), (inputs, weight))
            expected_grads = torch.autograd.grad(expected.square().sum(), (inputs, weight))
            for grad, expected_grad in zip(grads, expected_grads):
                torch.testing.assert_close(grad, expected_grad, atol=ATOL, rtol=RTOL)


def test_layers_never_write_what_another_module_can_see(monkeypatch, make_config):
    """During inference (chunked) each layer returns a new residual: hidden states that `output_hidden_states` or a
    layer hook receive, and the caller's `inputs_embeds`, are never overwritten by a later layer."""
    model = JRTRNNForCausalLM(make_config()).eval()
    input_ids = torch.randint(4, 99, (2, 40))
    with torch.enable_grad():  # no in-place update, no chunking: the reference (a copy: capturing installs hooks)
        expected = copy.deepcopy(model)(input_ids, output_hidden_states=True).hidden_states
    expected = [h.detach() for h in expected]
    set_chunking(monkeypatch, 3 * 2 * 2 * 64)
    with torch.no_grad():
        plain = model(input_ids).logits
        embeds = model.get_input_embeddings()(input_ids)
        given = embeds.clone()
        from_embeds = model(inputs_embeds=embeds).logits
        seen: list[torch.Tensor] = []
        handle = model.model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out))
        hooked = model(input_ids).logits
        handle.remove()
        captured = model(input_ids, output_hidden_states=True).hidden_states
    assert len(captured) == len(expected)
    for actual, reference in zip(captured, expected):
        torch.testing.assert_close(actual, reference, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(seen[0], expected[2], atol=ATOL, rtol=RTOL)  # layer 1's output, intact
    torch.testing.assert_close(hooked, plain, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(from_embeds, plain, atol=ATOL, rtol=RTOL)
    assert torch.equal(embeds, given)


@pytest.mark.parametrize("mixer_type", ["linear_attention", "conv", "sliding_attention"])
def test_a_mixer_has_one_contract_whatever_the_grad_mode(monkeypatch, make_config, mixer_type):
    """A forward hook on a mixer sees the normalized stream in and the mixer's output out, in training (autograd) and
    inference (chunked) alike: the same values, chunked inference only splitting them along time."""
    model = JRTRNNForCausalLM(make_config()).eval()
    layer = next(layer for layer in model.model.layers if layer.layer_type == mixer_type)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module, args, output):
        output = output[0] if isinstance(output, tuple) else output
        calls.append((args[0].detach().clone(), output.detach().clone()))

    layer.mixer.register_forward_hook(record)
    input_ids = torch.randint(4, 99, (2, 40))
    with torch.enable_grad():
        model(input_ids)
    (train_in, train_out), = calls
    calls.clear()
    set_chunking(monkeypatch, 3 * 2 * 2 * 64)
    with torch.no_grad():
        model(input_ids)
    eval_in = torch.cat([inputs for inputs, _ in calls], dim=1)
    eval_out = torch.cat([output for _, output in calls], dim=1)
    torch.testing.assert_close(eval_in, train_in, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(eval_out, train_out, atol=ATOL, rtol=RTOL)
    assert len(calls) == 1 if mixer_type == "linear_attention" else len(calls) > 1  # whole, or in token chunks
