"""Blocked sliding-window attention: equal to masked full attention, cache continuation, no T x T tensor."""

from __future__ import annotations


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from modeling_jrt import JRTRNNCache
from modeling_jrt.sliding_window import eager_attention_forward
from modeling_jrt.sliding_window import blocked_sliding_window_attention

IMPLEMENTATIONS = ["eager", "sdpa"]
ATOL = RTOL = 1e-5  # fp32


def masked_full_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor, window: int
) -> torch.Tensor:
    """The dense oracle: all T x S scores, additive mask `k_pos in (q_pos - W, q_pos]` and not a pad."""
    num_queries, num_keys = query.shape[2], key.shape[2]
    query_position = torch.arange(num_keys - num_queries, num_keys)[:, None]  # (T, 1)
    key_position = torch.arange(num_keys)[None, :]  # (1, S)
    allowed = (key_position <= query_position) & (key_position > query_position - window)  # (T, S)
    allowed = allowed[None, None] & key_mask[:, None, None, :]  # (B, 1, T, S)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    output, _ = eager_attention_forward(
        torch.nn.Module(), query, key, value, additive, scaling=query.shape[-1] ** -0.5
    )
    return output  # (B, T, H, D)


CASES = [
    # (window, queries T, cached keys before them, pads of row 1, block size)
    pytest.param(*case, id="W{}-T{}-past{}-pads{}-block{}".format(*case))
    for case in [
        (1, 7, 0, 2, None), (2, 7, 0, 2, 3), (3, 1, 2, 0, None), (4, 4, 0, 1, None), (4, 13, 3, 5, 4),
        (5, 3, 0, 1, None), (5, 5, 0, 2, None), (5, 23, 0, 7, None), (5, 23, 0, 7, 4), (5, 9, 4, 3, 2),
        (9, 40, 8, 12, 8), (9, 40, 20, 12, 5), (17, 70, 0, 30, None),
    ]
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window, past, pads", [(1, 0, 0), (1, 3, 2), (4, 2, 0), (4, 3, 2), (4, 9, 6), (9, 20, 12)])
def test_one_query_equals_masked_full_attention(implementation, window, past, pads):
    """A decode step (one query): fewer cached keys than the window, exactly W - 1, more; padding among the visible
    keys and padding covering every key but the query's own (row 1, pads = past)."""
    batch, heads, head_dim = 2, 3, 8
    query = torch.randn(batch, heads, 1, head_dim)
    key = torch.randn(batch, heads, past + 1, head_dim)
    value = torch.randn(batch, heads, past + 1, head_dim)
    key_mask = torch.ones(batch, past + 1, dtype=torch.bool)
    key_mask[1, :pads] = False
    for mask, visible in ((key_mask, key_mask), (None, torch.ones_like(key_mask))):
        output = blocked_sliding_window_attention(
            query, key, value, mask, sliding_window=window, scaling=head_dim**-0.5, implementation=implementation
        )
        expected = masked_full_attention(query, key, value, visible, window)
        assert output.shape == (batch, 1, heads, head_dim) and output.is_contiguous()
        torch.testing.assert_close(output, expected, rtol=RTOL, atol=ATOL)


def test_one_query_whose_keys_are_all_padding_stays_finite():
    """A padded query (don't-care) whose every visible key is padding gets a finite output, as in the blocked path."""
    query, key, value = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    key_mask = torch.zeros(1, 5, dtype=torch.bool)
    for implementation in IMPLEMENTATIONS:
        output = blocked_sliding_window_attention(
            query, key, value, key_mask, sliding_window=3, scaling=0.5, implementation=implementation
        )
        assert torch.isfinite(output).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window, length, past, pads, block", CASES)
def test_blocked_equals_masked_full_attention(implementation, window, length, past, pads, block):
    """T below, equal to and above the window, several blocks, a cached window in front, left padding; windows
    1 ... 4 included. Padded queries are don't-care but must stay finite (they feed the next layers)."""
    batch, heads, head_dim = 2, 3, 8
    query = torch.randn(batch, heads, length, head_dim)
    key = torch.randn(batch, heads, past + length, head_dim)
    value = torch.randn(batch, heads, past + length, head_dim)
    key_mask = torch.ones(batch, past + length, dtype=torch.bool)
    key_mask[1, :pads] = False
    output = blocked_sliding_window_attention(
        query, key, value, key_mask,
        sliding_window=window, scaling=head_dim**-0.5, implementation=implementation, block_size=block,
    )
    expected = masked_full_attention(query, key, value, key_mask, window)
    real_queries = key_mask[:, past:]
    assert output.shape == (batch, length, heads, head_dim)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output[real_queries], expected[real_queries], rtol=RTOL, atol=ATOL)
    unpadded = blocked_sliding_window_attention(
        query, key, value, None,
        sliding_window=window, scaling=head_dim**-0.5, implementation=implementation, block_size=block,
    )
    torch.testing.assert_close(unpadded[0], output[0], rtol=RTOL, atol=ATOL)


