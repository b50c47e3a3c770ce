"""The fused Triton backward against autograd through the fp64 oracle (interpreted on CPU, compiled on CUDA).

Inputs follow docs/prefill.md §5 (q, k ~ randn so the 2nd-order term matters, v ~ N(0.5, 1)); the loss is
<y, dy> + <S_T, dS>, so the final state's gradient path is exercised too. Shapes are tiny (interpreter).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel needs triton (Linux: pip install -e '.[dev]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from jrt_kernels import prefix_linear_attention as kernel_module  # noqa: E402
from conftest import enable_activation_checkpointing  # noqa: E402
from jrt_kernels._common import _dot_tf32, dot_types  # noqa: E402
from jrt_kernels import prefix_linear_attention_backward as backward_module  # noqa: E402
from jrt_kernels.prefix_linear_attention_backward import prefix_linear_attention_backward  # noqa: E402
from modeling_jrt import kernel_choice  # noqa: E402
from modeling_jrt.kernel_choice import KernelChoice  # noqa: E402
from modeling_jrt.linear_attention import num_taylor_features, prefix_linear_attention_quadratic  # noqa: E402

# Tolerance relative to each gradient's largest magnitude: fp32 inputs (3xTF32 products, fp32 accumulation); bf16
# operands with fp32 accumulation. fp32: dq of the Based decay case (initial state, left padding) is at 1.2e-6 in
# the interpreter's exact fp32 and at 2.0e-6 with 3xTF32 emulated there (sm_90 configs); compiled on an H200 it went
# past 2e-6 (2026-12-04; what the interpreter does not model there: the GPU's approximate exp in the decay weights and
# its order of the sums). 1e-5 keeps a margin for that and is still far below what a wrong term gives.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
NAMES = ("q", "k", "v", "k_enc", "v_enc", "initial_state", "gate")


@pytest.fixture(scope="module")
def device() -> torch.device:
    if kernel_module.INTERPRETED:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail("Without CUDA the kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it).")
    return torch.device("cuda")


def make_case(B, T, H, K, V, M, *, dtype, device, seed=0, initial_state=False, grad_state=True):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, mean=0.0):
        return (torch.randn(*shape, generator=generator) + mean).to(device=device, dtype=dtype)

    inputs = dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, H, V, mean=0.5))
    inputs["k_enc"], inputs["v_enc"] = (randn(B, M, H, K), randn(B, M, H, V, mean=0.5)) if M else (None, None)
    F = num_taylor_features(K)
    inputs["initial_state"] = (
        (torch.randn(B, H, F, V + 1, generator=generator).abs() * 2).to(device) if initial_state else None
    )
    inputs["gate"] = None
    grad_output = randn(B, T, H, V)
    grad_state = torch.randn(B, H, F, V + 1, generator=generator).to(device) if grad_state else None
    return inputs, grad_output, grad_state


def oracle_grads(inputs, grad_output, grad_state, **kwargs):
    """Autograd through the quadratic reference in fp64."""
    leaves = {name: None if t is None else t.detach().double().requires_grad_() for name, t in inputs.items()}
    output, state = prefix_linear_attention_quadratic(
        leaves["q"], leaves["k"], leaves["v"], leaves["k_enc"], leaves["v_enc"],
        initial_state=leaves["initial_state"], gate=leaves["gate"], **kwargs,
    )
    loss = (output * grad_output.double()).sum()
    if grad_state is not None:
        loss = loss + (state * grad_state.double()).sum()
    loss.backward()
    return [None if leaves[name] is None else leaves[name].grad for name in NAMES]


def assert_grads_match(inputs, grad_output, grad_state, *, key_mask=None, pad_masking="strict", log_decay=None,
                       saved_output=True):
    """The fused gradients against the oracle's; `saved_output` passes the forward kernel's output and what it saves
    for the backward (what the op's autograd does: the dq scan reads dy . y from the output, starts from the state
    after the encoder and reads 1 / (den + eps)), False leaves all of it to the recomputation."""
    output, saved = None, {}
    if saved_output:
        output, _, saved = kernel_module.prefix_linear_attention_triton(
            inputs["q"], inputs["k"], inputs["v"], inputs["k_enc"], inputs["v_enc"], key_mask=key_mask,
            pad_masking=pad_masking, initial_state=inputs["initial_state"], log_decay=log_decay, gate=inputs["gate"],
            return_saved=True,
        )
        expected_names = {"inverse_denominator"} | ({"encoder_state"} if inputs["k_enc"] is not None else set())
        assert set(saved) == expected_names
    grads = prefix_linear_attention_backward(
        inputs["q"], inputs["k"], inputs["v"], inputs["k_enc"], inputs["v_enc"], grad_output, grad_state,
        key_mask=key_mask, strict=pad_masking == "strict", initial_state=inputs["initial_state"],
        log_decay=log_decay, gate=inputs["gate"], output=output, **saved,
    )
    expected = oracle_grads(inputs, grad_output, grad_state, key_mask=key_mask, pad_masking=pad_masking,
                            log_decay=None if log_decay is None else log_decay.double())
    tol = TOLERANCES[inputs["q"].dtype]
    for name, actual, reference in zip(NAMES, grads, expected):
        assert (actual is None) == (reference is None), name
        if actual is None:
            continue
        source = inputs[name]
        assert actual.shape == source.shape and actual.dtype == source.dtype, name
        assert torch.isfinite(actual).all(), name
        scale = reference.abs().max().item()
        torch.testing.assert_close(actual.cpu().double(), reference.cpu(), rtol=0, atol=tol * scale, msg=name)


@pytest.mark.parametrize(
    "B, T, H, K, V, M",
    [
        pytest.param(1, 45, 2, 4, 6, 0, id="causal-B1-T45-K4-V6"),
        pytest.param(2, 33, 1, 16, 20, 17, id="prefix-B2-T33-K16-V20"),
    ],
)
@pytest.mark.parametrize("grad_state", [True, False], ids=["dS", "no-dS"])
def test_backward_matches_oracle_fp32(device, B, T, H, K, V, M, grad_state):
    inputs, grad_output, dstate = make_case(B, T, H, K, V, M, dtype=torch.float32, device=device,
                                            grad_state=grad_state)
    assert_grads_match(inputs, grad_output, dstate)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_backward_left_padding_and_initial_state(device, pad_masking):
    """Left-padded rows (pads inside the encoder prefix) and an initial state: every gradient, both maskings."""
    inputs, grad_output, dstate = make_case(2, 40, 2, 4, 6, 12, dtype=torch.float32, device=device, seed=1,
                                            initial_state=True)
    key_mask = torch.ones(2, 40, dtype=torch.bool, device=device)
    key_mask[1, :5] = False
    assert_grads_match(inputs, grad_output, dstate, key_mask=key_mask, pad_masking=pad_masking)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_backward_range_and_holed_masks(device, pad_masking):
    """One batch with a padding row (the range launch of each scan) and a row with holes (the loaded-mask launch)."""
    inputs, grad_output, dstate = make_case(2, 40, 2, 4, 6, 12, dtype=torch.float32, device=device, seed=12,
                                            initial_state=True)
    key_mask = torch.ones(2, 40, dtype=torch.bool, device=device)
    key_mask[0, :5] = False
    key_mask[1, 3:6] = False
    key_mask[1, 20:23] = False
    rows = backward_module._key_rows(key_mask)[:, 0].tolist()
    assert rows == [1, 0]
    assert_grads_match(inputs, grad_output, dstate, key_mask=key_mask, pad_masking=pad_masking)


@pytest.mark.parametrize("saved_output", [True, False], ids=["saved-y", "recomputed-y"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_low_precision_operands(device, dtype, saved_output):
    """bf16 / fp16 inputs: the operands are rounded as on tensor cores (emulated in the interpreter). With the saved
    output, dy . y reads y rounded to the input dtype; without it the numerator is read from the state again."""
    inputs, grad_output, dstate = make_case(1, 40, 2, 4, 6, 12, dtype=dtype, device=device, seed=2)
    assert_grads_match(inputs, grad_output, dstate, saved_output=saved_output)


def test_backward_without_the_saved_output(device):
    """Callers that saved only the inputs (output=None): the dq scan recomputes the forward's read of y."""
    inputs, grad_output, dstate = make_case(2, 40, 2, 4, 6, 12, dtype=torch.float32, device=device, seed=13,
                                            initial_state=True)
    key_mask = torch.ones(2, 40, dtype=torch.bool, device=device)
    key_mask[1, :5] = False
    assert_grads_match(inputs, grad_output, dstate, key_mask=key_mask, saved_output=False)


