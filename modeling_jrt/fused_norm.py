"""`JRTRNNRMSNorm` as one launch on a GPU: the fused kernel of `jrt_kernels` (`rms_norm_triton`) where it applies.

Without autograd the PyTorch norm is five to seven ops, and a decode step runs two norms per layer: on a GPU, whose
eager decode is bound by kernel launches, that is the largest share of a step's launches. Where the kernel applies
(a CUDA tensor, no autograd, not traced by torch.compile, `jrt_kernels` installed) the norm is one launch; a kernel
that fails to compile or launch warns once and the PyTorch norm runs from then on, as for the linear attention.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

KERNEL_DEVICE_TYPES = ("cuda",)
"""Device types whose tensors the kernel takes (the tests add "cpu" to run it in triton's interpreter)."""

_failure: str | None = None


def _load_kernel():
    """`jrt_kernels.rms_norm_triton`, or None when it (or triton) is not installed (e.g. Hub remote code alone)."""
    try:
        from jrt_kernels.rms_norm import rms_norm_triton
    except ImportError:
        return None
    return rms_norm_triton


def fused_rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The RMSNorm of `hidden_states` `(..., hidden)` with `weight` `(hidden,)`, in the weight's dtype (into `out`
    when given), by the fused kernel; None where the kernel does not apply or failed (the caller runs PyTorch's)."""
    global _failure
    if (
        hidden_states.device.type not in KERNEL_DEVICE_TYPES or _failure is not None or torch.is_grad_enabled()
        or torch.compiler.is_compiling() or hidden_states.stride(-1) != 1
    ):
        return None
    kernel = _load_kernel()
    if kernel is None:
        return None
    width = hidden_states.shape[-1]
    try:
        flat = hidden_states.reshape(-1, width)
        result = kernel(flat, weight, eps, out=None if out is None else out.view(-1, width))
    except Exception as error:  # noqa: BLE001 -- any compile/launch failure of the optional kernel
        message = str(error).strip().splitlines()
        _failure = f"{type(error).__name__}: {message[0] if message else ''}"
        logger.warning_once(
            f"The fused Triton RMSNorm failed on this device ({_failure[:300]}); the PyTorch RMSNorm runs for the "
            "rest of this process."
        )
        return None
    return result.view(hidden_states.shape) if out is None else out


__all__ = ["KERNEL_DEVICE_TYPES", "fused_rms_norm"]