def test_blocked_rejects_an_implementation_without_a_blocked_path():
    tensor = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="implementation='flash_attention_2' is not blocked"):
        blocked_sliding_window_attention(
            tensor, tensor, tensor, None, sliding_window=2, scaling=1.0, implementation="flash_attention_2"
        )


def build(make_config, implementation: str, **overrides):
    config = make_config(linear_attention_chunk_size=16, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def dense_logits(model, input_ids, **kwargs) -> torch.Tensor:
    """The logits of the dense path: a forward that returns the attention weights runs eager attention with the full
    `(B, 1, T, S)` sliding mask (`sliding_window_additive_mask`), i.e. what the blocked path avoids."""
    return model(input_ids, output_attentions=True, **kwargs).logits


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window", [2, 5, 9])
def test_model_blocked_prefill_equals_dense_masked_prefill(make_config, implementation, window):
    """Whole model, left-padded batch, T = 150 (several 64-row blocks) against the dense-mask path."""
    model = build(make_config, implementation, sliding_window=window)
    input_ids = torch.randint(4, 99, (2, 150))
    mask = torch.ones_like(input_ids)
    mask[1, :37] = 0
    with torch.no_grad():
        blocked_logits = model(input_ids, attention_mask=mask).logits
        dense = dense_logits(model, input_ids, attention_mask=mask)
    torch.testing.assert_close(blocked_logits[mask.bool()], dense[mask.bool()], rtol=RTOL, atol=ATOL)


def assert_cached_forwards_equal_one_shot(model, input_ids, mask, ends):
    """Forwards of input_ids[:, previous end : end] through one cache, for each end in `ends` (a prefill, then
    chunks or single-token decode steps), give the logits of one forward over everything (real tokens compared)."""
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask, use_cache=False).logits
        cache = JRTRNNCache(model.config)
        starts = [0, *ends[:-1]]
        pieces = [
            model(input_ids[:, start:end], attention_mask=mask[:, :end], cache=cache).logits
            for start, end in zip(starts, ends)
        ]
    assert ends[-1] == input_ids.shape[1]
    logits = torch.cat(pieces, dim=1)
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 70])
def test_decode_and_chunked_prefill_after_blocked_prefill_equal_the_parallel_forward(
    make_config, implementation, window
):
    """Prefill 90 tokens (blocked, two blocks), continue with a 37-token chunk (blocked, cached window in front),
    then decode token by token: every logit equals the one-shot parallel forward, left padding included."""
    model = build(make_config, implementation, sliding_window=window)
    input_ids = torch.randint(4, 99, (2, 135))
    mask = torch.ones_like(input_ids)
    mask[1, :11] = 0
    assert_cached_forwards_equal_one_shot(model, input_ids, mask, ends=[90, 127, *range(128, 136)])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [2, 3, 40])
def test_chunked_blocked_prefill_equals_one_shot_for_tiny_windows(make_config, implementation, window, chunk):
    """Multi-token forwards through the cache (chunks after a 50-token prefill) equal one shot, for windows 1 ... 4,
    whatever the cache keeps in front of the new keys."""
    model = build(make_config, implementation, sliding_window=window)
    input_ids = torch.randint(4, 99, (2, 130))
    mask = torch.ones_like(input_ids)
    mask[0, :6] = 0
    ends = [50, *(min(start + chunk, 130) for start in range(50, 130, chunk))]
    assert_cached_forwards_equal_one_shot(model, input_ids, mask, ends=ends)


def test_key_mask_shorter_than_the_keys_is_a_clear_error(make_config):
    model = build(make_config, "sdpa")
    input_ids = torch.randint(4, 99, (1, 12))
    cache = JRTRNNCache(model.config)
    with torch.no_grad():
        model(input_ids[:, :8], cache=cache)
        with pytest.raises(ValueError, match="has 4 columns but the cache holds 8 tokens and the input 4"):
            model(input_ids[:, 8:], attention_mask=torch.ones(1, 4, dtype=torch.long), cache=cache)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op returns (allocations included)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        for tensor in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                self.numel, self.op = tensor.numel(), func
        return output


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_prefill_at_4096_tokens_allocates_no_t_by_t_tensor(make_config, implementation):
    """Every op of a padded whole-model prefill (masks, RoPE, conv, linear and sliding attention) at T = 4096: no
    output holds T * T elements. The dense sliding mask alone has T * T (and eager's scores H * T * T)."""
    length = 4096
    model = build(make_config, implementation)
    input_ids = torch.randint(4, 99, (1, length))
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    with torch.no_grad(), LargestTensor() as largest:
        model(input_ids, attention_mask=mask, cache=JRTRNNCache(model.config), logits_to_keep=1)
    assert largest.numel < length * length // 16, (largest.numel, largest.op)