@pytest.mark.parametrize(
    "dtype, V", [(torch.float32, 6), (torch.bfloat16, 6), (torch.float32, 40)], ids=["fp32", "bf16", "fp32-V40"]
)
def test_backward_from_what_the_forward_saved(device, dtype, V):
    """The dq scan started from the forward's state after the encoder and reading its 1 / (den + eps) (per-row
    encoder ranges, a padding mask, an initial state; V = 40 splits the forward's value dim over programs, each
    storing its rows) gives the gradients of the scan that recomputes both, and it does read each of them: a
    perturbed one changes the gradients."""
    B, T, H, K, M = 3, 40, 2, 4, 12
    inputs, grad_output, dstate = make_case(B, T, H, K, V, M, dtype=dtype, device=device, seed=14,
                                            initial_state=True)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[1, :5] = False
    ranges = dict(encoder_start=torch.tensor([0, 2, 5], device=device),
                  encoder_end=torch.tensor([12, 9, 12], device=device))
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["k_enc"], inputs["v_enc"])
    output, _, saved = kernel_module.prefix_linear_attention_triton(
        *args, key_mask=key_mask, initial_state=inputs["initial_state"], return_saved=True, **ranges,
    )
    assert saved["encoder_state"].shape == (B, H, kernel_module.encoder_state_numel(K, V))
    assert saved["inverse_denominator"].shape == (B, T, H)

    def grads(**given):
        return prefix_linear_attention_backward(
            *args, grad_output, dstate, key_mask=key_mask, initial_state=inputs["initial_state"], output=output,
            **ranges, **given,
        )

    recomputed, read = grads(), grads(**saved)
    tol = TOLERANCES[dtype]  # two fp32 orders of the same sums
    for name, a, b in zip(NAMES, read, recomputed):
        if a is not None:
            scale = b.abs().max().item()
            torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=tol * scale, msg=name)
    block_k, block_p = kernel_module.feature_blocks(K)
    changed_state = saved["encoder_state"].clone()
    changed_state[..., : V * (1 + 2 * block_k + block_p)] *= 1.5  # the numerator rows only (a scaled whole state
    # leaves y and dq almost unchanged)
    changes = (("encoder_state", changed_state), ("inverse_denominator", saved["inverse_denominator"] * 1.5))
    for name, changed in changes:
        perturbed = grads(**{**saved, name: changed})[0].double()
        assert (perturbed - read[0].double()).abs().max() > 10 * tol * read[0].abs().max(), name


