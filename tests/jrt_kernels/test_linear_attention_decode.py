"""The serving decode kernel (`jrt_kernels.linear_attention_decode_triton`) against the PyTorch step on the states
gathered from their slots (`linear_attention_step`, written back): compiled on a CUDA machine, in triton's CPU
interpreter elsewhere (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel needs triton (Linux: pip install -e '.[dev]')")

import jrt_kernels  # noqa: E402
from jrt_kernels import linear_attention_decode_triton  # noqa: E402
from jrt_kernels.linear_attention_decode import INTERPRETED  # noqa: E402
from modeling_jrt import kernel_choice  # noqa: E402
from modeling_jrt.linear_attention import (  # noqa: E402
    fixed_log_decay,
    linear_attention_step,
    linear_attention_step_at_slots,
    num_taylor_features,
)

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def make_inputs(B, H, K, V, slots_in_pool, *, dtype=torch.float32, seed=0):
    """q, k, v as strided views of one fused projection (as the plugin splits them), and a pool of states that are
    sums of earlier keys (positive denominators)."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(B, H * (2 * K + V), generator=generator).to(DEVICE)  # split on the device: views stay views
    q, k, v = fused.split([H * K, H * K, H * V], -1)
    q, k, v = (t.reshape(B, H, size).to(dtype) for t, size in ((q, K), (k, K), (v, V)))
    assert dtype != torch.float32 or B == 0 or not q.is_contiguous()  # fp32: the strided views themselves
    F = num_taylor_features(K)
    pool = torch.rand(slots_in_pool, H, F, V + 1, generator=generator).to(DEVICE)
    pool[..., :V] -= 0.5
    return q, k, v, pool


def reference(q, k, v, pool, slots, **kwargs):
    """The plugin's PyTorch step: (output, the pool after it)."""
    pool = pool.clone()
    output, state = linear_attention_step(q, k, v, pool.index_select(0, slots), **kwargs)
    pool.index_copy_(0, slots, state)
    return output, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("based", [False, True], ids=["plain", "decay+gate"])
@pytest.mark.parametrize("K, V", [(4, 8), (16, 20)])
def test_decode_updates_each_state_at_its_slot(dtype, based, K, V):
    B, H = 3, 2
    q, k, v, pool = make_inputs(B, H, K, V, slots_in_pool=7, dtype=dtype)
    slots = torch.tensor([5, 0, 3], device=DEVICE)
    kwargs = {}
    if based:
        kwargs = dict(log_decay=fixed_log_decay(-3.0, range(H), DEVICE), gate=torch.rand(B, H, device=DEVICE).to(dtype))
    expected_output, expected_pool = reference(q, k, v, pool, slots, **kwargs)
    work = pool.clone()
    output = linear_attention_decode_triton(q, k, v, work, slots, **kwargs)
    assert output.dtype == dtype and output.shape == (B, H, V)
    torch.testing.assert_close(output.float(), expected_output.float(), rtol=TOLERANCES[dtype],
                               atol=TOLERANCES[dtype])
    torch.testing.assert_close(work, expected_pool, rtol=1e-5, atol=1e-5)  # the state stays fp32
    others = [slot for slot in range(7) if slot not in slots.tolist()]
    assert torch.equal(work[others], pool[others])  # untouched


def test_consecutive_steps_match_and_int32_slots():
    """Three steps in a row (the state each step leaves is the next one's), slots as int32 (vLLM's state indices)."""
    B, H, K, V = 2, 2, 4, 8
    q, k, v, pool = make_inputs(B, H, K, V, slots_in_pool=4)
    slots = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    expected, work = pool.clone(), pool.clone()
    for step in range(3):
        expected_output, expected = reference(q * (step + 1), k, v - step, expected, slots.long())
        output = linear_attention_decode_triton(q * (step + 1), k, v - step, work, slots)
        torch.testing.assert_close(output, expected_output, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(work, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("based", [False, True], ids=["plain", "decay+gate"])
def test_without_slots_row_b_is_state_b(based):
    """`slots=None` (the model's own cache: a batch's states in order) equals the step at slots 0..B-1."""
    B, H, K, V = 3, 2, 4, 8
    q, k, v, pool = make_inputs(B, H, K, V, slots_in_pool=B)
    kwargs = {}
    if based:
        kwargs = dict(log_decay=fixed_log_decay(-3.0, range(H), DEVICE), gate=torch.rand(B, H, device=DEVICE))
    expected_output, expected_pool = reference(q, k, v, pool, torch.arange(B, device=DEVICE), **kwargs)
    work = pool.clone()
    output = linear_attention_decode_triton(q, k, v, work, **kwargs)
    torch.testing.assert_close(output, expected_output, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(work, expected_pool, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"Without slots, state must hold the B = 3 requests' states in order; got 4"):
        linear_attention_decode_triton(q, k, v, torch.cat([pool, pool[:1]]))


def test_no_request_is_a_no_op():
    q, k, v, pool = make_inputs(0, 2, 4, 8, slots_in_pool=2)
    work = pool.clone()
    assert linear_attention_decode_triton(q, k, v, work, torch.zeros(0, dtype=torch.long, device=DEVICE)).shape == (
        0, 2, 8)
    assert torch.equal(work, pool)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "state": a["state"].double()}, "state must be an fp32 (N, 2, 21, 9) pool"),
    (lambda a: {**a, "state": a["state"].transpose(2, 3).contiguous().transpose(2, 3)}, "contiguous last dimension"),
    (lambda a: {**a, "state": a["state"][:, :, :20]}, "state must be an fp32 (N, 2, 21, 9) pool"),
    (lambda a: {**a, "slots": a["slots"].float()}, "slots must be (3,) int32 / int64"),
    (lambda a: {**a, "slots": a["slots"][:2]}, "slots must be (3,) int32 / int64"),
    (lambda a: {**a, "k": a["k"][:, :, :3]}, "q, k must be (B, H, K) and v (B, H, V)"),
    (lambda a: {**a, "gate": torch.ones(3, device=DEVICE)}, "gate must be (3, 2)"),
    (lambda a: {**a, "log_decay": torch.ones(3, device=DEVICE)}, "log_decay must be (2,)"),
])
def test_bad_arguments_are_named(change, message):
    q, k, v, pool = make_inputs(3, 2, 4, 8, slots_in_pool=4)
    arguments = change(dict(q=q, k=k, v=v, state=pool, slots=torch.tensor([0, 1, 2], device=DEVICE)))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        linear_attention_decode_triton(**arguments)


