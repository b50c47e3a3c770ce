"""Triton helpers shared by the kernels (the prefill's forward and backward, and the launchers' device rule).

Operand precision (`dot_types`; docs/kernels.md "Numerics"): fp32 state and accumulators; `tl.dot` operands cast to
DOT (chunk operands: q, k, v, weights) or SDOT (operands that multiply the state: bf16 for fp16 inputs); fp32 inputs
as 3xTF32. EMULATE (triton's CPU interpreter, whose bf16 `tl.dot` multiplies raw bits) rounds each operand to its
dtype and multiplies in fp32, as a tensor core does.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def check_devices(kernel: str, tensors: list[torch.Tensor], interpreted: bool, on_cpu: str) -> None:
    """A launcher's device rule: every tensor on the first one's device, and that a CUDA device unless triton runs
    in its CPU interpreter (tests). `kernel` names the kernel and `on_cpu` the way out on CPU in the message."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"All inputs must be on one device; got {sorted({str(t.device) for t in tensors})}.")
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"The Triton {kernel} kernel runs on CUDA tensors (got {device}); on CPU {on_cpu}, or set "
                         "TRITON_INTERPRET=1 before importing triton to run it in the interpreter (tests).")


@triton.jit
def _tile(p_base, o_t, m_t, s_t, o_d, m_d, s_d):
    """A (BT, BD) tile of a (T, D) slice with strides (s_t, s_d), zeros outside (as fp32)."""
    p = p_base + o_t[:, None] * s_t + o_d[None, :] * s_d
    return tl.load(p, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)