def test_backward_strided_inputs(device):
    """Heads split from a fused projection (non-contiguous views): gradients keep each input's shape."""
    B, T, H, K, V = 1, 20, 2, 4, 6
    generator = torch.Generator().manual_seed(3)
    fused = torch.randn(B, T, H, 2 * K + V, generator=generator).to(device)
    q, k, v = fused[..., :K], fused[..., K : 2 * K], fused[..., 2 * K :] + 0.5
    inputs = dict(q=q, k=k, v=v, k_enc=None, v_enc=None, initial_state=None, gate=None)
    grad_output = torch.randn(B, T, H, V, generator=generator).to(device)
    assert_grads_match(inputs, grad_output, None)


@pytest.mark.parametrize("use_gate", [False, True], ids=["decay", "decay+gate"])
def test_backward_based_decay_and_gate(device, use_gate):
    """The Based variant: fixed per-head decay (strong for head 0), optional gate, initial state, left padding."""
    B, T, H, K, V = 2, 45, 2, 4, 6
    inputs, grad_output, dstate = make_case(B, T, H, K, V, 0, dtype=torch.float32, device=device, seed=4,
                                            initial_state=True)
    if use_gate:
        inputs["gate"] = torch.randn(B, T, H, generator=torch.Generator().manual_seed(5)).to(device)
    log_decay = torch.log1p(-torch.tensor([2.0**-3, 2.0**-6])).to(device)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[0, :7] = False
    assert_grads_match(inputs, grad_output, dstate, key_mask=key_mask, log_decay=log_decay)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_based_decay_and_gate_low_precision(device, dtype):
    """The Based variant with bf16 / fp16 operands: the recomputing dq scan reads dy . num through the state's
    products with dy (shared with dq's terms), so the gate's gradient and dq see those roundings."""
    B, T, H, K, V = 1, 40, 2, 4, 16
    inputs, grad_output, dstate = make_case(B, T, H, K, V, 0, dtype=dtype, device=device, seed=2, initial_state=True)
    inputs["gate"] = torch.randn(B, T, H, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=dtype)
    log_decay = torch.log1p(-torch.tensor([2.0**-3, 2.0**-6])).to(device)
    assert_grads_match(inputs, grad_output, dstate, log_decay=log_decay)