# The dispatcher the vLLM plugin calls: `linear_attention_step_at_slots` picks the kernel as the prefill does.


def spy_on_kernel(monkeypatch, kernel=linear_attention_decode_triton) -> list[int]:
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(jrt_kernels, "linear_attention_decode_triton", spy)
    return calls


@pytest.mark.parametrize("implementation", ["chunked", "triton"])
def test_step_at_slots_runs_what_it_resolves_to(monkeypatch, implementation):
    """"chunked" (and "auto" on CPU) runs the PyTorch step at the slots; "triton" runs the kernel; both equal the
    PyTorch step on the gathered states, and leave the other slots alone."""
    calls = spy_on_kernel(monkeypatch)
    q, k, v, pool = make_inputs(3, 2, 4, 8, slots_in_pool=5)
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    expected_output, expected_pool = reference(q, k, v, pool, slots)
    work = pool.clone()
    output = linear_attention_step_at_slots(q, k, v, work, slots, implementation=implementation)
    assert len(calls) == (implementation == "triton")
    torch.testing.assert_close(output, expected_output, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(work, expected_pool, rtol=1e-5, atol=1e-5)


def failing_kernel(*args, **kwargs):
    from triton.runtime.errors import OutOfResources

    raise OutOfResources(262144, 232448, "shared memory")


def test_step_at_slots_falls_back_under_auto(monkeypatch, auto_takes_kernel):
    """A kernel that fails to launch under "auto" warns once (as the prefill's does) and the PyTorch step runs."""
    from transformers.testing_utils import CaptureLogger

    calls = spy_on_kernel(monkeypatch, failing_kernel)
    q, k, v, pool = make_inputs(2, 2, 4, 8, slots_in_pool=3)
    slots = torch.tensor([2, 0], device=DEVICE)
    expected_output, expected_pool = reference(q, k, v, pool, slots)
    work = pool.clone()
    with CaptureLogger(kernel_choice.logger) as captured:
        output = linear_attention_step_at_slots(q, k, v, work, slots)
    assert calls == [1] and "OutOfResources" in captured.out
    torch.testing.assert_close(output, expected_output, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(work, expected_pool, rtol=1e-5, atol=1e-5)


def test_step_at_slots_asked_for_the_kernel_raises(monkeypatch):
    from triton.runtime.errors import OutOfResources

    spy_on_kernel(monkeypatch, failing_kernel)
    q, k, v, pool = make_inputs(2, 2, 4, 8, slots_in_pool=3)
    with pytest.raises(OutOfResources):
        linear_attention_step_at_slots(q, k, v, pool, torch.tensor([2, 0], device=DEVICE), implementation="triton")


@pytest.mark.parametrize("kind", [dict(linear_attention_type="prefix"),
                                  dict(linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True)],
                         ids=["jrt", "based-decay"])
def test_the_models_decode_step_takes_the_fused_kernel(monkeypatch, auto_takes_kernel, kind):
    """The HF model's eager decode step: where "auto" resolves to the kernel (a CUDA state; here the interpreter),
    each linear-attention layer's step is one launch of the fused kernel on the cache's state (the step at slots,
    each row its own; the norms take their kernel too); the greedy tokens equal those of PyTorch, the state to
    rounding."""
    from conftest import tiny_config

    from modeling_jrt import JRTRNNForCausalLM

    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(initializer_range=0.3, **kind)).eval()
    input_ids = torch.randint(4, 99, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(input_ids)
    mask[0, :4] = 0
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                    return_dict_in_generate=True)
    calls = spy_on_kernel(monkeypatch)
    with torch.no_grad():
        fused = model.generate(input_ids, **settings)
    layers = model.config.mixer_types.count("linear_attention")
    assert len(calls) == 3 * layers  # three decode steps after the prefill
    model.config.linear_attention_implementation = "chunked"
    with torch.no_grad():
        plain = model.generate(input_ids, **settings)
    torch.testing.assert_close(fused.sequences, plain.sequences, rtol=0, atol=0)
    for index, kind_name in enumerate(model.config.mixer_types):
        if kind_name == "linear_attention":
            torch.testing.assert_close(fused.cache.layers[index].state, plain.cache.layers[index].state,
                                       rtol=1e-4, atol=5e-5)
