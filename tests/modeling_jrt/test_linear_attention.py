"""Prefix / causal Taylor linear attention: chunked scan and decode step against the fp64 oracle, and the oracle
against a scalar-kernel loop written from docs/reference_architecture.md §1.3-1.5 (independent of the feature-map
code)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import saved_for_backward_bytes
from modeling_jrt.linear_attention import (
    linear_attention_step,
    num_taylor_features,
    prefix_linear_attention,
    prefix_linear_attention_chunked,
    prefix_linear_attention_quadratic,
    taylor_feature_map,
)

FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def make_inputs(batch=2, seq_len=37, heads=2, feature_dim=4, value_dim=8, encoder_length=10, dtype=torch.float64):
    """q, k ~ randn so that s = q.k / sqrt(K) ~ N(0, 1) and the 2nd-order term matters."""
    q = torch.randn(batch, seq_len, heads, feature_dim, dtype=dtype)
    k = torch.randn(batch, seq_len, heads, feature_dim, dtype=dtype)
    v = torch.randn(batch, seq_len, heads, value_dim, dtype=dtype) + 0.5
    k_enc = torch.randn(batch, encoder_length, heads, feature_dim, dtype=dtype) if encoder_length else None
    v_enc = torch.randn(batch, encoder_length, heads, value_dim, dtype=dtype) + 0.5 if encoder_length else None
    return q, k, v, k_enc, v_enc


def scalar_kernel_reference(
    q, k, v, k_enc, v_enc, key_mask=None, pad_masking="strict", log_decay=None, gate=None, starts=None, ends=None
):
    """y_i = [sum_m w(q_i, ke_m) ve_m + sum_{j<=i} d_ij g_i w(q_i, k_j) v_j] / [sum_m w + sum_{j<=i} w], loops only.

    w(q, k) = 1 + s + s^2 / 2 with s = q.k / sqrt(K). The encoder of row b is m in [starts[b], ends[b]) (default
    [0, M)). A padded key is skipped, except under reference masking inside the row's encoder range: there its raw
    key is zeroed, so it still gets weight 1."""
    batch, seq_len, heads, feature_dim = q.shape
    encoder_length = 0 if k_enc is None else k_enc.shape[1]
    starts = [0] * batch if starts is None else starts
    ends = [encoder_length] * batch if ends is None else ends
    out = torch.zeros_like(v)

    def weight(query, key):
        s = float(query @ key) / math.sqrt(feature_dim)
        return 1.0 + s + 0.5 * s * s

    for b in range(batch):
        for h in range(heads):
            for i in range(seq_len):
                numerator = torch.zeros(v.shape[-1], dtype=v.dtype)
                denominator = 0.0
                keys = [("enc", m) for m in range(starts[b], ends[b])] + [("dec", j) for j in range(i + 1)]
                for kind, j in keys:
                    key = (k_enc if kind == "enc" else k)[b, j, h]
                    value = (v_enc if kind == "enc" else v)[b, j, h]
                    if key_mask is not None and not key_mask[b, j]:
                        if pad_masking == "strict" or not starts[b] <= j < ends[b]:
                            continue
                        key = torch.zeros_like(key)
                    w = weight(q[b, i, h], key)
                    factor = 1.0
                    if kind == "dec" and log_decay is not None:
                        factor = math.exp(float(log_decay[h]) * (i - j))
                    numerator = numerator + factor * w * value
                    denominator += w
                if gate is not None:
                    numerator = numerator * gate[b, i, h]
                out[b, i, h] = numerator / (denominator + 1e-12)
    return out


def test_taylor_feature_map_kernel_identity():
    x, y = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    s = (x * y).sum(-1) / 4.0
    phi_x, phi_y = taylor_feature_map(x), taylor_feature_map(y)
    assert phi_x.shape == (5, num_taylor_features(16)) == (5, 273)
    torch.testing.assert_close((phi_x * phi_y).sum(-1), 1 + s + s**2 / 2)
    # Layout: [1 | x / 2 | x_i x_j / (4 sqrt 2)], row-major over all ordered pairs.
    torch.testing.assert_close(phi_x[:, 0], torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(phi_x[:, 1:17], x / 2)
    torch.testing.assert_close(phi_x[:, 17 + 3 * 16 + 5], x[:, 3] * x[:, 5] / (4 * math.sqrt(2)))


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
@pytest.mark.parametrize(
    "encoder_length,starts,ends",
    [(0, None, None), (4, None, None), (6, [0, 1, 2], [0, 4, 6])],
    ids=["causal", "M4-all-rows", "per-row-ranges"],
)
def test_oracle_matches_scalar_kernel_loop(encoder_length, starts, ends, pad_masking):
    q, k, v, k_enc, v_enc = make_inputs(batch=3, seq_len=9, heads=2, feature_dim=3, value_dim=3,
                                        encoder_length=encoder_length)
    key_mask = torch.ones(3, 9, dtype=torch.bool)
    key_mask[1, :3] = False  # row 1: a masked key before (0) and inside (1, 2) its range
    key_mask[2, 1:4] = False  # row 2: outside (1) and inside (2, 3) its range
    expected = scalar_kernel_reference(q, k, v, k_enc, v_enc, key_mask, pad_masking, starts=starts, ends=ends)
    ranges = {} if starts is None else dict(encoder_start=torch.tensor(starts), encoder_end=torch.tensor(ends))
    actual, _ = prefix_linear_attention_quadratic(
        q, k, v, k_enc, v_enc, key_mask=key_mask, pad_masking=pad_masking, **ranges
    )
    torch.testing.assert_close(actual[0], expected[0])
    torch.testing.assert_close(actual[1, 3:], expected[1, 3:])  # valid query positions
    torch.testing.assert_close(actual[2, 4:], expected[2, 4:])


def test_oracle_decay_and_gate_match_scalar_kernel_loop():
    q, k, v, _, _ = make_inputs(batch=1, seq_len=8, heads=2, feature_dim=3, value_dim=2, encoder_length=0)
    log_decay = torch.log1p(-torch.pow(2.0, -1.0 - torch.arange(2, dtype=torch.float64)))
    gate = torch.randn(1, 8, 2, dtype=torch.float64)
    expected = scalar_kernel_reference(q, k, v, None, None, log_decay=log_decay, gate=gate)
    actual, _ = prefix_linear_attention_quadratic(q, k, v, log_decay=log_decay, gate=gate)
    torch.testing.assert_close(actual, expected)


CHUNKED_CASES = [
    pytest.param(2, 64, 2, 64, 32, 16, id="B2-T64-M32-V64-multiple-of-chunk"),
    pytest.param(2, 61, 2, 64, 20, 16, id="B2-T61-M20-V64-ragged"),
    pytest.param(1, 45, 3, 112, 45, 16, id="B1-T45-M45-V112-prefix-is-all"),
    pytest.param(2, 50, 2, 112, 0, 16, id="B2-T50-M0-V112-causal-based"),
    pytest.param(1, 33, 2, 64, 1, 7, id="B1-T33-M1-chunk7"),
    pytest.param(2, 5, 2, 64, 3, 16, id="B2-T5-shorter-than-chunk"),
]


@pytest.mark.parametrize("batch,seq_len,heads,value_dim,encoder_length,chunk_size", CHUNKED_CASES)
def test_chunked_fp32_matches_fp64_oracle(batch, seq_len, heads, value_dim, encoder_length, chunk_size):
    q, k, v, k_enc, v_enc = make_inputs(batch, seq_len, heads, 16, value_dim, encoder_length)
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc)
    as32 = [None if t is None else t.float() for t in (q, k, v, k_enc, v_enc)]
    actual, state = prefix_linear_attention_chunked(*as32, chunk_size=chunk_size)
    assert actual.dtype == torch.float32 and state.dtype == torch.float32
    assert state.shape == (batch, heads, 273, value_dim + 1)
    torch.testing.assert_close(actual, expected.float(), **FP32_TOL)
    torch.testing.assert_close(state, expected_state.float(), rtol=1e-5, atol=1e-5 * expected_state.abs().max().item())


BLOCK_CASES = [
    pytest.param(dict(), id="prefix"),
    pytest.param(dict(padded=True, initial=True), id="prefix-padding-initial-state"),
    pytest.param(dict(encoder=False, decay=True), id="based-decay"),
    pytest.param(dict(encoder=False, decay=True, gate=True, padded=True, initial=True), id="based-decay-gate-all"),
    pytest.param(dict(holes=True, ranges=True, reference=True, initial=True), id="prefix-ranges-holes-reference"),
    pytest.param(dict(holes=True, ranges=True, initial=True), id="prefix-ranges-holes-strict"),
    pytest.param(dict(encoder=False, gate=True, padded=True), id="causal-gate"),
]


def block_case_inputs(case: dict, batch: int = 2, seq_len: int = 23, heads: int = 2):
    """(q, k, v, k_enc, v_enc, kwargs) of a BLOCK_CASES case: fp64, K = 4, V = 5, M = 7 (none without an encoder)."""
    q, k, v, k_enc, v_enc = make_inputs(batch, seq_len, heads, 4, 5, 7 if case.get("encoder", True) else 0)
    kwargs = {}
    if case.get("decay"):
        kwargs["log_decay"] = torch.log(torch.tensor([0.8, 0.95], dtype=torch.float64))
    if case.get("gate"):
        kwargs["gate"] = torch.randn(batch, seq_len, heads, dtype=torch.float64)
    if case.get("padded"):
        key_mask = torch.ones(batch, seq_len, dtype=torch.bool)
        key_mask[0, :4] = False
        kwargs["key_mask"] = key_mask
    if case.get("holes"):  # a mask with holes inside and outside the encoder ranges
        key_mask = torch.rand(batch, seq_len) > 0.3
        key_mask[:, -1] = True
        kwargs["key_mask"] = key_mask
    if case.get("ranges"):
        kwargs["encoder_start"], kwargs["encoder_end"] = torch.tensor([1, 0]), torch.tensor([6, 7])
    if case.get("reference"):
        kwargs["pad_masking"] = "reference"
    if case.get("initial"):
        kwargs["initial_state"] = torch.randn(batch, heads, num_taylor_features(4), 6, dtype=torch.float64)
    return q, k, v, k_enc, v_enc, kwargs


@pytest.mark.parametrize("case", BLOCK_CASES)
@pytest.mark.parametrize("block_token_heads", [1, 12, 1 << 20], ids=["block1", "block3", "one-block"])
def test_chunked_blocks_match_oracle(monkeypatch, case, block_token_heads):
    """The eager scan in blocks of chunks (state carried between blocks) and in one block matches the oracle, with a
    last chunk shorter than the others: without autograd (the in-place scan of inference) and with it (the custom
    op with the explicit backward)."""
    import modeling_jrt.chunked_scan as chunked_scan

    monkeypatch.setattr(chunked_scan, "BLOCK_TOKEN_HEADS", block_token_heads)
    monkeypatch.setattr(chunked_scan, "ENCODER_BLOCK_TOKEN_HEADS", block_token_heads)
    q, k, v, k_enc, v_enc, kwargs = block_case_inputs(case)
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **kwargs)
    valid = kwargs.get("key_mask", torch.ones(q.shape[:2], dtype=torch.bool))[..., None, None]
    for differentiable in (False, True):
        inputs = [None if t is None else t.clone().requires_grad_(differentiable) for t in (q, k, v, k_enc, v_enc)]
        actual, state = prefix_linear_attention_chunked(*inputs, chunk_size=4, **kwargs)
        torch.testing.assert_close(actual * valid, expected * valid, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state, expected_state, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", BLOCK_CASES)
@pytest.mark.parametrize("block_token_heads,chunk_size", [(1, 4), (12, 4), (1 << 20, 64)],
                         ids=["block1", "block3", "one-chunk"])
def test_chunked_gradients_match_oracle(monkeypatch, case, block_token_heads, chunk_size):
    """The explicit backward (two sweeps over the chunks) gives autograd's gradients through the fp64 oracle for every
    differentiable input (q, k, v, the encoder's, the gate and the initial state), from a loss on the output at the
    real positions and on the final state: masks, ranges, both pad maskings, decay, blocks of one chunk and more,
    and one chunk longer than the sequence."""
    import modeling_jrt.chunked_scan as chunked_scan

    monkeypatch.setattr(chunked_scan, "BLOCK_TOKEN_HEADS", block_token_heads)
    monkeypatch.setattr(chunked_scan, "ENCODER_BLOCK_TOKEN_HEADS", block_token_heads)
    q, k, v, k_enc, v_enc, kwargs = block_case_inputs(case)
    valid = kwargs.get("key_mask", torch.ones(q.shape[:2], dtype=torch.bool))[..., None, None]
    weights = torch.randn(q.shape[:3] + v.shape[-1:], dtype=torch.float64) * valid
    state_weights = torch.randn(q.shape[0], q.shape[2], num_taylor_features(4), 6, dtype=torch.float64)
    names = [name for name in ("gate", "initial_state") if name in kwargs]
    gradients = []
    for function, extra in ((prefix_linear_attention_chunked, dict(chunk_size=chunk_size)),
                            (prefix_linear_attention_quadratic, {})):
        leaves = [None if t is None else t.clone().requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
        options = {**kwargs, **{name: kwargs[name].clone().requires_grad_(True) for name in names}}
        output, state = function(*leaves, **options, **extra)
        wanted = [t for t in leaves if t is not None] + [options[name] for name in names]
        gradients.append(torch.autograd.grad((output * weights).sum() + (state * state_weights).sum(), wanted))
    for actual, expected in zip(*gradients):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9 * expected.abs().max().item())


@pytest.mark.parametrize("batch,seq_len", [(2, 0), (0, 5), (0, 0)], ids=["no-tokens", "no-rows", "neither"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-state", "initial-state"])
def test_empty_inputs_match_oracle(batch, seq_len, with_initial_state):
    """No tokens or no rows: an empty output and the unchanged state, as the oracle gives (the chunked path used to
    fail on them with `range() arg 3 must not be zero` / a division by zero); the state keeps its gradient path."""
    q, k, v, _, _ = make_inputs(batch, seq_len, 2, 4, 5, 0)
    initial = torch.randn(batch, 2, num_taylor_features(4), 6, dtype=torch.float64) if with_initial_state else None
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, initial_state=initial)
    for differentiable in (False, True):
        leaf = None if initial is None else initial.clone().requires_grad_(differentiable)
        for run in (prefix_linear_attention_chunked, prefix_linear_attention):
            actual, state = run(q, k, v, initial_state=leaf)
            assert actual.shape == expected.shape == (batch, seq_len, 2, 5)
            torch.testing.assert_close(state, expected_state)
        if differentiable and leaf is not None:
            state.sum().backward()
            torch.testing.assert_close(leaf.grad, torch.ones_like(leaf))


@pytest.mark.parametrize("differentiable", [False, True], ids=["inference", "autograd"])
def test_chunked_empty_encoder_is_no_encoder(differentiable):
    """Encoder tensors with M = 0 (an empty prompt prefix) give the causal result, in both executions (the inference
    scan used to fail on them with `range() arg 3 must not be zero`)."""
    q, k, v, _, _ = make_inputs(2, 11, 2, 4, 5, 0, dtype=torch.float32)
    expected, expected_state = prefix_linear_attention_chunked(q, k, v, chunk_size=4)
    inputs = [t.clone().requires_grad_(differentiable) for t in (q, k, v, k[:, :0], v[:, :0])]
    actual, state = prefix_linear_attention_chunked(*inputs, chunk_size=4)
    torch.testing.assert_close(actual, expected, **FP32_TOL)
    torch.testing.assert_close(state, expected_state, **FP32_TOL)


@pytest.mark.parametrize("with_decay", [False, True], ids=["prefix", "based-decay"])
def test_chunked_traces_one_graph_for_every_length(with_decay):
    """Under torch.compile(dynamic=True) the scan is one graph without a loop over T: a full-graph trace, no
    recompilation at a new length, the eager results (aot_eager: the traced graph without inductor's C++ build)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(prefix_linear_attention_chunked, dynamic=True, fullgraph=True, backend="aot_eager")
    for seq_len in (37, 70):
        q, k, v, k_enc, v_enc = make_inputs(2, seq_len, 2, 4, 8, 0 if with_decay else 9, dtype=torch.float32)
        kwargs = dict(log_decay=torch.log(torch.tensor([0.9, 0.99]))) if with_decay else {}
        with torch.no_grad():
            actual, state = compiled(q, k, v, k_enc, v_enc, chunk_size=16, **kwargs)
            expected, expected_state = prefix_linear_attention_chunked(q, k, v, k_enc, v_enc, chunk_size=16, **kwargs)
        torch.testing.assert_close(actual, expected, **FP32_TOL)
        torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("differentiable", [False, True], ids=["inference", "training"])
def test_compiled_scan_is_one_opaque_op(differentiable):
    """The compiled graph calls the chunked scan as one custom op whatever T is, without autograd and with it (the
    op's backward is a custom op too): no matmul of the scan is traced."""
    import torch._dynamo
    from modeling_jrt import chunked_scan_autograd

    torch._dynamo.reset()
    graph_ops = []

    def backend(graph_module, example_inputs):
        graph_ops.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module

    compiled = torch.compile(prefix_linear_attention_chunked, dynamic=True, fullgraph=True, backend=backend)
    inputs = [t.requires_grad_(differentiable) for t in make_inputs(2, 300, 2, 4, 8, 100, dtype=torch.float32)]
    compiled(*inputs)
    op_name = chunked_scan_autograd._OP_PREFIX.split("::")[1] + "_scan"
    assert any(op_name in op for op in graph_ops), graph_ops
    assert not any("bmm" in op or "matmul" in op for op in graph_ops), graph_ops


@pytest.mark.parametrize("with_decay", [False, True], ids=["prefix", "based-decay"])
def test_compiled_training_graph_matches_eager_gradients(with_decay):
    """With autograd the compiled graph holds the scan's custom op and its backward; its gradients are the eager
    ones."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(prefix_linear_attention_chunked, fullgraph=True, backend="aot_eager")
    q, k, v, k_enc, v_enc = make_inputs(2, 45, 2, 4, 8, 0 if with_decay else 9, dtype=torch.float64)
    kwargs = dict(log_decay=torch.log(torch.tensor([0.9, 0.99], dtype=torch.float64))) if with_decay else {}
    leaves = [None if t is None else t.clone().requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
    grads = []
    for function in (compiled, prefix_linear_attention_chunked):
        output, state = function(*leaves, chunk_size=16, **kwargs)
        wanted = [t for t in leaves if t is not None]
        grads.append(torch.autograd.grad((output * output).sum() + state.sum(), wanted))
    for actual, expected in zip(*grads):
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_chunked_with_padding_and_initial_state_matches_oracle(pad_masking):
    q, k, v, k_enc, v_enc = make_inputs(2, 29, 2, 4, 8, 12)
    key_mask = torch.ones(2, 29, dtype=torch.bool)
    key_mask[0, :5] = False
    key_mask[1, :14] = False  # more pads than the encoder covers
    state0 = torch.rand(2, 2, num_taylor_features(4), 9, dtype=torch.float64)
    kwargs = dict(key_mask=key_mask, pad_masking=pad_masking, initial_state=state0)
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **kwargs)
    actual, state = prefix_linear_attention_chunked(q, k, v, k_enc, v_enc, chunk_size=6, **kwargs)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(state, expected_state)


def test_strict_padding_equals_unpadded_row():
    """A left-padded row gives, at its real positions, exactly the outputs and state of the unpadded row."""
    pads, seq_len, encoder_length = 6, 20, 9
    q, k, v, k_enc, v_enc = make_inputs(1, seq_len, 2, 4, 8, encoder_length)
    key_mask = torch.ones(1, seq_len, dtype=torch.bool)
    key_mask[:, :pads] = False
    padded, padded_state = prefix_linear_attention_chunked(
        q, k, v, k_enc, v_enc, key_mask=key_mask, pad_masking="strict", chunk_size=4
    )
    real = slice(pads, None)
    unpadded, unpadded_state = prefix_linear_attention_chunked(
        q[:, real], k[:, real], v[:, real], k_enc[:, pads:], v_enc[:, pads:], chunk_size=4
    )
    torch.testing.assert_close(padded[:, real], unpadded)
    torch.testing.assert_close(padded_state, unpadded_state)


def test_reference_padding_reproduces_the_constant_term_leak():
    """reference masking: each pad adds its value with weight exactly 1 (phi(q).phi(0) = 1),
    docs/reference_architecture.md §2.1."""
    pads, seq_len = 3, 10
    q, k, v, k_enc, v_enc = make_inputs(1, seq_len, 1, 4, 2, seq_len)
    key_mask = torch.ones(1, seq_len, dtype=torch.bool)
    key_mask[:, :pads] = False
    leaky, _ = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, key_mask=key_mask, pad_masking="reference")
    strict, _ = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, key_mask=key_mask, pad_masking="strict")
    assert (leaky[:, pads:] - strict[:, pads:]).abs().max() > 1e-3  # the leak is visible

    # Rebuild the leaky output from strict sums plus weight-1 pad terms.
    s_dec = torch.einsum("bihk,bjhk->bhij", q, k)[0, 0] / 2.0
    s_enc = torch.einsum("bihk,bjhk->bhij", q, k_enc)[0, 0] / 2.0
    w_dec = (1 + s_dec + s_dec**2 / 2).tril()
    w_enc = 1 + s_enc + s_enc**2 / 2
    w_dec[:, :pads] = 1.0
    w_dec = w_dec.tril()
    w_enc[:, :pads] = 1.0
    numerator = w_dec @ v[0, :, 0] + w_enc @ v_enc[0, :, 0]
    denominator = w_dec.sum(-1) + w_enc.sum(-1)
    torch.testing.assert_close(leaky[0, :, 0], numerator / denominator[:, None])


def test_fully_padded_row_gives_zeros_not_nan():
    q, k, v, k_enc, v_enc = make_inputs(2, 12, 2, 4, 8, 5, dtype=torch.float32)
    key_mask = torch.ones(2, 12, dtype=torch.bool)
    key_mask[1] = False
    out, state = prefix_linear_attention_chunked(q, k, v, k_enc, v_enc, key_mask=key_mask, chunk_size=4)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert out[1].abs().max() == 0 and state[1].abs().max() == 0


def test_prefix_is_non_causal_and_decoder_is_causal():
    """Changing an encoder (prefix) token changes earlier outputs; a token after the prefix changes none."""
    q, k, v, k_enc, v_enc = make_inputs(1, 16, 2, 4, 8, 8)
    base, _ = prefix_linear_attention_chunked(q, k, v, k_enc, v_enc, chunk_size=4)
    k_enc2, v_enc2 = k_enc.clone(), v_enc.clone()
    k_enc2[:, 6] += 1.0
    v_enc2[:, 6] += 1.0
    changed, _ = prefix_linear_attention_chunked(q, k, v, k_enc2, v_enc2, chunk_size=4)
    assert (changed[:, :6] - base[:, :6]).abs().max() > 1e-3  # positions before 6 see the prefix token
    k2, v2 = k.clone(), v.clone()
    k2[:, 11] += 1.0
    v2[:, 11] += 1.0
    changed, _ = prefix_linear_attention_chunked(q, k2, v2, k_enc, v_enc, chunk_size=4)
    torch.testing.assert_close(changed[:, :11], base[:, :11], rtol=0, atol=0)
    assert (changed[:, 11:] - base[:, 11:]).abs().max() > 1e-3


@pytest.mark.parametrize("chunk_size", [5, 32], ids=["chunks-of-5", "one-short-chunk"])
@pytest.mark.parametrize("with_gate", [False, True])
def test_based_decay_parallel_equals_recurrent(with_gate, chunk_size):
    """Parallel (chunked and oracle) decay form == its recurrent definition S_t = gamma S_{t-1} + phi(k_t) v_t; the
    chunked scan here is the inference one (no autograd), whose last chunk decays over its own length."""
    heads = 3
    q, k, v, _, _ = make_inputs(2, 21, heads, 4, 6, 0)
    log_decay = torch.log1p(-torch.pow(2.0, -3.0 - torch.arange(heads, dtype=torch.float64)))
    gate = torch.randn(2, 21, heads, dtype=torch.float64) if with_gate else None
    parallel, parallel_state = prefix_linear_attention_chunked(
        q, k, v, log_decay=log_decay, gate=gate, chunk_size=chunk_size
    )
    oracle, oracle_state = prefix_linear_attention_quadratic(q, k, v, log_decay=log_decay, gate=gate)
    state = torch.zeros(2, heads, num_taylor_features(4), 7, dtype=torch.float64)
    steps = []
    for t in range(21):
        out, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state, log_decay=log_decay,
                                           gate=None if gate is None else gate[:, t])
        steps.append(out)
    recurrent = torch.stack(steps, dim=1)
    torch.testing.assert_close(parallel, recurrent)
    torch.testing.assert_close(oracle, recurrent)
    torch.testing.assert_close(parallel_state, state)
    torch.testing.assert_close(oracle_state, state)


@pytest.mark.parametrize("variant", ["prefix", "decay", "decay-gate"])
def test_step_in_place_equals_functional(variant):
    """`in_place=True` updates the given state tensor and gives the functional step's output and state; under
    autograd, or for a state that is not contiguous, it leaves the state alone and returns a new one."""
    heads = 3
    q, k, v, _, _ = make_inputs(2, 1, heads, 4, 6, 0)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    kwargs = {}
    if variant != "prefix":
        kwargs["log_decay"] = torch.log(torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    if variant == "decay-gate":
        kwargs["gate"] = torch.rand(2, heads, dtype=torch.float64)
    state = torch.randn(2, heads, num_taylor_features(4), 7, dtype=torch.float64).abs()
    expected_out, expected_state = linear_attention_step(q, k, v, state.clone(), **kwargs)
    owned = state.clone()
    out, new_state = linear_attention_step(q, k, v, owned, in_place=True, **kwargs)
    assert new_state is owned
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(owned, expected_state, rtol=1e-12, atol=1e-12)

    leaf = state.clone().requires_grad_(True)
    out, new_state = linear_attention_step(q, k, v, leaf, in_place=True, **kwargs)
    assert new_state is not leaf and torch.equal(leaf.detach(), state)
    out.sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0

    strided = state.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, not contiguous
    out, new_state = linear_attention_step(q, k, v, strided, in_place=True, **kwargs)
    assert torch.equal(strided, state)
    torch.testing.assert_close(new_state, expected_state, rtol=1e-12, atol=1e-12)

    with torch.inference_mode():  # a cache filled under inference_mode, continued outside it
        frozen = state.clone()
    with torch.no_grad():
        out, new_state = linear_attention_step(q, k, v, frozen, in_place=True, **kwargs)
    assert new_state is not frozen and torch.equal(frozen, state)
    torch.testing.assert_close(new_state, expected_state, rtol=1e-12, atol=1e-12)
    with torch.inference_mode():  # and inside it: in place
        frozen = state.clone()
        out, new_state = linear_attention_step(q, k, v, frozen, in_place=True, **kwargs)
        assert new_state is frozen
        torch.testing.assert_close(frozen, expected_state, rtol=1e-12, atol=1e-12)


def test_prefill_state_then_step_equals_longer_prefill():
    """Decode consistency: state after N tokens + one step == the last row of the prefill over N + 1 tokens."""
    q, k, v, k_enc, v_enc = make_inputs(2, 26, 2, 4, 8, 10)
    full, _ = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc)
    _, state = prefix_linear_attention_chunked(q[:, :-1], k[:, :-1], v[:, :-1], k_enc, v_enc, chunk_size=8)
    out, _ = linear_attention_step(q[:, -1], k[:, -1], v[:, -1], state)
    torch.testing.assert_close(out, full[:, -1])


@pytest.mark.parametrize("with_decay", [False, True], ids=["prefix", "based-decay-gate"])
def test_chunked_autograd_keeps_about_the_output_for_backward(with_decay):
    """What autograd keeps from a chunked forward until its backward, beyond the inputs, is the op's output and a
    few numbers per token (the explicit backward rebuilds the features): at most 1.25x the output's bytes, whatever
    the number of chunks (autograd through the batched scan it replaced kept every block's features, weights and
    chunk states, and fails this)."""
    batch, seq_len, heads, value_dim = 2, 512, 4, 16
    q, k, v, k_enc, v_enc = make_inputs(batch, seq_len, heads, 4, value_dim, 0 if with_decay else 200,
                                        dtype=torch.float32)
    kwargs = {}
    if with_decay:
        kwargs = dict(log_decay=torch.log(torch.tensor([0.9, 0.95, 0.99, 0.999])),
                      gate=torch.rand(batch, seq_len, heads, requires_grad=True))
    leaves = [None if t is None else t.requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
    saved, (output, state) = saved_for_backward_bytes(
        lambda: prefix_linear_attention_chunked(*leaves, chunk_size=16, **kwargs), exclude=leaves + [kwargs.get("gate")]
    )
    assert 0 < saved <= 1.25 * output.numel() * output.element_size(), saved
    (output.sum() + state.sum()).backward()
    assert all(t.grad is not None for t in leaves if t is not None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunked_low_precision_gradients(dtype):
    """bf16 / fp16 inputs: the explicit backward computes in fp32 and returns each gradient in its input's dtype,
    within the inputs' rounding of the fp64 oracle's (prefix with an encoder, and Based decay with a gate)."""
    for case in (dict(), dict(encoder=False, decay=True, gate=True)):
        q, k, v, k_enc, v_enc, kwargs = block_case_inputs(case)
        names = [name for name in ("gate",) if name in kwargs]
        gradients = []
        for precision in (dtype, torch.float64):
            leaves = [None if t is None else t.to(precision).requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
            options = {**kwargs, **{name: kwargs[name].to(precision).requires_grad_(True) for name in names}}
            function = prefix_linear_attention_chunked if precision == dtype else prefix_linear_attention_quadratic
            output, _ = function(*leaves, **options)
            assert output.dtype == precision
            wanted = [t for t in leaves if t is not None] + [options[name] for name in names]
            gradients.append(torch.autograd.grad(output.float().square().sum(), wanted))
        for actual, expected in zip(*gradients):
            assert actual.dtype == dtype
            error = (actual.double() - expected).abs().max() / expected.abs().max()
            assert error < (2.5e-2 if dtype == torch.bfloat16 else 3e-3), error  # about 2.5x the worst seen


def test_chunked_is_differentiable_like_the_oracle():
    q, k, v, k_enc, v_enc = make_inputs(1, 13, 2, 4, 4, 5)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
    reference = [t.clone().requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
    out, state = prefix_linear_attention_chunked(*inputs, chunk_size=4)
    (out.sin().sum() + state.sum() * 1e-3).backward()
    out_ref, state_ref = prefix_linear_attention_quadratic(*reference)
    (out_ref.sin().sum() + state_ref.sum() * 1e-3).backward()
    for actual, expected in zip(inputs, reference):
        torch.testing.assert_close(actual.grad, expected.grad)


def test_bad_arguments_raise_clear_errors():
    q, k, v, k_enc, v_enc = make_inputs(1, 6, 2, 4, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="M .* must be <= T"):
        prefix_linear_attention_chunked(q, k, v, torch.randn(1, 7, 2, 4), torch.randn(1, 7, 2, 4))
    with pytest.raises(ValueError, match="k_enc and v_enc must be given together"):
        prefix_linear_attention_chunked(q, k, v, k_enc, None)
    with pytest.raises(ValueError, match="`pad_masking` must be one of"):
        prefix_linear_attention_chunked(q, k, v, pad_masking="leaky")
    with pytest.raises(ValueError, match="key_mask must be"):
        prefix_linear_attention_chunked(q, k, v, key_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot be combined with an encoder"):
        prefix_linear_attention_chunked(q, k, v, k_enc, v_enc, log_decay=torch.zeros(2))
    with pytest.raises(ValueError, match="`implementation` must be one of"):
        prefix_linear_attention(q, k, v, implementation="cuda")


# ------------------------------------------------------------------------------------------ per-row encoder ranges

# Rows of one batch with different encoder ranges over M = T = 12 positions: empty (0), one token, the whole row
# (= T), and left-padded rows whose range starts after their padding.
ROW_RANGES = pytest.param([0, 0, 0, 3, 5], [0, 1, 12, 9, 6], [0, 0, 0, 3, 5], id="0-1-T-leftpad")


def ranged_inputs(pads, dtype=torch.float64):
    """Inputs for len(pads) rows of T = M = 12 tokens; row b has `pads[b]` left pads, masked in `key_mask`."""
    q, k, v, k_enc, v_enc = make_inputs(len(pads), 12, 2, 4, 5, 12, dtype=dtype)
    key_mask = torch.ones(len(pads), 12, dtype=torch.bool)
    for row, count in enumerate(pads):
        key_mask[row, :count] = False
    return q, k, v, k_enc, v_enc, key_mask


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
@pytest.mark.parametrize("starts,ends,pads", [ROW_RANGES])
def test_every_implementation_takes_per_row_ranges(starts, ends, pads, pad_masking):
    """Oracle vs scalar loop, chunked (fp32) vs oracle, and decode steps after a ranged prefill vs the oracle."""
    q, k, v, k_enc, v_enc, key_mask = ranged_inputs(pads)
    ranges = dict(encoder_start=torch.tensor(starts), encoder_end=torch.tensor(ends))
    kwargs = dict(key_mask=key_mask, pad_masking=pad_masking, **ranges)
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **kwargs)
    loop = scalar_kernel_reference(q, k, v, k_enc, v_enc, key_mask, pad_masking, starts=starts, ends=ends)
    real = key_mask
    torch.testing.assert_close(expected[real], loop[real])

    as32 = [t.float() for t in (q, k, v, k_enc, v_enc)]
    chunked, chunked_state = prefix_linear_attention_chunked(*as32, chunk_size=5, **kwargs)
    torch.testing.assert_close(chunked[real], expected.float()[real], **FP32_TOL)
    scale = expected_state.abs().max().item()
    torch.testing.assert_close(chunked_state, expected_state.float(), rtol=1e-5, atol=1e-5 * scale)

    # Decode: prefill the first 10 tokens (ranges cut at 10), then steps for tokens 10 and 11 == the oracle.
    cut = dict(kwargs, encoder_end=torch.tensor(ends).clamp(max=10))
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **cut)
    _, state = prefix_linear_attention_chunked(
        q[:, :10], k[:, :10], v[:, :10], k_enc[:, :10], v_enc[:, :10], chunk_size=4,
        **dict(cut, key_mask=key_mask[:, :10]),
    )
    for t in (10, 11):
        out, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state)
        torch.testing.assert_close(out, expected[:, t])
    torch.testing.assert_close(state, expected_state)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_ranged_row_equals_the_row_alone(pad_masking):
    """A left-padded row with range [pads, pads + P) == the unpadded row with its first P tokens as encoder."""
    pads, prefix = [0, 4, 2], [7, 3, 0]
    q, k, v, k_enc, v_enc, key_mask = ranged_inputs(pads)
    starts = torch.tensor(pads)
    batched, batched_state = prefix_linear_attention_chunked(
        q, k, v, k_enc, v_enc, encoder_start=starts, encoder_end=starts + torch.tensor(prefix), key_mask=key_mask,
        pad_masking=pad_masking, chunk_size=4,
    )
    for row, (count, length) in enumerate(zip(pads, prefix)):
        alone = [t[row : row + 1, count:] for t in (q, k, v)]
        encoder = [t[row : row + 1, count : count + length] for t in (k_enc, v_enc)]
        expected, expected_state = prefix_linear_attention_quadratic(*alone, *encoder)
        torch.testing.assert_close(batched[row, count:], expected[0])
        torch.testing.assert_close(batched_state[row], expected_state[0])


def test_reference_masking_applies_inside_the_encoder_range_only():
    """Under "reference" a masked key inside the range keeps weight 1; outside it (batch padding) it is removed."""
    q, k, v, k_enc, v_enc, key_mask = ranged_inputs([3])
    strict = dict(key_mask=key_mask, pad_masking="strict")
    reference = dict(key_mask=key_mask, pad_masking="reference")
    outside = dict(encoder_start=3, encoder_end=8)  # the pads 0..2 lie before the range
    inside = dict(encoder_start=0, encoder_end=8)
    torch.testing.assert_close(
        prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **reference, **outside)[0],
        prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **strict, **outside)[0],
    )
    leak = (
        prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **reference, **inside)[0]
        - prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, **strict, **inside)[0]
    )
    assert leak[:, 3:].abs().max() > 1e-3


def test_bad_encoder_ranges_raise_clear_errors():
    q, k, v, k_enc, v_enc = make_inputs(2, 6, 2, 4, 4, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"0 <= encoder_start <= encoder_end <= M = 3"):
        prefix_linear_attention_chunked(q, k, v, k_enc, v_enc, encoder_end=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"0 <= encoder_start <= encoder_end"):
        prefix_linear_attention(q, k, v, k_enc, v_enc, encoder_start=torch.tensor([2, 0]), encoder_end=1)
    with pytest.raises(ValueError, match=r"encoder_end must be a \(B,\) = \(2,\) integer tensor"):
        prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, encoder_end=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="pass k_enc and v_enc"):
        prefix_linear_attention_chunked(q, k, v, encoder_end=2)
    with pytest.raises(ValueError, match=r"decode step must be \(B, H, K\)"):
        linear_attention_step(q, k, v, torch.zeros(2, 2, 21, 5))
    with pytest.raises(ValueError, match="initial_state must be"):
        linear_attention_step(q[:, 0], k[:, 0], v[:, 0], torch.zeros(2, 2, 21, 4))


@pytest.mark.parametrize("with_decay", [False, True], ids=["prefix", "based-decay+gate"])
def test_serving_decode_step_traces_one_graph(with_decay):
    """The decode step of the vLLM plugin (`linear_attention_step_at_slots`: the O(1) step on the states where they
    lie in the pool) is one graph under torch.compile(fullgraph=True): no graph break and no host read of the slots,
    which is what capturing it in a CUDA graph needs; it updates the pool as the eager step does."""
    import torch._dynamo

    from modeling_jrt.linear_attention import linear_attention_step_at_slots, num_taylor_features

    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    batch, heads, K, V = 3, 2, 4, 8
    q, k = torch.randn(2, batch, heads, K, generator=generator)
    v = torch.randn(batch, heads, V, generator=generator)
    pool = torch.rand(6, heads, num_taylor_features(K), V + 1, generator=generator)
    slots = torch.tensor([4, 1, 3])
    kwargs = {}
    if with_decay:
        gate = torch.randn(batch, heads, generator=generator)
        kwargs = dict(log_decay=torch.log(torch.tensor([0.9, 0.99])), gate=gate)
    compiled = torch.compile(linear_attention_step_at_slots, fullgraph=True, backend="aot_eager")
    eager_pool, compiled_pool = pool.clone(), pool.clone()
    expected = linear_attention_step_at_slots(q, k, v, eager_pool, slots, implementation="chunked", **kwargs)
    actual = compiled(q, k, v, compiled_pool, slots, implementation="chunked", **kwargs)
    torch.testing.assert_close(actual, expected, **FP32_TOL)
    torch.testing.assert_close(compiled_pool, eager_pool, **FP32_TOL)
    assert not torch.equal(compiled_pool, pool) and torch.equal(compiled_pool[[0, 2, 5]], pool[[0, 2, 5]])


def pool_with_pages(slots_in_pool, heads, features, width, page, offset, generator):
    """`(N, H, F, width)` states laid out as a serving engine lays out its pool: each slot's state at the start of a
    page of `page` elements (>= H F width), the first `offset` elements of the buffer before them."""
    buffer = torch.rand(offset + slots_in_pool * page, generator=generator, dtype=torch.float64).float()
    pool = buffer.as_strided((slots_in_pool, heads, features, width), (page, features * width, width, 1), offset)
    pool[..., : width - 1] -= 0.5
    return pool


@pytest.mark.parametrize("with_decay", [False, True], ids=["prefix", "based-decay+gate"])
@pytest.mark.parametrize(
    "page_extra, offset", [(0, 0), (2 * 9, 9), (5, 3)], ids=["contiguous", "padded-whole-rows", "padded-odd"]
)
def test_serving_decode_step_updates_the_states_where_they_live(with_decay, page_extra, offset):
    """The PyTorch step at slots (index_add_ of the update, one weighted embedding_bag for the read; a gather for the
    read when the pool's pages are not whole rows) leaves every state exactly as the step on a gathered copy
    written back does, reads the same outputs, and touches no other slot or the memory between pages."""
    from modeling_jrt.linear_attention import linear_attention_step, linear_attention_step_at_slots

    generator = torch.Generator().manual_seed(0)
    batch, heads, K, V = 3, 2, 4, 8
    features = num_taylor_features(K)
    q, k = torch.randn(2, batch, heads, K, generator=generator)
    v = torch.randn(batch, heads, V, generator=generator)
    page = heads * features * (V + 1) + page_extra
    pool = pool_with_pages(6, heads, features, V + 1, page, offset, generator)
    slots = torch.tensor([4, 0, 3])
    kwargs = {}
    if with_decay:
        kwargs = dict(log_decay=torch.log(torch.tensor([0.9, 0.99])), gate=torch.rand(batch, heads, generator=generator))
    expected_output, state = linear_attention_step(q, k, v, pool.index_select(0, slots), **kwargs)
    expected_pool = pool.clone()
    expected_pool.index_copy_(0, slots, state)
    buffer_before = pool.as_strided((offset + 6 * page,), (1,), 0).clone()
    output = linear_attention_step_at_slots(q, k, v, pool, slots, implementation="chunked", **kwargs)
    torch.testing.assert_close(output, expected_output, **FP32_TOL)
    assert torch.equal(pool, expected_pool)  # the same products and sums: bit for bit
    buffer = pool.as_strided((offset + 6 * page,), (1,), 0)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    for slot in slots.tolist():
        outside[offset + slot * page : offset + slot * page + heads * features * (V + 1)] = False
    assert torch.equal(buffer[outside], buffer_before[outside])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "pool": a["pool"][:, :1]}, "pool must be an fp32 (N, H, F, V + 1) = (N, 2, 21, 9)"),
        (lambda a: {**a, "pool": a["pool"].half()}, "torch.float16"),
        (lambda a: {**a, "slots": a["slots"][:2]}, "slots must be (3,) int32 / int64; got (2,)"),
        (lambda a: {**a, "slots": a["slots"].float()}, "torch.float32"),
        (lambda a: {**a, "v": a["v"][:, :1]}, "q, k must be (B, H, K) and v (B, H, V) with the same B and H"),
        (lambda a: {**a, "log_decay": torch.zeros(3)}, "log_decay must be (H,) = (2,)"),
    ],
    ids=["pool-shape", "pool-dtype", "slots-shape", "slots-dtype", "v-heads", "decay-shape"],
)
def test_serving_decode_step_names_bad_arguments(change, message):
    from modeling_jrt.linear_attention import linear_attention_step_at_slots

    arguments = dict(
        q=torch.randn(3, 2, 4), k=torch.randn(3, 2, 4), v=torch.randn(3, 2, 8),
        pool=torch.rand(5, 2, num_taylor_features(4), 9), slots=torch.tensor([0, 2, 4]),
    )
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        linear_attention_step_at_slots(**change(arguments), implementation="chunked")