@triton.jit
def _dot_tf32_probe(a_ptr, b_ptr, out_ptr, DOT: tl.constexpr, EMULATE: tl.constexpr):
    o = tl.arange(0, 16)
    a = tl.load(a_ptr + o[:, None] * 16 + o[None, :])
    b = tl.load(b_ptr + o[:, None] * 16 + o[None, :])
    tl.store(out_ptr + o[:, None] * 16 + o[None, :], _dot_tf32(a, b, DOT, EMULATE))


def test_denominator_products_in_tf32_for_half_inputs(device):
    """`_dot_tf32`, the dk/dv scan's denominator products: for bf16 inputs one TF32 product, whose operands the
    interpreter truncates to 10 mantissa bits as a tensor core reads them; for fp32 inputs 3xTF32 (about fp32)."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    exact = a @ b
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(16, 16, device=device)
        types_ = dot_types(dtype, kernel_module.INTERPRETED)
        _dot_tf32_probe[(1,)](a.float().to(device), b.float().to(device), out, DOT=types_["DOT"],
                              EMULATE=types_["EMULATE"])
        results[dtype] = out.cpu().double()
    scale = exact.abs().max().item()
    assert (results[torch.float32] - exact).abs().max().item() < 1e-5 * scale
    error = (results[torch.bfloat16] - exact).abs().max().item()
    assert 1e-5 * scale < error < 4e-3 * scale  # 10-bit operands: well above fp32, well below bf16's 8 bits
    if kernel_module.INTERPRETED:  # the truncation itself: operands with their 13 low mantissa bits cleared

        def tf32(x):
            return (x.float().view(torch.int32) & -8192).view(torch.float32).double()

        torch.testing.assert_close(results[torch.bfloat16], tf32(a) @ tf32(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["prefix", "masks+state", "decay+gate", "bf16"])
@pytest.mark.parametrize("major", [9, 8], ids=["sm90-form", "sm80-form"])
def test_backward_in_each_architectures_form(device, monkeypatch, major, case):
    """Both scans' per-architecture constexprs give the oracle's gradients in either form: the dk/dv scan's
    (`dkv_constexprs`: on sm_90 the selection matrices held in registers and the state update's operands loaded
    again at the update; elsewhere the matrices from a table) and the dq scan's (`dq_constexprs`: off sm_90 the
    16-row state updates as isolated transposed products). The interpreter launches one form; this runs both."""
    for name in ("dkv_constexprs", "dq_constexprs"):
        forms = getattr(backward_module, name)
        assert forms(9) != forms(8)
        monkeypatch.setattr(backward_module, name, lambda _major, forms=forms: forms(major))
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    inputs, grad_output, dstate = make_case(2, 45, 2, 4, 6, 0 if case == "decay+gate" else 12, dtype=dtype,
                                            device=device, seed=21, initial_state=case != "prefix")
    key_mask, log_decay = None, None
    if case != "prefix":
        key_mask = torch.ones(2, 45, dtype=torch.bool, device=device)
        key_mask[0, :5] = False  # a padding row (the range launch)
    if case == "masks+state":
        key_mask[1, 20:23] = False  # a row with a hole (the loaded-mask launch)
    if case == "decay+gate":
        inputs["gate"] = torch.randn(2, 45, 2, generator=torch.Generator().manual_seed(22)).to(device)
        log_decay = torch.log1p(-torch.tensor([2.0**-3, 2.0**-6])).to(device)
    assert_grads_match(inputs, grad_output, dstate, key_mask=key_mask, log_decay=log_decay)


# Through the dispatcher: the kernel's autograd registration (torch.library.register_autograd) in a training step.

from modeling_jrt.linear_attention import prefix_linear_attention  # noqa: E402


def _autograd_grads(implementation, inputs, grad_output, grad_state, dtype, **kwargs):
    leaves = {name: None if t is None else t.detach().to(dtype).requires_grad_() for name, t in inputs.items()}
    output, state = prefix_linear_attention(
        leaves["q"], leaves["k"], leaves["v"], leaves["k_enc"], leaves["v_enc"],
        initial_state=leaves["initial_state"], gate=leaves["gate"], implementation=implementation, **kwargs,
    )
    loss = (output * grad_output.to(dtype)).sum() + (state * grad_state.to(dtype)).sum()
    loss.backward()
    return output, state, [None if leaves[name] is None else leaves[name].grad for name in NAMES]


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_training_through_the_dispatcher_per_row_prefixes(device, pad_masking):
    """implementation="triton" with gradients: per-row encoder ranges, left padding and an initial state, against
    autograd through the fp64 oracle."""
    B, T, H, K, V, M = 3, 37, 2, 4, 6, 16
    inputs, grad_output, grad_state = make_case(B, T, H, K, V, M, dtype=torch.float32, device=device, seed=6,
                                                initial_state=True)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[0, :4] = False  # left padding inside the prefix
    key_mask[2, :9] = False
    kwargs = dict(
        key_mask=key_mask, pad_masking=pad_masking,
        encoder_start=torch.tensor([4, 0, 2], device=device), encoder_end=torch.tensor([16, 5, 16], device=device),
    )
    output, state, grads = _autograd_grads("triton", inputs, grad_output, grad_state, torch.float32, **kwargs)
    ref_output, ref_state, ref_grads = _autograd_grads("quadratic", inputs, grad_output, grad_state, torch.float64,
                                                       **kwargs)
    torch.testing.assert_close(output.double(), ref_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5 * ref_state.abs().max().item())
    for name, actual, reference in zip(NAMES, grads, ref_grads):
        assert (actual is None) == (reference is None), name
        if actual is not None:
            scale = reference.abs().max().item()
            torch.testing.assert_close(actual.double(), reference, rtol=0, atol=2e-6 * scale, msg=name)


def test_based_decay_and_gate_run_fused(device):
    """The Based variant (decay + gate) through implementation="triton": output, state and gradients."""
    B, T, H, K, V = 2, 41, 2, 4, 6
    inputs, grad_output, grad_state = make_case(B, T, H, K, V, 0, dtype=torch.float32, device=device, seed=7)
    inputs["gate"] = torch.randn(B, T, H, generator=torch.Generator().manual_seed(8)).to(device)
    log_decay = torch.log1p(-torch.tensor([2.0**-2, 2.0**-5])).to(device)
    output, state, grads = _autograd_grads("triton", inputs, grad_output, grad_state, torch.float32,
                                           log_decay=log_decay)
    ref_output, ref_state, ref_grads = _autograd_grads("quadratic", inputs, grad_output, grad_state, torch.float64,
                                                       log_decay=log_decay.double())
    torch.testing.assert_close(output.double(), ref_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5 * ref_state.abs().max().item())
    for name, actual, reference in zip(NAMES, grads, ref_grads):
        if actual is not None:
            scale = reference.abs().max().item()
            torch.testing.assert_close(actual.double(), reference, rtol=0, atol=2e-6 * scale, msg=name)


# Safe dispatch of the backward: under "auto", a fused backward that fails to compile or launch falls back to the
# chunked path's gradients (modeling_jrt.linear_attention_fused._KernelWithSafeBackward), and the choice that ran it
# records the failure (modeling_jrt.kernel_choice.KernelChoice).


@pytest.fixture
def backward_launches(monkeypatch, auto_takes_kernel):
    """Counts the fused backward's runs (the first launch of its first kernel: a key mask takes two, the range rows
    and the others); "auto" resolves to the kernel on CPU too, until it fails in the choice that runs it.
    `launches.fail = True` makes the launch raise as on a GPU without enough shared memory."""
    from triton.runtime.errors import OutOfResources

    kernel = backward_module._pla_bwd_dq_kernel
    run = kernel.run
    launches = types.SimpleNamespace(count=0, fail=False)

    def counted(*args, **kwargs):
        launches.count += kwargs.get("MASK", 0) != 2
        launches.constexprs = {name: kwargs.get(name) for name in ("ENCODER_STATE", "SAVED_RDEN")}
        if launches.fail:
            raise OutOfResources(262144, 232448, "shared memory")
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    return launches


def _safe_dispatch_case(device, variant="prefix"):
    """Tiny fp32 cases with left padding and an initial state (from an earlier prefill, like a cache's): "prefix"
    has per-row encoder ranges (padding inside the prefix), "based" the decay and the gate."""
    B, T, H, K, V = 2, 21, 1, 4, 6
    M = 8 if variant == "prefix" else 0
    inputs, grad_output, grad_state = make_case(B, T, H, K, V, M, dtype=torch.float32, device=device, seed=9)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[1, :3] = False
    kwargs = dict(key_mask=key_mask)
    if variant == "prefix":
        kwargs.update(encoder_start=torch.tensor([0, 3], device=device),
                      encoder_end=torch.tensor([5, 8], device=device))
    else:
        inputs["gate"] = torch.randn(B, T, H, generator=torch.Generator().manual_seed(10)).to(device)
        kwargs.update(log_decay=torch.log1p(-torch.tensor([2.0**-3])).to(device))
    earlier, *_ = make_case(B, 5, H, K, V, 0, dtype=torch.float32, device=device, seed=11)
    _, inputs["initial_state"] = prefix_linear_attention(
        earlier["q"], earlier["k"], earlier["v"], log_decay=kwargs.get("log_decay"), implementation="chunked"
    )
    return inputs, grad_output, grad_state, kwargs


def _training_step(implementation, inputs, grad_output, grad_state, *, calls=1, **kwargs):
    """`calls` dispatcher calls on the same leaves (like layers), loss <y, dy> (+ <S_T, dS>) of the first; returns
    its output, state and the leaves' gradients. No `grad_state`: the state gets no gradient at all (None)."""
    leaves = {name: None if t is None else t.detach().clone().requires_grad_() for name, t in inputs.items()}
    args = [leaves[name] for name in ("q", "k", "v", "k_enc", "v_enc")]
    results = [
        prefix_linear_attention(*args, initial_state=leaves["initial_state"], gate=leaves["gate"],
                                implementation=implementation, **kwargs)
        for _ in range(calls)
    ]
    (output, state), others = results[0], results[1:]
    loss = (output * grad_output).sum() + sum((other * 0).sum() for other, _ in others)
    if grad_state is not None:
        loss = loss + (state * grad_state).sum()
    loss.backward()
    return output, state, [None if leaves[name] is None else leaves[name].grad for name in NAMES]


def _assert_same_grads(actual, expected):
    for name, got, reference in zip(NAMES, actual, expected):
        assert (got is None) == (reference is None), name
        if got is not None:
            torch.testing.assert_close(got, reference, rtol=0, atol=2e-6 * reference.abs().max().item(), msg=name)


@pytest.mark.parametrize("variant", ["prefix", "based"])
def test_auto_backward_falls_back_when_the_kernel_fails(device, backward_launches, variant):
    """A fused backward that raises under "auto": one warning (the error, the config switch), the chunked path's
    gradients, the backward marked failed; the second call's backward (another layer) and later calls skip it and
    keep the fused forward."""
    from transformers.testing_utils import CaptureLogger

    backward_launches.fail = True
    inputs, grad_output, grad_state, kwargs = _safe_dispatch_case(device, variant)
    expected_output, expected_state, expected = _training_step("chunked", inputs, grad_output, grad_state, **kwargs)
    choice = KernelChoice("auto")  # a model's, shared by its layers
    with CaptureLogger(kernel_choice.logger) as captured:
        output, state, grads = _training_step(choice, inputs, grad_output, grad_state, calls=2, **kwargs)
    assert type(output.grad_fn).__name__ == "_KernelWithSafeBackwardBackward"  # the fused forward ran
    torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-5 * expected_state.abs().max().item())
    _assert_same_grads(grads, expected)
    assert backward_launches.count == 1  # tried once, by the first backward that ran
    assert "OutOfResources" in choice.failures[kernel_choice.BACKWARD]
    assert kernel_choice.LINEAR_ATTENTION not in choice.failures  # the forward kernel works: inference keeps it
    assert "OutOfResources" in captured.out and "linear_attention_implementation='chunked'" in captured.out
    assert captured.out.count("backward kernel failed on this device") == 1

    output, _, later = _training_step(choice, inputs, grad_output, grad_state, **kwargs)
    assert type(output.grad_fn).__name__ == "_KernelWithSafeBackwardBackward"  # the fused forward still runs
    assert backward_launches.count == 1  # and the fused backward is not tried again
    _assert_same_grads(later, expected)


