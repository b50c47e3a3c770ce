"""The fused Triton prefill against the fp64 oracle: compiled on a CUDA machine, in triton's CPU interpreter elsewhere.

tests/conftest.py sets TRITON_INTERPRET=1 when there is no CUDA, before transformers imports triton.
Inputs follow docs/prefill.md §5 (item 5): q, k ~ randn so that s = q.k / sqrt(K) ~ N(0, 1) and the 2nd-order term
matters, v ~ N(0.5, 1) so that a wrong count or a leaked pad shows. Outputs are compared on real (unpadded) rows only.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel needs triton (Linux: pip install -e '.[dev]')")

import jrt_kernels  # noqa: E402
import modeling_jrt  # noqa: E402
from jrt_kernels import prefix_linear_attention as kernel_module  # noqa: E402
from jrt_kernels import prefix_linear_attention_triton  # noqa: E402
from modeling_jrt import kernel_choice  # noqa: E402
from modeling_jrt.kernel_choice import KernelChoice  # noqa: E402
from modeling_jrt.linear_attention import (  # noqa: E402
    linear_attention_step,
    prefix_linear_attention,
    prefix_linear_attention_chunked,
    prefix_linear_attention_quadratic,
)

BT = 32  # the interpreter's chunk length (kernel_module._INTERPRETER_CONFIGS)


@pytest.fixture(scope="module")
def device() -> torch.device:
    """CUDA for the compiled kernel, CPU for the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    interpreted_language = isinstance(tl.zeros, InterpretedFunction)
    if kernel_module.INTERPRETED and interpreted_language:
        return torch.device("cpu")
    if not torch.cuda.is_available() or kernel_module.INTERPRETED:
        pytest.fail(
            "Without CUDA the kernel tests need TRITON_INTERPRET=1 set before triton.language is imported "
            f"(kernel interpreted: {kernel_module.INTERPRETED}, triton.language interpreted: {interpreted_language}); "
            "tests/conftest.py sets it, or export it before running pytest."
        )
    return torch.device("cuda")
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_inputs(B, T, H, V, M, *, K=16, dtype=torch.float32, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, mean=0.0):
        return (torch.randn(*shape, generator=generator) + mean).to(device=device, dtype=dtype)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V, mean=0.5)
    k_enc, v_enc = (randn(B, M, H, K), randn(B, M, H, V, mean=0.5)) if M > 0 else (None, None)
    return q, k, v, k_enc, v_enc


def oracle(q, k, v, k_enc=None, v_enc=None, **kwargs):
    """The quadratic reference in fp64 on the same (possibly rounded) inputs."""
    as64 = [None if t is None else t.double() for t in (q, k, v, k_enc, v_enc)]
    if kwargs.get("initial_state") is not None:
        kwargs["initial_state"] = kwargs["initial_state"].double()
    return prefix_linear_attention_quadratic(*as64, **kwargs)


def triton_prefill(q, k, v, k_enc=None, v_enc=None, **kwargs):
    """The kernel through the dispatcher, which validates the arguments (the kernel module only asserts them)."""
    return prefix_linear_attention(q, k, v, k_enc, v_enc, implementation="triton", **kwargs)


def assert_matches_oracle(q, k, v, k_enc=None, v_enc=None, **kwargs):
    output, state = triton_prefill(q, k, v, k_enc, v_enc, **kwargs)
    expected_output, expected_state = oracle(q, k, v, k_enc, v_enc, **kwargs)
    tol = TOLERANCES[q.dtype]
    assert output.dtype == v.dtype and output.shape == v.shape
    assert state.dtype == torch.float32 and state.shape == expected_state.shape
    assert torch.isfinite(output).all()
    rows = torch.ones(q.shape[:2], dtype=torch.bool) if kwargs.get("key_mask") is None else kwargs["key_mask"]
    rows = rows.cpu()
    torch.testing.assert_close(output.cpu().double()[rows], expected_output.cpu()[rows], rtol=tol, atol=tol)
    state_scale = expected_state.abs().max().item()
    torch.testing.assert_close(state.cpu().double(), expected_state.cpu(), rtol=tol, atol=tol * state_scale)
    return output, state


