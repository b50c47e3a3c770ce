"""Triton helpers shared by the prefill kernels (forward and backward of prefix linear attention).

Operand precision (docs/prefill.md §5): state and accumulators are fp32; `tl.dot` operands are cast to DOT (chunk
operands: q, k, v, weights) or SDOT (operands that multiply the state, which grows with the sequence: bf16 for fp16
inputs, whose range ends at 65504). fp32 inputs run as 3xTF32 (tensor cores, about fp32 accuracy). In triton's CPU
interpreter a bf16 `tl.dot` multiplies raw bits, so EMULATE rounds each operand to its dtype and multiplies in fp32:
the same arithmetic as a tensor core (exact products of rounded operands, fp32 sums).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(p_base, o_t, m_t, s_t, o_d, m_d, s_d):
    """A (BT, BD) tile of a (T, D) slice with strides (s_t, s_d), zeros outside (as fp32)."""
    p = p_base + o_t[:, None] * s_t + o_d[None, :] * s_d
    return tl.load(p, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _op(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """A matmul operand in DTYPE; under EMULATE, rounded to DTYPE and kept fp32 (exact products, fp32 sums)."""
    if EMULATE:
        return x.to(DTYPE).to(tl.float32)
    return x.to(DTYPE)


@triton.jit
def _dot(a, b, DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with operands in DTYPE, fp32 result."""
    return tl.dot(_op(a, DTYPE, EMULATE), _op(b, DTYPE, EMULATE), input_precision=PRECISION)


@triton.jit
def _dot_fp32(a, b):
    """a @ b of fp32 operands to about fp32 accuracy on tensor cores (3xTF32); small denominator-state products."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _outer(b_x, BT: tl.constexpr, BK: tl.constexpr):
    """Row-wise outer product [BT, BK] -> [BT, BK * BK] (2nd-order features of one chunk, on chip)."""
    return tl.reshape(b_x[:, :, None] * b_x[:, None, :], [BT, BK * BK])


@triton.jit
def _sym_contract(b_p, b_x, BT: tl.constexpr, BK: tl.constexpr):
    """1/2 (P + P^T) x per row: [BT, BK * BK] (row-major BK x BK per token), [BT, BK] -> [BT, BK]."""
    b_p3 = tl.reshape(b_p, [BT, BK, BK])
    return 0.5 * (tl.sum(b_p3 * b_x[:, None, :], axis=2) + tl.sum(b_p3 * b_x[:, :, None], axis=1))


@triton.jit
def _key_weights(p_m, s_mt, o_t, m_t, start, end, HAS_MASK: tl.constexpr, STRICT: tl.constexpr,
                 ENCODER: tl.constexpr):
    """(raw, weight) of the keys at positions o_t: raw False zeroes the raw key, weight is its 0/1 weight.

    Decoder keys: weight = key_mask, or under "reference" masking key_mask | in the encoder range.
    Encoder keys: weight = in the range [start, end), and key_mask under strict masking.
    """
    in_range = (o_t >= start) & (o_t < end) & m_t
    if HAS_MASK:
        b_m = (tl.load(p_m + o_t * s_mt, mask=m_t, other=0) != 0) & m_t
    else:
        b_m = m_t
    if ENCODER:
        b_w = in_range & b_m if STRICT else in_range
    else:
        b_w = b_m if STRICT else b_m | in_range
    return b_m, b_w


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_types(dtype: torch.dtype, interpreted: bool) -> dict:
    """The constexprs DOT, SDOT, EMULATE, PRECISION for inputs of `dtype`."""
    if dtype == torch.float32:
        return dict(DOT=tl.float32, SDOT=tl.float32, EMULATE=False, PRECISION="tf32x3")
    state = tl.bfloat16 if dtype == torch.float16 else _TL_DTYPES[dtype]
    return dict(DOT=_TL_DTYPES[dtype], SDOT=state, EMULATE=interpreted, PRECISION="tf32")
