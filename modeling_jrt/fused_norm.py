"""`JRTRNNRMSNorm` as one launch on a GPU: the fused kernel of `jrt_kernels` (`rms_norm_triton`) where it applies.

The PyTorch norm is five to seven ops, two norms per layer the largest share of a GPU decode step's launches. Where
the kernel applies (no autograd, not traced, and the model's `KernelChoice` says so) the norm is one launch.
"""

from __future__ import annotations

import torch

from .kernel_choice import NORM, KernelChoice


def fused_rms_norm(
    hidden_states: torch.Tensor, weight: torch.Tensor, eps: float, choice: KernelChoice,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The RMSNorm of `hidden_states` `(..., hidden)` with `weight` `(hidden,)`, in the weight's dtype (into `out`
    when given), by the fused kernel; None where the kernel does not apply or failed (the caller runs PyTorch's)."""
    if (
        torch.is_grad_enabled() or torch.compiler.is_compiling() or hidden_states.stride(-1) != 1
        or not choice.fused_norm(hidden_states.device)
    ):
        return None
    width = hidden_states.shape[-1]
    flat = hidden_states.reshape(-1, width)

    def kernel() -> torch.Tensor:
        result = choice.kernels().rms_norm_triton(flat, weight, eps, out=None if out is None else out.view(-1, width))
        return result.view(hidden_states.shape) if out is None else out

    return choice.run(NORM, kernel, lambda: None)


__all__ = ["fused_rms_norm"]