def test_the_largest_tensor_hook_sees_a_dense_mask(make_config):
    """The hook above can fail: the dense-mask path at T = 1024 trips it."""
    length = 1024
    model = build(make_config, "eager")
    input_ids = torch.randint(4, 99, (1, length))
    with torch.no_grad(), LargestTensor() as largest:
        dense_logits(model, input_ids, attention_mask=torch.ones_like(input_ids), logits_to_keep=1)
    assert largest.numel >= length * length


@pytest.mark.parametrize("implementation", ["eager"])
def test_set_attn_implementation_switches_the_sliding_layers(make_config, implementation, caplog):
    model = build(make_config, "sdpa")
    input_ids = torch.randint(4, 99, (2, 19))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask).logits
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        assert model.model.layers[2].mixer.config._attn_implementation == implementation
        logits = model(input_ids, attention_mask=mask).logits
    assert "does not support setting its attention implementation" not in caplog.text
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()], rtol=RTOL, atol=ATOL)


def test_windowed_kernels_are_declared(make_config):
    model = build(make_config, "sdpa")
    assert model._supports_flash_attn and model._supports_sdpa
    assert not model._supports_flex_attn  # flex attention takes a BlockMask: the sliding layers pass a key mask
    assert model._can_set_attn_implementation()
    assert model._can_compile_fullgraph


@pytest.mark.slow
def test_fullgraph_compile_of_prefill_and_padded_decode(make_config):
    """`_can_compile_fullgraph`: an unpadded prefill and a padded decode step trace with fullgraph=True and agree."""
    model = build(make_config, "sdpa")
    compiled = torch.compile(model, fullgraph=True)
    input_ids = torch.randint(4, 99, (2, 19))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(input_ids, use_cache=False).logits, model(input_ids, use_cache=False).logits, rtol=1e-5, atol=1e-5
        )
        expected = model(input_ids, attention_mask=mask).logits[:, -1]
        cache = JRTRNNCache(model.config)
        model(input_ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)
        step = compiled(input_ids[:, -1:], attention_mask=mask, cache=cache).logits[:, -1]
    torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_blocked_gradients_equal_masked_full_attention(implementation):
    """Training runs the blocked path too: the gradients of q, k and v match the dense oracle's."""
    window, length, heads, head_dim = 5, 23, 2, 8
    inputs = [torch.randn(1, heads, length, head_dim, requires_grad=True) for _ in range(3)]
    reference = [x.detach().clone().requires_grad_() for x in inputs]
    key_mask = torch.ones(1, length, dtype=torch.bool)
    grad = torch.randn(1, length, heads, head_dim)
    output = blocked_sliding_window_attention(
        *inputs, key_mask, sliding_window=window, scaling=head_dim**-0.5, implementation=implementation, block_size=4
    )
    (output * grad).sum().backward()
    (masked_full_attention(*reference, key_mask, window) * grad).sum().backward()
    for name, actual, expected in zip("qkv", inputs, reference):
        torch.testing.assert_close(actual.grad, expected.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.slow
def test_generate_reads_a_64k_prompt_without_quadratic_tensors(make_config):
    """A 65536-token prompt through `generate()`: before the blocked path the sliding mask alone had 2**32 elements
    (4 GiB as bool, 16 GiB as eager's float mask). Now no op output reaches 256 * T elements (T * T = 65536 * T)."""
    length = 65536
    model = build(make_config, "sdpa")
    input_ids = torch.randint(4, 99, (1, length))
    with torch.no_grad(), LargestTensor() as largest:
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, length + 3)
    assert largest.numel < 256 * length, (largest.numel, largest.op)


GENERATE_CHUNKS = [
    # (linear attention type, left pads of row 1, prefill_chunk_size); the tiny config's prefix is 8 tokens
    pytest.param("prefix", 3, 11, id="jrt-pads3-chunk11"),  # the padded row's encoder ends at 3 + 8 = 11
    pytest.param("prefix", 3, 64, id="jrt-pads3-chunk64"),
    pytest.param("causal", 9, 8, id="based-pads9-chunk8"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind, pads, chunk", GENERATE_CHUNKS)
def test_generate_with_prefill_chunk_size_equals_one_shot(make_config, implementation, kind, pads, chunk):
    """transformers' chunked prefill runs the blocked attention with the cached window in front of each chunk: the
    same scores and tokens as one prefill, for a left-padded batch whose encoder fits in the first chunk."""
    model = build(make_config, implementation, sliding_window=5, linear_attention_type=kind)
    input_ids = torch.randint(4, 99, (2, 150))
    mask = torch.ones_like(input_ids)
    mask[1, :pads] = 0
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                    return_dict_in_generate=True)
    with torch.no_grad():
        one_shot = model.generate(input_ids, **settings)
        chunked = model.generate(input_ids, prefill_chunk_size=chunk, **settings)
    assert torch.equal(chunked.sequences, one_shot.sequences)
    torch.testing.assert_close(torch.stack(chunked.scores), torch.stack(one_shot.scores), rtol=1e-4, atol=1e-4)