def test_explicit_triton_backward_still_raises(device, backward_launches):
    """An explicit "triton" surfaces the backward's error (and records nothing: there is no fallback to remember)."""
    from triton.runtime.errors import OutOfResources

    backward_launches.fail = True
    choice = KernelChoice("triton")
    inputs, grad_output, grad_state, kwargs = _safe_dispatch_case(device)
    with pytest.raises(OutOfResources):
        _training_step(choice, inputs, grad_output, grad_state, **kwargs)
    assert backward_launches.count == 1 and not choice.failures


@pytest.mark.parametrize("grad_state", [True, False], ids=["dS", "no-dS"])
def test_auto_training_uses_the_fused_backward(device, backward_launches, grad_state):
    """Without a failure, "auto" training runs the fused backward, with the chunked path's gradients."""
    inputs, grad_output, dstate, kwargs = _safe_dispatch_case(device)
    dstate = dstate if grad_state else None
    choice = KernelChoice("auto")
    output, _, grads = _training_step(choice, inputs, grad_output, dstate, **kwargs)
    assert type(output.grad_fn).__name__ == "_KernelWithSafeBackwardBackward"
    assert backward_launches.count == 1 and not choice.failures
    *_, expected = _training_step("chunked", inputs, grad_output, dstate, **kwargs)
    _assert_same_grads(grads, expected)