# TRITON_INTERPRET=1 when this package is first imported makes `triton.jit` return the CPU interpreter's function.
INTERPRETED = isinstance(_tile, InterpretedFunction)

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
def _dot_alone(a, b, acc, DTYPE: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b (operands in DTYPE, fp32 acc), computed as (b^T a^T + acc^T)^T so that the product gets the warp
    layout of its own shape: triton's chained-dot rule, which gives connected dots one `warpsPerCTA`, stops at
    transposes (under `[4, 1]` a 16-row accumulator takes 4x the registers)."""
    return tl.trans(tl.dot(_op(tl.trans(b), DTYPE, EMULATE), _op(tl.trans(a), DTYPE, EMULATE), acc=tl.trans(acc),
                           input_precision=PRECISION))


@triton.jit
def _dot_fp32(a, b):
    """a @ b of fp32 operands to about fp32 accuracy on tensor cores (3xTF32); small denominator-state products."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _tf32(x):
    """fp32 x truncated to TF32 (10 mantissa bits), as a tensor core reads an fp32 register for a TF32 product."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot_tf32(a, b, DOT: tl.constexpr, EMULATE: tl.constexpr):
    """a @ b of fp32 operands for the backward's denominator terms: one TF32 product for bf16 / fp16 inputs (whose
    numerator terms take bf16 state operands anyway), 3xTF32 for fp32 inputs; under EMULATE, truncated operands."""
    if DOT == tl.float32:
        return _dot_fp32(a, b)
    if EMULATE:
        return tl.dot(_tf32(a), _tf32(b), input_precision="tf32")
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _key_range(key_rows, i_b, MASK: tl.constexpr):
    """(skip, lo, hi) for row i_b in a launch of kind MASK (`_key_rows`: 0 no key mask, 1 the rows whose mask is one
    range, 2 the others): skip the row when it belongs to the other launch; [lo, hi) its keys in the range launch,
    else (0, 0). Every kernel that takes a key mask starts with it."""
    skip = False
    key_lo, key_hi = 0, 0
    if MASK != 0:
        is_range = tl.load(key_rows + i_b * 3)
        skip = (MASK == 1 and is_range == 0) or (MASK == 2 and is_range != 0)
        if MASK == 1:
            key_lo = tl.load(key_rows + i_b * 3 + 1)
            key_hi = tl.load(key_rows + i_b * 3 + 2)
    return skip, key_lo, key_hi


@triton.jit
def _key_weights(p_m, s_mt, o_t, m_t, start, end, key_lo, key_hi, MASK: tl.constexpr,
                 STRICT: tl.constexpr, ENCODER: tl.constexpr):
    """(raw, weight) of the keys at positions o_t: raw False zeroes the raw key, weight is its 0/1 weight.

    The key mask is read as MASK says: 0 none, 1 the row's range [key_lo, key_hi) (two comparisons), 2 the (B, T)
    mask itself (a load per chunk). Decoder keys: weight = key mask, or under "reference" masking key mask | in the
    encoder range. Encoder keys: weight = in the range [start, end), and the key mask under strict masking.
    """
    in_range = (o_t >= start) & (o_t < end) & m_t
    if MASK == 1:
        b_m = (o_t >= key_lo) & (o_t < key_hi) & m_t
    elif MASK == 2:
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


# The symmetric 2nd order (docs/kernels.md "Notation and the state"): K diagonal rows and K (K - 1) / 2 pair rows.
# Pair p < K (K - 1) / 2 is (i, i + d mod K) with i = p mod K, d = p // K + 1 (bands of K pairs; for even K the last
# band d = K / 2 holds its first K / 2 pairs), gathered by 0/1 selection matrices and scattered back by transposes.


@triton.jit
def _select(b_x, b_e, DOT: tl.constexpr, EMULATE: tl.constexpr):
    """b_x [BT, BK] @ b_e [BK, BP] for a 0/1 selection matrix: columns of b_x gathered on the tensor cores (exact
    for fp16/bf16 operands; 3xTF32 for fp32, whose error is below fp32 rounding here)."""
    if DOT == tl.float32:
        return tl.dot(b_x, b_e, input_precision="tf32x3")
    return _dot(b_x, b_e, DOT, EMULATE, "tf32")


@triton.jit
def _pair_index(o_p, o_k, K: tl.constexpr):
    """Pairs o_p [BH]: (valid [BH], full-layout state row of (i, j), of (j, i), selection matrices e_i, e_j [BK, BH]
    with x @ e_i gathering x_i of every pair, and their transposes e_i^T, e_j^T [BH, BK] that scatter back)."""
    m_p = o_p < (K * (K - 1)) // 2
    p_i = o_p % K
    p_j = (p_i + o_p // K + 1) % K
    b_ei = ((o_k[:, None] == p_i[None, :]) & m_p[None, :]).to(tl.float32)
    b_ej = ((o_k[:, None] == p_j[None, :]) & m_p[None, :]).to(tl.float32)
    b_eit = ((p_i[:, None] == o_k[None, :]) & m_p[:, None]).to(tl.float32)
    b_ejt = ((p_j[:, None] == o_k[None, :]) & m_p[:, None]).to(tl.float32)
    return m_p, 1 + K + p_i * K + p_j, 1 + K + p_j * K + p_i, b_ei, b_ej, b_eit, b_ejt


@triton.jit
def _pair_scatter(b_u, b_xi, b_xj, b_eit, b_ejt, SDOT: tl.constexpr, EMULATE: tl.constexpr,
                  PRECISION: tl.constexpr):
    """d/dx of sum_p u_p x_i x_j: [BT, BH] per-pair weights u and gathered x_i, x_j -> [BT, BK]; each pair (i, j)
    adds u x_j to feature i and u x_i to feature j, by the transposed (exact) selection matrices. The products u x
    are SDOT operands (u grows with the state): their rounding is the only one."""
    return (_dot(b_u * b_xj, b_eit, SDOT, EMULATE, PRECISION)
            + _dot(b_u * b_xi, b_ejt, SDOT, EMULATE, PRECISION))


@triton.jit
def _load_pairs_t(p_s, r_ij, r_ji, m_p, o_v, m_v, W: tl.constexpr):
    """Pair rows, transposed [BV, BH], of a full-layout 2nd-order block in the kernels' convention:
    (S_ij + S_ji) / sqrt(2)."""
    m_vp = m_v[:, None] & m_p[None, :]
    return (tl.load(p_s + r_ij[None, :] * W + o_v[:, None], mask=m_vp, other=0.0)
            + tl.load(p_s + r_ji[None, :] * W + o_v[:, None], mask=m_vp, other=0.0)) * 0.7071067811865476


@triton.jit
def _pair_features(b_xr, b_ei, b_ej, scale, DOT: tl.constexpr, EMULATE: tl.constexpr):
    """[BT, BK] raw (unscaled) features -> [BT, BH]: x_i x_j * scale**2 of the pairs (0 in the padding).

    Gathering the raw inputs keeps the selection exact (they are in DOT already); the scale (K**-1/4, not a power of
    two for most K) is applied in fp32, so each feature is rounded once, as an fp32 outer product would be.
    """
    return _select(b_xr, b_ei, DOT, EMULATE) * _select(b_xr, b_ej, DOT, EMULATE) * (scale * scale)


@triton.jit
def _pair_features_t(b_xtr, b_eit, b_ejt, scale, DOT: tl.constexpr, EMULATE: tl.constexpr):
    """The transposed pair features [BH, BT] from raw (unscaled) features b_xtr [BK, BT]: e_i^T x^T * e_j^T x^T."""
    return _select(b_eit, b_xtr, DOT, EMULATE) * _select(b_ejt, b_xtr, DOT, EMULATE) * (scale * scale)


@triton.jit
def _load_state_t(p_s, o_k, m_k, o_v, m_v, r_d, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, K: tl.constexpr,
                  V: tl.constexpr, W: tl.constexpr):
    """The state of a full-layout (F, V + 1) block at p_s in the kernels' form: (h0 [BV], h1 [BV, BK], hd [BV, BK],
    hoa [BV, BH], hob [BV, BH], z0 [1], z1 [BK], Z [BK, BK]); hd, ho and Z without phi's 1/sqrt(2) (times sqrt(2)
    here). Z is kept as loaded (symmetrising it changes the rounding of the cancelling q' Z q')."""
    m_vk = m_v[:, None] & m_k[None, :]
    b_h0 = tl.load(p_s + o_v, mask=m_v, other=0.0)
    b_h1 = tl.load(p_s + (1 + o_k[None, :]) * W + o_v[:, None], mask=m_vk, other=0.0)
    b_hd = tl.load(p_s + r_d[None, :] * W + o_v[:, None], mask=m_vk, other=0.0) * 1.4142135623730951
    b_hoa = _load_pairs_t(p_s, r_ija, r_jia, m_pa, o_v, m_v, W)
    b_hob = _load_pairs_t(p_s, r_ijb, r_jib, m_pb, o_v, m_v, W)
    b_z0 = tl.load(p_s + V + tl.zeros([1], dtype=tl.int32))
    b_z1 = tl.load(p_s + (1 + o_k) * W + V, mask=m_k, other=0.0)
    r_kk = 1 + K + o_k[:, None] * K + o_k[None, :]
    b_zz = tl.load(p_s + r_kk * W + V, mask=m_k[:, None] & m_k[None, :], other=0.0) * 1.4142135623730951
    return b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz


@triton.jit
def _add_chunk_t(b_h0, b_h1, b_hd, b_hoa, b_hob, b_vt, b_kw, b_kp, pair_scale, b_eia, b_eja, b_eib, b_ejb,
                 DOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
    """The numerator state (transposed, symmetric 2nd order) plus one chunk of keys: h0 += V^T 1, h1 += V^T K',
    hd += V^T K'**2, ho += V^T P(K'), for weighted values b_vt [BV, BT] and scaled keys b_kw = K' [BT, BK]. The
    pair features are gathered from b_kp times pair_scale**2: K' with 1, or the raw keys with the key scale (one
    rounding of each feature when the scale is not a power of two)."""
    return (
        b_h0 + tl.sum(b_vt, axis=1),
        b_h1 + _dot(b_vt, b_kw, DOT, EMULATE, PRECISION),
        b_hd + _dot(b_vt, b_kw * b_kw, DOT, EMULATE, PRECISION),
        b_hoa + _dot(b_vt, _pair_features(b_kp, b_eia, b_eja, pair_scale, DOT, EMULATE), DOT, EMULATE, PRECISION),
        b_hob + _dot(b_vt, _pair_features(b_kp, b_eib, b_ejb, pair_scale, DOT, EMULATE), DOT, EMULATE, PRECISION),
    )


@triton.jit
def _scale_state(b_h0, b_h1, b_hd, b_hoa, b_hob, factor):
    """The numerator state times a scalar (the Based decay over one chunk)."""
    return b_h0 * factor, b_h1 * factor, b_hd * factor, b_hoa * factor, b_hob * factor


@triton.jit
def _store_pairs_t(p_s, b_hot, r_ij, r_ji, m_p, o_v, m_v, W: tl.constexpr):
    """S_ij = S_ji = ho / sqrt(2) (b_hot = ho^T [BV, BH]): the symmetric state of the keys. An initial state's
    antisymmetric part is added by the launcher (`_add_antisymmetric_part`), so no pointer to it stays live here."""
    m_vp = m_v[:, None] & m_p[None, :]
    b_half = b_hot * 0.7071067811865476
    tl.store(p_s + r_ij[None, :] * W + o_v[:, None], b_half, mask=m_vp)
    tl.store(p_s + r_ji[None, :] * W + o_v[:, None], b_half, mask=m_vp)


@triton.jit
def _store_state_t(p_s, b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz, i_v, o_k, m_k, o_v, m_v, r_d, r_kk,
                   r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, V: tl.constexpr, W: tl.constexpr):
    """Write a transposed symmetric state (this program's value columns o_v) to the cache layout `(F, V + 1)` at
    p_s: the pair rows to (i, j) and (j, i), the 1/sqrt(2) of phi applied; the denominator column only by i_v = 0.
    The forward's final state and the backward's initial-state gradient."""
    SQRT2: tl.constexpr = 1.4142135623730951
    m_vk = m_v[:, None] & m_k[None, :]
    tl.store(p_s + o_v, b_h0, mask=m_v)
    tl.store(p_s + (1 + o_k[None, :]) * W + o_v[:, None], b_h1, mask=m_vk)
    tl.store(p_s + r_d[None, :] * W + o_v[:, None], b_hd / SQRT2, mask=m_vk)
    _store_pairs_t(p_s, b_hoa, r_ija, r_jia, m_pa, o_v, m_v, W)
    _store_pairs_t(p_s, b_hob, r_ijb, r_jib, m_pb, o_v, m_v, W)
    if i_v == 0:
        tl.store(p_s + V + tl.zeros([1], dtype=tl.int32), b_z0)
        tl.store(p_s + (1 + o_k) * W + V, b_z1, mask=m_k)
        tl.store(p_s + r_kk * W + V, b_zz / SQRT2, mask=m_k[:, None] & m_k[None, :])


def feature_blocks(K: int) -> tuple[int, int]:
    """(BK, BP) of the kernels: the feature dim padded to a power of two >= 16, and the pair rows padded to a power of
    two >= 32 (two halves of >= 16 rows: tl.dot)."""
    return max(16, triton.next_power_of_2(K)), max(32, triton.next_power_of_2(max(K * (K - 1) // 2, 1)))


# The state after the encoder that the training forward stores for the backward's dq scan, in the kernels' own form
# as the forward holds it: per value v < V a row [h0, h1 (BK), hd (BK), hoa (BP / 2), hob (BP / 2)], then z0, z1
# (BK), Z (BK x BK); hd, ho and Z without phi's 1/sqrt(2). Contiguous tiles, no pair written twice.


def encoder_state_numel(K: int, V: int) -> int:
    """Floats per (batch, head) of the encoder state (`_encoder_state_at`)."""
    BK, BP = feature_blocks(K)
    return V * (1 + 2 * BK + BP) + 1 + BK + BK * BK


@triton.jit
def _encoder_state_at(p, i_bh, V: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """The encoder state of program (batch x head) i_bh in the buffer at p: (its start, the row length R)."""
    R: tl.constexpr = 1 + 2 * BK + BP
    return p + i_bh.to(tl.int64) * (V * R + 1 + BK + BK * BK), R


@triton.jit
def _store_encoder_state(p, i_bh, b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz, i_v, o_k, o_v, m_v,
                         V: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """Store the forward's transposed state (this program's value rows o_v; z by i_v = 0 only)."""
    p_e, R = _encoder_state_at(p, i_bh, V, BK, BP)
    o_h = tl.arange(0, BP // 2)
    p_row = p_e + o_v[:, None] * R
    tl.store(p_e + o_v * R, b_h0, mask=m_v)
    tl.store(p_row + 1 + o_k[None, :], b_h1, mask=m_v[:, None])
    tl.store(p_row + 1 + BK + o_k[None, :], b_hd, mask=m_v[:, None])
    tl.store(p_row + 1 + 2 * BK + o_h[None, :], b_hoa, mask=m_v[:, None])
    tl.store(p_row + 1 + 2 * BK + BP // 2 + o_h[None, :], b_hob, mask=m_v[:, None])
    if i_v == 0:
        p_z = p_e + V * R
        tl.store(p_z + tl.zeros([1], dtype=tl.int32), b_z0)
        tl.store(p_z + 1 + o_k, b_z1)
        tl.store(p_z + 1 + BK + o_k[:, None] * BK + o_k[None, :], b_zz)


@triton.jit
def _load_encoder_state_f(p, i_bh, o_k, o_v, m_v, V: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """Load it feature-major (the dq scan's layout): (h0 [BV], h1 [BK, BV], hd [BK, BV], hoa [BH, BV], hob [BH, BV],
    z0 [1], z1 [BK], Z [BK, BK])."""
    p_e, R = _encoder_state_at(p, i_bh, V, BK, BP)
    o_h = tl.arange(0, BP // 2)
    p_col = p_e + o_v[None, :] * R  # value v's row, read as a column
    b_h0 = tl.load(p_e + o_v * R, mask=m_v, other=0.0)
    b_h1 = tl.load(p_col + 1 + o_k[:, None], mask=m_v[None, :], other=0.0)
    b_hd = tl.load(p_col + 1 + BK + o_k[:, None], mask=m_v[None, :], other=0.0)
    b_hoa = tl.load(p_col + 1 + 2 * BK + o_h[:, None], mask=m_v[None, :], other=0.0)
    b_hob = tl.load(p_col + 1 + 2 * BK + BP // 2 + o_h[:, None], mask=m_v[None, :], other=0.0)
    p_z = p_e + V * R
    b_z0 = tl.load(p_z + tl.zeros([1], dtype=tl.int32))
    b_z1 = tl.load(p_z + 1 + o_k)
    b_zz = tl.load(p_z + 1 + BK + o_k[:, None] * BK + o_k[None, :])
    return b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz


def _add_antisymmetric_part(state: torch.Tensor, source: torch.Tensor, log_decay: torch.Tensor | None, K: int, T: int,
                            *, denominator: bool = False) -> None:
    """Add to a kernel's (B, H, F, V + 1) result, in place, the antisymmetric part (S_ij - S_ji) / 2 of `source`'s
    2nd-order numerator rows, which the kernels (symmetric 2nd order) do not carry and nothing reads, times
    gamma**T with the Based decay; with `denominator`, also that of its denominator column (no decay there).

    The forward passes an initial state's part into the final state (its denominator column keeps it in the kernel,
    through Z); the backward passes dS's into the initial state's gradient (its reverse Rz is symmetric)."""
    B, H, _, W = state.shape
    columns = W if denominator else W - 1
    second = source[:, :, 1 + K :, :columns].view(B, H, K, K, columns)
    anti = 0.5 * (second - second.transpose(2, 3))
    if log_decay is not None:
        anti[..., : W - 1] *= torch.exp(log_decay.to(torch.float32) * T).view(1, H, 1, 1, 1)
    state[:, :, 1 + K :, :columns] += anti.reshape(B, H, K * K, columns)


def _key_rows(key_mask: torch.Tensor) -> torch.Tensor:
    """(B, 3) int32 `[is_range, lo, hi]` of a (B, T) bool key mask: is_range when row b's True entries are exactly
    the positions lo <= t < hi (padding on the left and/or right, no padding, or no key at all: lo = T, hi = 0).

    Computed on the device without a sync. The kernel then reads those rows' masks as two comparisons per token
    instead of loading them (docs/kernels.md: the mask loads cost registers and instructions in every chunk)."""
    T = key_mask.shape[1]
    positions = torch.arange(T, device=key_mask.device)
    lo = torch.where(key_mask, positions, T).amin(dim=1)
    hi = torch.where(key_mask, positions + 1, 0).amax(dim=1)
    is_range = key_mask.sum(dim=1) == (hi - lo).clamp(min=0)
    return torch.stack([is_range.to(torch.int32), lo.to(torch.int32), hi.to(torch.int32)], dim=1).contiguous()
