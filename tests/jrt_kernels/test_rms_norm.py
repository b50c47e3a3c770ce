"""The fused RMSNorm (`jrt_kernels.rms_norm_triton`) against the model's PyTorch norm (`JRTRNNRMSNorm.normalize`), and
the model's norms taking it where it applies: compiled on a CUDA machine, in triton's CPU interpreter elsewhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernel needs triton (Linux: pip install -e '.[dev]')")

import jrt_kernels  # noqa: E402
from jrt_kernels import rms_norm_triton  # noqa: E402
from jrt_kernels.rms_norm import INTERPRETED, MAX_BLOCK  # noqa: E402
from modeling_jrt import kernel_choice  # noqa: E402
from modeling_jrt.modeling_jrt import JRTRNNRMSNorm  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


@pytest.fixture
def kernel_on_this_device(monkeypatch):
    """The model's kernels run on this device (the interpreter on CPU); each test sees its own warnings."""
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(kernel_choice, "KERNEL_DEVICE_TYPES", ("cuda", DEVICE.type))
    hf_logging.warning_once.cache_clear()


def pytorch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = JRTRNNRMSNorm(x.shape[-1], eps=eps).to(DEVICE, weight.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm.normalize(x)  # on CPU: the PyTorch path (the kernel applies to CUDA tensors by default)


@pytest.mark.parametrize("rows, width", [(1, 32), (7, 100), (3, MAX_BLOCK + 37), (0, 16), (2, 1)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_pytorch_norm(rows, width, weight_dtype):
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    x = (torch.randn(rows, width, generator=generator) * 3).to(DEVICE)
    weight = torch.randn(width, generator=generator).to(DEVICE, weight_dtype)
    expected = pytorch_norm(x, weight, 1e-5) if DEVICE.type == "cpu" else None
    if expected is None:
        expected = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(weight_dtype)
    actual = rms_norm_triton(x, weight, 1e-5)
    assert actual.dtype == weight_dtype and actual.shape == x.shape
    tolerance = 1e-5 if weight_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    out = torch.empty(rows, width, dtype=weight_dtype, device=DEVICE)
    assert rms_norm_triton(x, weight, 1e-5, out=out) is out
    torch.testing.assert_close(out, actual, rtol=0, atol=0)


def test_bad_arguments_are_named():
    x, weight = torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \(rows, N\) with a contiguous last dimension"):
        rms_norm_triton(x.t(), torch.randn(3, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match=r"weight \(N,\)"):
        rms_norm_triton(x, torch.randn(9, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match=r"out must be \(3, 8\) torch.float32"):
        rms_norm_triton(x, weight, 1e-5, out=torch.empty(3, 8, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize("kind", ["prefix", "causal"])
def test_the_models_norms_take_the_kernel_without_autograd(monkeypatch, kernel_on_this_device, kind):
    """Every norm of a no-grad forward is one kernel launch (prefill and decode); the greedy tokens and the logits
    equal the PyTorch norms'; with autograd (training) the PyTorch norm runs."""
    from conftest import tiny_config

    from modeling_jrt import JRTRNNForCausalLM

    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return rms_norm_triton(*args, **kwargs)

    monkeypatch.setattr(jrt_kernels, "rms_norm_triton", spy)
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config(initializer_range=0.3, linear_attention_type=kind)).eval().to(DEVICE)
    input_ids = torch.randint(4, 99, (2, 10), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    settings = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                    return_dict_in_generate=True)
    fused = model.generate(input_ids, **settings)
    norms = 2 * model.config.num_hidden_layers + 1
    assert len(calls) == 3 * norms  # the prefill and two decode steps
    model.train()
    model(input_ids, labels=input_ids).loss.backward()
    assert len(calls) == 3 * norms  # training: PyTorch's norm (autograd)
    model.eval()
    monkeypatch.setattr(kernel_choice, "KERNEL_DEVICE_TYPES", ())
    plain = model.generate(input_ids, **settings)
    torch.testing.assert_close(fused.sequences, plain.sequences, rtol=0, atol=0)
    torch.testing.assert_close(fused.scores, plain.scores, rtol=1e-4, atol=1e-4)


def test_a_failing_kernel_warns_once_and_the_pytorch_norm_runs(monkeypatch, kernel_on_this_device):
    from transformers.testing_utils import CaptureLogger

    def failing(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(jrt_kernels, "rms_norm_triton", failing)
    norm = JRTRNNRMSNorm(16).to(DEVICE)
    x = torch.randn(4, 16, device=DEVICE)
    with torch.no_grad(), CaptureLogger(kernel_choice.logger) as captured:
        first, second = norm(x), norm(x)
    assert "The fused Triton RMSNorm kernel failed on this device (RuntimeError: no kernel image" in captured.out
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert "no kernel image" in norm.kernels.failures[kernel_choice.NORM]