@pytest.mark.parametrize("T", [1, 17, 64, 100, 257])
@pytest.mark.parametrize("prefix", ["M0", "M1", "Mhalf", "Mall"])
def test_matches_oracle_lengths(device, T, prefix):
    M = {"M0": 0, "M1": 1, "Mhalf": T // 2, "Mall": T}[prefix]
    B, H = (2, 2) if T <= 100 else (1, 2)
    assert_matches_oracle(*make_inputs(B, T, H, 64, M, device=device))


@pytest.mark.parametrize("V", [32, 112], ids=["V32", "V112-not-pow2"])
def test_matches_oracle_value_dims(device, V):
    assert_matches_oracle(*make_inputs(2, 70, 2, V, 35, device=device))


@pytest.mark.parametrize("K", [1, 4, 5, 16], ids=["K1", "K4", "K5", "K16"])
def test_matches_oracle_feature_dims(device, K):
    """K = 1 has no 2nd-order pairs, K = 5 (odd) only full bands of the pair enumeration, K = 4 / 16 a half band."""
    assert_matches_oracle(*make_inputs(1, 40, 2, 16, 9, K=K, device=device))


def test_asymmetric_initial_state_passes_through(device):
    """The kernel keeps the 2nd order symmetric: an arbitrary initial state's antisymmetric part must reach the final
    state unchanged, and the outputs must see only its symmetric part (as phi(q) does)."""
    q, k, v, k_enc, v_enc = make_inputs(2, 40, 2, 16, 9, K=4, device=device, seed=6)
    generator = torch.Generator().manual_seed(7)
    initial_state = (torch.randn(2, 2, 21, 17, generator=generator) * 3).to(device)
    assert_matches_oracle(q, k, v, k_enc, v_enc, initial_state=initial_state)


def test_asymmetric_initial_state_decays(device):
    """With the Based decay every part of the state, the antisymmetric part of an initial state included, is gamma**T
    old at the end."""
    q, k, v, _, _ = make_inputs(2, 40, 2, 16, 0, K=4, device=device, seed=8)
    generator = torch.Generator().manual_seed(9)
    initial_state = (torch.randn(2, 2, 21, 17, generator=generator) * 3).to(device)
    log_decay = torch.log1p(-torch.tensor([2.0**-3, 2.0**-6])).to(device)
    assert_matches_oracle(q, k, v, initial_state=initial_state, log_decay=log_decay)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
@pytest.mark.parametrize("pads", [0, 5, BT + 7], ids=["no-pad", "pad-lt-block", "pad-gt-block"])
def test_left_padding(device, pad_masking, pads):
    B, T, H, V, M = 2, 80, 2, 32, 48
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[0, :pads] = False
    key_mask[1, : pads // 2] = False
    assert_matches_oracle(*make_inputs(B, T, H, V, M, device=device), key_mask=key_mask, pad_masking=pad_masking)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_per_row_encoder_ranges(device, pad_masking):
    """Rows with different encoder ranges: empty, one token, the whole row (= T), left-padded rows whose range starts
    after their padding (inside and across a BT block), the padding masked in `key_mask`."""
    T = 70
    starts = torch.tensor([0, 0, 0, 5, BT + 3], device=device)
    ends = torch.tensor([0, 1, T, 40, BT + 23], device=device)
    key_mask = torch.arange(T, device=device)[None, :] >= starts[:, None]
    key_mask[2, 10:13] = False  # masked keys inside a range: removed or kept as `pad_masking` says
    inputs = make_inputs(5, T, 2, 32, T, device=device)
    assert_matches_oracle(*inputs, encoder_start=starts, encoder_end=ends, key_mask=key_mask, pad_masking=pad_masking)


def _mask_of_every_kind(T, device):
    """Rows: no padding, left padding, right padding, both, no key at all, a hole, two holes (the last two are not
    one range: the kernel's second launch)."""
    key_mask = torch.ones(7, T, dtype=torch.bool, device=device)
    key_mask[1, :BT + 5] = False
    key_mask[2, T - 9 :] = False
    key_mask[3, :3] = False
    key_mask[3, T - 3 :] = False
    key_mask[4] = False
    key_mask[5, 10:13] = False
    key_mask[6, :4] = False
    key_mask[6, BT : BT + 2] = False
    return key_mask


def test_key_rows_tell_ranges_from_other_masks(device):
    T = 50
    rows = kernel_module._key_rows(_mask_of_every_kind(T, device)).cpu()
    expected = [[1, 0, T], [1, BT + 5, T], [1, 0, T - 9], [1, 3, T - 3], [1, T, 0], [0, 0, T], [0, 4, T]]
    assert rows.dtype == torch.int32 and rows.tolist() == expected


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_key_mask_rows_of_every_kind(device, pad_masking):
    """One batch whose rows take the range launch (padding left, right, both, none, every key masked) and the
    general-mask launch (holes), with an encoder and an initial state; every row against the oracle."""
    T, M = 50, 20
    key_mask = _mask_of_every_kind(T, device)
    earlier = make_inputs(7, 30, 2, 16, 0, K=4, device=device, seed=11)[:3]
    initial_state = oracle(*earlier)[1].float()  # a real state (positive denominators), plus an antisymmetric part
    initial_state[:, :, 5:, :16] += 0.1 * torch.randn(7, 2, 16, 16, generator=torch.Generator().manual_seed(12)).to(
        device
    )
    inputs = make_inputs(7, T, 2, 16, M, K=4, device=device, seed=10)
    assert_matches_oracle(*inputs, key_mask=key_mask, pad_masking=pad_masking, initial_state=initial_state)


def test_kernel_module_imports_no_modeling_code():
    """jrt_kernels needs torch and triton only (and its own modules and the standard library); modeling_jrt dispatches
    to it, not back."""
    import ast
    import sys
    from pathlib import Path

    folder = Path(kernel_module.__file__).parent
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
        packages = {name.split(".")[0] for name in imported} - set(sys.stdlib_module_names)
        assert packages <= {"torch", "triton"}, path.name


@pytest.mark.parametrize("M", [0, 20])
def test_fully_padded_row(device, M):
    B, T, H, V = 2, 40, 1, 32
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[1] = False
    inputs = make_inputs(B, T, H, V, M, device=device)
    output, state = assert_matches_oracle(*inputs, key_mask=key_mask)
    assert not output.isnan().any()
    assert (output[1] == 0).all() and (state[1] == 0).all()  # no valid key: 0 / (0 + eps)


def test_strict_padding_equals_unpadded_run(device):
    """Strict masking removes a pad in all three orders: a left-padded row equals the row without its pads."""
    T, pads, M = 50, 11, 30
    q, k, v, k_enc, v_enc = make_inputs(1, T, 2, 32, M, device=device)
    key_mask = torch.ones(1, T, dtype=torch.bool, device=device)
    key_mask[:, :pads] = False
    output, state = triton_prefill(q, k, v, k_enc, v_enc, key_mask=key_mask)
    unpadded, unpadded_state = triton_prefill(
        q[:, pads:], k[:, pads:], v[:, pads:], k_enc[:, pads:], v_enc[:, pads:]
    )
    torch.testing.assert_close(output[:, pads:], unpadded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, unpadded_state, rtol=1e-5, atol=1e-4)
    integer_mask_output, _ = triton_prefill(q, k, v, k_enc, v_enc, key_mask=key_mask.long())
    torch.testing.assert_close(integer_mask_output, output, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs(device, dtype):
    B, T, H, V, M = 2, 70, 2, 112, 40
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[0, :9] = False
    assert_matches_oracle(*make_inputs(B, T, H, V, M, dtype=dtype, device=device), key_mask=key_mask)


@pytest.mark.parametrize("K", [8, 32], ids=["K8", "K32"])
def test_half_precision_feature_dims_with_inexact_scale(device, K):
    """bf16 with K**-1/4 not a power of two: the forward gathers its pair features from the scaled q', k' (each
    factor rounded to bf16, then the product), the backward from the raw inputs scaled in fp32. Measured in the
    interpreter (docs/performance.md, "The dq scan at the forward's standard"): output errors 1.3e-2 (K = 8, 32)
    against 1.1e-2 for K = 16, where the scale is exact; the state's relative error 1.2e-3 / 1.0e-3 against 5.4e-4.
    Both within the bf16 tolerance."""
    assert_matches_oracle(*make_inputs(1, 40, 2, 16, 9, K=K, dtype=torch.bfloat16, device=device))


def test_strided_inputs(device):
    """Heads split from fused projections and a (B, H, T, D) transpose: non-contiguous views, same result."""
    B, T, H, K, V, M = 2, 45, 2, 16, 48, 20
    fused = torch.randn(B, T, H, 2 * K + V, device=device)
    fused[..., 2 * K :] += 0.5
    q, k, v = fused[..., :K], fused[..., K : 2 * K], fused[..., 2 * K :]
    k_enc = torch.randn(B, H, M, K, device=device).transpose(1, 2)  # (B, M, H, K), heads-first in memory
    v_enc = torch.randn(B, H, M, V, device=device).transpose(1, 2)
    key_mask = torch.ones(B, 2 * T, dtype=torch.bool, device=device)[:, ::2]
    key_mask[0, :3] = False
    assert not any(t.is_contiguous() for t in (q, k, v, k_enc, v_enc, key_mask))
    output, state = assert_matches_oracle(q, k, v, k_enc, v_enc, key_mask=key_mask)
    contiguous = [t.contiguous() for t in (q, k, v, k_enc, v_enc)]
    expected_output, expected_state = triton_prefill(*contiguous, key_mask=key_mask.contiguous())
    torch.testing.assert_close(output, expected_output, rtol=0, atol=0)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0)


def test_initial_state_continues_a_prefill(device):
    """Prefill in two pieces, the second from the first's state, equals one prefill."""
    T, split, M = 90, 37, 30
    q, k, v, k_enc, v_enc = make_inputs(2, T, 2, 32, M, device=device)
    output, state = triton_prefill(q, k, v, k_enc, v_enc)
    _, first_state = triton_prefill(q[:, :split], k[:, :split], v[:, :split], k_enc, v_enc)
    second, second_state = assert_matches_oracle(
        q[:, split:], k[:, split:], v[:, split:], initial_state=first_state
    )
    torch.testing.assert_close(second, output[:, split:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second_state, state, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M", [0, 1, 24])
def test_decode_consistency(device, M):
    """The kernel's final state after T tokens plus one recurrent step equals row T of a prefill over T + 1."""
    T = 40
    q, k, v, k_enc, v_enc = make_inputs(2, T + 1, 2, 32, M, device=device)
    full, full_state = triton_prefill(q, k, v, k_enc, v_enc)
    _, state = triton_prefill(q[:, :T], k[:, :T], v[:, :T], k_enc, v_enc)
    step, step_state = linear_attention_step(q[:, T], k[:, T], v[:, T], state)
    torch.testing.assert_close(step, full[:, T], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step_state, full_state, rtol=1e-5, atol=1e-4)


def test_matches_chunked_reference(device):
    """The kernel's reference (the chunked PyTorch path) agrees in fp32."""
    inputs = make_inputs(1, 75, 2, 32, 30, device=device)
    output, state = triton_prefill(*inputs)
    expected_output, expected_state = prefix_linear_attention_chunked(*inputs)
    torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-4)


def test_rejects_what_it_does_not_implement(device):
    q, k, v, _, _ = make_inputs(1, 8, 2, 16, 0, device=device)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        prefix_linear_attention_triton(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="pad_masking"):
        triton_prefill(q, k, v, pad_masking="leaky")
    with pytest.raises(ValueError, match="encoder_start <= encoder_end"):
        triton_prefill(q, k, v, k[:, :3], v[:, :3], encoder_end=torch.tensor([4], device=device))


# The kernel choice: which implementation `prefix_linear_attention(..., implementation="auto")` runs.

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # the choice reads only the device's type


@pytest.mark.parametrize(("device_", "expected"), [pytest.param(CUDA, "triton", id="cuda"),
                                                   pytest.param(CPU, "chunked", id="cpu")])
def test_auto_picks(device_, expected):
    assert KernelChoice("auto").linear_attention(device_) == expected


def test_auto_without_kernel_is_chunked(monkeypatch):
    monkeypatch.setitem(sys.modules, "jrt_kernels", None)  # `import jrt_kernels` raises ImportError
    assert KernelChoice("auto").linear_attention(CUDA) == "chunked"
    with pytest.raises(RuntimeError, match="pip install"):
        KernelChoice("triton").linear_attention(CUDA)


def test_kernels_of_another_release_are_not_called(monkeypatch):
    """`jrt_kernels` of another kernel API (installed beside model code of another release): "auto" runs PyTorch
    (with a warning naming both versions), "triton" refuses; nothing asks the kernels what they accept."""
    import jrt_kernels

    monkeypatch.setattr(jrt_kernels, "KERNEL_API", kernel_choice.KERNEL_API + 1)
    assert KernelChoice("auto").linear_attention(CUDA) == "chunked"
    with pytest.raises(RuntimeError, match="jrt_kernels"):
        KernelChoice("triton").linear_attention(CUDA)


@pytest.mark.parametrize("asked", ["chunked", "triton", "quadratic"])
def test_an_explicit_implementation_is_taken_on_every_device(asked):
    assert KernelChoice(asked).linear_attention(CPU) == KernelChoice(asked).linear_attention(CUDA) == asked


def test_a_model_choice_follows_its_config():
    config = types.SimpleNamespace(linear_attention_implementation="chunked")
    choice = KernelChoice(config=config)
    assert choice.linear_attention(CUDA) == "chunked"
    config.linear_attention_implementation = "auto"
    assert choice.linear_attention(CUDA) == "triton"
    config.linear_attention_implementation = "gpu"
    with pytest.raises(ValueError, match="`config.linear_attention_implementation` must be one of"):
        choice.linear_attention(CUDA)
    with pytest.raises(ValueError, match="`implementation` must be one of"):
        KernelChoice("gpu")


@pytest.fixture
def failing_launch(monkeypatch, auto_takes_kernel):
    """The kernel's launch raises as on a GPU without enough shared memory; "auto" resolves to the kernel on CPU."""
    from triton.runtime.errors import OutOfResources

    launches = []

    def fail(*args, **kwargs):
        launches.append(1)
        raise OutOfResources(262144, 232448, "shared memory")

    monkeypatch.setattr(kernel_module._prefix_linear_attention_fwd_kernel, "run", fail)
    return launches


def test_auto_falls_back_when_the_kernel_fails(device, failing_launch):
    """A failed launch under "auto" warns once (naming the error and the config switch) and returns chunked results;
    later calls skip the kernel."""
    from transformers.testing_utils import CaptureLogger

    inputs = make_inputs(1, 20, 2, 16, 7, device=device)
    choice = KernelChoice("auto")  # a model's: it remembers the failure
    with CaptureLogger(kernel_choice.logger) as captured:
        output, state = prefix_linear_attention(*inputs, implementation=choice)
        again, _ = prefix_linear_attention(*inputs, implementation=choice)
    expected_output, expected_state = prefix_linear_attention(*inputs, implementation="chunked")
    torch.testing.assert_close(output, expected_output)
    torch.testing.assert_close(state, expected_state)
    torch.testing.assert_close(again, expected_output)
    assert len(failing_launch) == 1 and "OutOfResources" in choice.failures[kernel_choice.LINEAR_ATTENTION]
    assert "OutOfResources" in captured.out and "linear_attention_implementation='chunked'" in captured.out
    assert captured.out.count("failed on this device") == 1


def test_explicit_triton_still_raises(device, failing_launch):
    from triton.runtime.errors import OutOfResources

    with pytest.raises(OutOfResources):
        prefix_linear_attention(*make_inputs(1, 20, 2, 16, 7, device=device), implementation="triton")


def test_dispatcher_runs_the_kernel(device, monkeypatch):
    """`prefix_linear_attention` calls exactly the implementation it resolves to."""
    calls = []

    def spy(*args, **kwargs):
        calls.append("triton")
        return prefix_linear_attention_triton(*args, **kwargs)

    monkeypatch.setattr(jrt_kernels, "prefix_linear_attention_triton", spy)
    inputs = make_inputs(1, 20, 2, 16, 7, device=device)
    output, state = prefix_linear_attention(*inputs, implementation="triton")
    expected_output, expected_state = prefix_linear_attention(*inputs, implementation="chunked")
    assert calls == ["triton"]
    torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_model_logits_with_kernel(device, make_config, padded):
    """The whole model with the (interpreted) kernel gives the logits of the PyTorch path, and the same cache."""
    torch.manual_seed(0)
    config = make_config(linear_attention_implementation="chunked")
    model = modeling_jrt.JRTRNNForCausalLM(config).to(device).eval()
    input_ids = torch.randint(4, config.vocab_size, (2, 13), device=device)
    attention_mask = torch.ones_like(input_ids)
    prefix_length = None
    if padded:
        attention_mask[0, :3] = 0
        prefix_length = torch.tensor([4, 13], device=device)  # per-row prefixes, one of them the whole row
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask, prefix_length=prefix_length).logits
        model.config.linear_attention_implementation = "triton"
        logits = model(input_ids, attention_mask=attention_mask, prefix_length=prefix_length).logits
    rows = attention_mask.bool()
    torch.testing.assert_close(logits[rows], expected[rows], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake tensors need the compiled (traceable) kernel")
def test_fake_tensor_shapes(device):
    """The torch.library.triton_op registration: shapes and dtypes under FakeTensorMode, no kernel launch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = (torch.empty(2, 33, 2, 16, dtype=torch.bfloat16, device=device) for _ in range(2))
        v = torch.empty(2, 33, 2, 112, dtype=torch.bfloat16, device=device)
        output, state = prefix_linear_attention_triton(q, k, v, k[:, :10], v[:, :10])
    assert output.shape == (2, 33, 2, 112) and output.dtype == torch.bfloat16
    assert state.shape == (2, 2, 273, 113) and state.dtype == torch.float32


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel at a long length needs CUDA")
@pytest.mark.parametrize("M", [0, 2048])
def test_bf16_long_prefill_matches_fp32_chunked(device, M):
    """GPU check: bf16 inputs at 4k tokens against the fp32 PyTorch path (error must stay at bf16 level)."""
    B, T, H, V = 2, 4096, 4, 64
    inputs = make_inputs(B, T, H, V, M, dtype=torch.bfloat16, device=device)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[0, :100] = False
    output, state = prefix_linear_attention_triton(*inputs, key_mask=key_mask)
    as32 = [None if t is None else t.float() for t in inputs]
    expected_output, expected_state = prefix_linear_attention_chunked(*as32, key_mask=key_mask)
    torch.testing.assert_close(output.float()[key_mask], expected_output[key_mask], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state, expected_state, rtol=1e-2, atol=1e-2 * expected_state.abs().max().item())


def test_fp16_large_state_does_not_overflow(device):
    """fp16 inputs after about 1M earlier tokens (256 tokens, each repeated 4096 times: the state is the exact
    state of such a sequence, with 2nd-order numerator sums past fp16's 65504). The state operands are bf16, so the output
    stays finite and at fp16/bf16 accuracy (an fp16 cast of the state would give inf)."""
    earlier = make_inputs(1, 256, 2, 6, 0, dtype=torch.float16, device=device, seed=5)
    _, earlier_state = oracle(*earlier[:3])
    initial_state = (earlier_state * 4096).float()
    assert initial_state[:, :, 7:, :-1].abs().max() > 65504  # the rows that multiply q' (x) q' in a matmul
    q, k, v, k_enc, v_enc = make_inputs(1, 40, 2, 6, 9, dtype=torch.float16, device=device, seed=3)
    output, state = prefix_linear_attention_triton(q, k, v, k_enc, v_enc, initial_state=initial_state)
    expected_output, expected_state = oracle(q, k, v, k_enc, v_enc, initial_state=initial_state)
    assert torch.isfinite(output).all() and torch.isfinite(state).all()
    torch.testing.assert_close(output.double(), expected_output, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-3, atol=1e-3 * expected_state.abs().max().item())


def test_model_training_step_with_kernel(device, make_config):
    """A training step of the whole model with the (interpreted) kernel and its fused backward: the loss and every
    parameter gradient match the chunked PyTorch path."""
    torch.manual_seed(0)
    config = make_config(linear_attention_implementation="chunked")
    model = modeling_jrt.JRTRNNForCausalLM(config).to(device).train()
    input_ids = torch.randint(4, config.vocab_size, (2, 13), device=device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    losses, grads = [], []
    for implementation in ("chunked", "triton"):
        model.config.linear_attention_implementation = implementation
        model.zero_grad(set_to_none=True)
        loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    assert grads[1].keys() == grads[0].keys()
    for name, expected in grads[0].items():
        torch.testing.assert_close(grads[1][name], expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("strategy", ["pad", "repeat"])
def test_generation_masks_take_the_range_launch(strategy):
    """The masks the model builds for a left-padded JRT batch (batch padding, then the fill of short prompts, then
    the prompt) keep every row one range, so batched generation never takes the general-mask launch."""
    from modeling_jrt import JRTRNNConfig
    from modeling_jrt.prefix_fill import fill_prefix, plan_prefix

    ids = torch.arange(3 * 9).view(3, 9) % 50 + 1
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[0, :6] = 0  # a 3-token prompt: filled up to the prefix length
    attention_mask[1, :2] = 0
    config = JRTRNNConfig(vocab_size=64, prefix_pad_token_id=7)
    plan = plan_prefix(config, attention_mask, 3, 9, ids.device, prefix_length=8, strategy=strategy)
    _, _, mask, linear_attention_mask = fill_prefix(plan, ids, None, attention_mask)
    key_mask = mask.bool()
    if linear_attention_mask is not None:  # as JRTRNNLinearAttention combines them
        key_mask &= linear_attention_mask.bool()
    assert (key_mask.sum(-1) < key_mask.shape[1]).any()  # some rows are padded
    assert kernel_module._key_rows(key_mask)[:, 0].tolist() == [1, 1, 1]


# The sequence-parallel prefill (`segment_length`): segments of 64 tokens, the smallest allowed, over T = 200 (three
# whole segments and a partial one), encoder ranges crossing segment boundaries.
SEGMENT = 64


def assert_segments_match(q, k, v, k_enc=None, v_enc=None, **kwargs):
    """The segmented kernel equals the one-pass kernel (fp32 sums in another order) and the fp64 oracle."""
    with torch.no_grad():
        one_pass = prefix_linear_attention_triton(q, k, v, k_enc, v_enc, segment_length=0, **kwargs)
        segmented = prefix_linear_attention_triton(q, k, v, k_enc, v_enc, segment_length=SEGMENT, **kwargs)
    rows = torch.ones(q.shape[:2], dtype=torch.bool) if kwargs.get("key_mask") is None else kwargs["key_mask"].cpu()
    expected_output, expected_state = oracle(q, k, v, k_enc, v_enc, **kwargs)
    state_scale = expected_state.abs().max().item()
    torch.testing.assert_close(segmented[0].cpu()[rows], one_pass[0].cpu()[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(segmented[1].cpu(), one_pass[1].cpu(), rtol=1e-5, atol=1e-6 * state_scale)
    torch.testing.assert_close(segmented[0].cpu().double()[rows], expected_output.cpu()[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(segmented[1].cpu().double(), expected_state.cpu(), rtol=1e-5, atol=1e-5 * state_scale)


@pytest.mark.parametrize("M", [0, 1, 70, 200], ids=["M0", "M1", "M70", "Mall"])
def test_segments_match_one_pass(device, M):
    """Encoders of no token, one, one segment and a bit (split over two segments' programs) and every token."""
    inputs = make_inputs(2, 200, 2, 8, M, K=4, device=device, seed=20)
    initial_state = oracle(*make_inputs(2, 30, 2, 8, 0, K=4, device=device, seed=21)[:3])[1].float()
    assert_segments_match(*inputs, initial_state=initial_state)


@pytest.mark.parametrize("pad_masking", ["strict", "reference"])
def test_segments_with_key_masks_and_encoder_ranges(device, pad_masking):
    """Rows of every mask kind (a left pad longer than a segment, holes, a row with no key) and per-row encoder
    ranges that start after the padding and end inside a later segment: both mask launches of both passes."""
    T = 200
    key_mask = torch.ones(4, T, dtype=torch.bool, device=device)
    key_mask[1, : SEGMENT + 10] = False
    key_mask[2, 100:103] = False
    key_mask[3] = False
    starts = torch.tensor([0, SEGMENT + 10, 5, 0], device=device)
    ends = torch.tensor([150, 140, 130, 0], device=device)
    inputs = make_inputs(4, T, 2, 8, 150, K=4, device=device, seed=22)
    assert_segments_match(
        *inputs, key_mask=key_mask, pad_masking=pad_masking, encoder_start=starts, encoder_end=ends
    )


def test_segments_with_based_decay_gate_and_asymmetric_state(device):
    """The Based decay (a segment's state ages by gamma**64 per segment), the gate, and an initial state with an
    antisymmetric part that must reach the final state decayed by gamma**T."""
    q, k, v, _, _ = make_inputs(2, 200, 2, 8, 0, K=4, device=device, seed=23)
    generator = torch.Generator().manual_seed(24)
    initial_state = (torch.randn(2, 2, 21, 9, generator=generator) * 2).to(device)
    initial_state[..., -1] = initial_state[..., -1].abs() + 1
    log_decay = torch.log(torch.tensor([0.95, 0.999])).to(device)
    gate = torch.rand(2, 200, 2, generator=generator).to(device)
    assert_segments_match(q, k, v, initial_state=initial_state, log_decay=log_decay, gate=gate)


def test_one_segment_is_the_one_pass_kernel(device):
    """A segment at least as long as the row runs the one-pass kernel: the same bits."""
    inputs = make_inputs(1, 50, 2, 8, 20, K=4, device=device, seed=25)
    with torch.no_grad():
        one_pass = prefix_linear_attention_triton(*inputs, segment_length=0)
        segment = prefix_linear_attention_triton(*inputs, segment_length=SEGMENT)
    assert torch.equal(one_pass[0], segment[0]) and torch.equal(one_pass[1], segment[1])


def test_segment_length_is_checked(device):
    q, k, v, k_enc, v_enc = make_inputs(1, 70, 1, 8, 10, K=4, device=device, seed=26)
    for bad in (-64, 32, 100):
        with pytest.raises(ValueError, match="positive multiple of 64"):
            prefix_linear_attention_triton(q, k, v, k_enc, v_enc, segment_length=bad)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="for inference"):
        prefix_linear_attention_triton(q, k, v, k_enc, v_enc, segment_length=SEGMENT)
    with torch.no_grad(), pytest.raises(ValueError, match="for inference"):
        prefix_linear_attention_triton(q, k, v, k_enc, v_enc, segment_length=SEGMENT, return_saved=True)


def test_auto_segment_length(monkeypatch):
    """Segments only on CUDA, only below one program per SM and from SEGMENTED_FROM tokens on, at least MIN_SEGMENT
    tokens each, whole multiples of 64, about two programs per SM (the SM count is faked: no GPU is needed for the
    arithmetic)."""
    assert kernel_module.auto_segment_length(1, 8, 65536, torch.device("cpu")) == 0
    monkeypatch.setattr(kernel_module, "INTERPRETED", False)
    monkeypatch.setattr(kernel_module, "_multiprocessor_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    length = kernel_module.auto_segment_length(1, 8, 65536, cuda)
    assert length == 2048 and 65536 // length * 8 >= 132  # 32 segments: 256 programs for 132 SMs
    assert kernel_module.auto_segment_length(1, 8, 8192, cuda) == 512  # MIN_SEGMENT: 16 segments
    assert kernel_module.auto_segment_length(1, 8, 8191, cuda) == 0  # under SEGMENTED_FROM: one pass
    assert kernel_module.auto_segment_length(16, 16, 65536, cuda) == 0  # 256 programs already
    assert kernel_module.auto_segment_length(3, 5, 100_000, cuda) % 64 == 0


def test_compiled_calls_take_the_one_pass(device, monkeypatch):
    """Under torch.compile the automatic choice is the one pass (the segmented launches are not traced), and an
    explicit segment length is refused with a message (simulated: `torch.compiler.is_compiling` patched)."""
    inputs = make_inputs(1, 200, 2, 8, 20, K=4, device=device, seed=27)
    with torch.no_grad():
        one_pass = prefix_linear_attention_triton(*inputs, segment_length=0)
    monkeypatch.setattr(kernel_module, "auto_segment_length", lambda *args: SEGMENT)  # as if on a GPU
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        traced = prefix_linear_attention_triton(*inputs)
        with pytest.raises(ValueError, match="eagerly only"):
            prefix_linear_attention_triton(*inputs, segment_length=SEGMENT)
    assert torch.equal(traced[0], one_pass[0]) and torch.equal(traced[1], one_pass[1])
