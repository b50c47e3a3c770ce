"""Fused Triton kernels for jrt-rnn (installed as `jrt_kernels`).

The prefill kernel has the same signature as its PyTorch reference in `modeling_jrt.linear_attention`, which stays
the fallback everywhere; the serving decode step (`linear_attention_decode_triton`) takes a pool of states and each
request's slot, and replaces gather + `linear_attention_step` + write-back; `rms_norm_triton` is the model's RMSNorm in
one launch. Importing this package needs triton (`pip install 'jrt-rnn[triton]'`).
"""

try:
    import triton  # noqa: F401
except ImportError as error:
    raise ImportError("jrt_kernels needs triton: install it with `pip install 'jrt-rnn[triton]'` (or `pip "
                      "install triton`). Without it, modeling_jrt uses its PyTorch implementation.") from error

from .linear_attention_decode import linear_attention_decode_triton
from .prefix_linear_attention import prefix_linear_attention_triton
from .prefix_linear_attention_backward import (
    prefix_linear_attention_backward as prefix_linear_attention_backward_triton,
)
from .rms_norm import rms_norm_triton

KERNEL_API = 2
"""The version of the calls above (names, arguments, results). The model code of the same release checks it
(`modeling_jrt.kernel_choice.KERNEL_API`) and runs PyTorch against another; bump both together."""

__all__ = [
    "KERNEL_API", "linear_attention_decode_triton", "prefix_linear_attention_backward_triton",
    "prefix_linear_attention_triton", "rms_norm_triton",
]
