"""Fused Triton kernels for jrt-rnn (installed as `jrt_kernels`).

Each kernel has the same signature as its PyTorch reference in `modeling_jrt.linear_attention`, which stays the
fallback everywhere. Importing this package needs triton.
"""
