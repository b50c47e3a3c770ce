"""RMSNorm in one launch: `y = x / sqrt(mean(x**2) + eps) * w`, the sums in fp32, written in the weight's dtype.

The model's `JRTRNNRMSNorm` without autograd is five to seven PyTorch ops per norm, and an eager decode step on a GPU
is bound by launches. One program per row: a pass sums the row's squares in blocks, a second scales and writes it.
Its PyTorch reference is `JRTRNNRMSNorm.normalize` (the tests compare the two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, check_devices

MAX_BLOCK = 4096
"""Elements of a row read at once (a wider row goes in several blocks)."""


@triton.jit
def _rms_norm_kernel(x, w, y, s_x, s_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        columns = start + offsets
        values = tl.load(x + row * s_x + columns, mask=columns < N, other=0.0).to(tl.float32)
        total += values * values
    scale = 1.0 / tl.sqrt(tl.sum(total, axis=0) / N + eps)
    for start in range(0, N, BLOCK):
        columns = start + offsets
        inside = columns < N
        values = tl.load(x + row * s_x + columns, mask=inside, other=0.0).to(tl.float32)
        weight = tl.load(w + columns, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + row * s_y + columns, (values * scale * weight).to(y.dtype.element_ty), mask=inside)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of `x` `(rows, N)` (last dimension contiguous; any float dtype) with `weight` `(N,)`.

    Returns `out` (or a new `(rows, N)` tensor) in the weight's dtype.

    Raises:
        ValueError: shapes, strides or devices the kernel does not take.
    """
    if x.ndim != 2 or weight.shape != (x.shape[1],) or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x must be (rows, N) with a contiguous last dimension and weight (N,); got {tuple(x.shape)} "
                         f"with strides {x.stride()} and {tuple(weight.shape)}.")
    if out is None:
        out = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != weight.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} {weight.dtype} with a contiguous last dimension.")
    check_devices("RMSNorm", [x, weight, out], INTERPRETED, "use the PyTorch RMSNorm")
    rows, width = x.shape
    if rows and width:
        block = min(triton.next_power_of_2(width), MAX_BLOCK)
        _rms_norm_kernel[(rows,)](x, weight, out, x.stride(0), out.stride(0), width, float(eps), BLOCK=block)
    return out


__all__ = ["rms_norm_triton"]