@pytest.mark.parametrize("implementation", ["auto", "triton"])
def test_training_reads_what_the_forward_saved(device, backward_launches, implementation):
    """Training through the dispatcher ("auto": `_KernelWithSafeBackward`; "triton": the op's own autograd) hands
    the forward's saved state after the encoder and 1 / (den + eps) to the dq scan, which then recomputes neither."""
    inputs, grad_output, dstate, kwargs = _safe_dispatch_case(device)
    _training_step(implementation, inputs, grad_output, dstate, **kwargs)
    assert backward_launches.count == 1
    assert backward_launches.constexprs == {"ENCODER_STATE": True, "SAVED_RDEN": True}


def test_auto_backward_fallback_with_activation_checkpointing(device, backward_launches, make_config):
    """transformers' default (non-reentrant) activation checkpointing recomputes each layer's forward during the
    backward pass and checks that it saves what the original forward saved: the layers recomputed after the failure
    must keep the kernel's path. The gradients equal those of the chunked model, in this step and the next (whose
    backward does not try the fused kernel again)."""
    import copy

    import modeling_jrt

    backward_launches.fail = True
    config = make_config(mixer_types=["linear_attention", "conv", "linear_attention", "sliding_attention"])
    model = modeling_jrt.JRTRNNForCausalLM(config).to(device).train()
    reference = copy.deepcopy(model)
    reference.config.linear_attention_implementation = "chunked"
    enable_activation_checkpointing(model, use_reentrant=False)
    input_ids = torch.randint(4, 99, (2, 13), device=device)
    model(input_ids, labels=input_ids).loss.backward()
    reference(input_ids, labels=input_ids, use_cache=False).loss.backward()
    assert backward_launches.count == 1 and kernel_choice.BACKWARD in model.model.kernels.failures
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-4, atol=1e-6, msg=name)

    model.zero_grad()
    reference.zero_grad()
    model(input_ids, labels=input_ids).loss.backward()  # the next step: chunked gradients, recomputations included
    reference(input_ids, labels=input_ids, use_cache=False).loss.backward()
    assert backward_launches.count == 1
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-4, atol=1e-6, msg=name)
