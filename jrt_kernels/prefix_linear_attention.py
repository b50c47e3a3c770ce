"""Fused Triton prefill of prefix linear attention (JRT-RNN) and causal Taylor linear attention (Based), with a
fused backward (autograd through `torch.library`) and the Based decay / gate.

The math, the argument checks and the reference (`prefix_linear_attention_chunked`) are in
`modeling_jrt.linear_attention` (docs/prefill.md §4); the design of these kernels (the encoder loop, the transposed
decoder scan, the key-mask launches, the sequence-parallel prefill) in docs/kernels.md. The dispatcher
`prefix_linear_attention(..., implementation="triton")` validates the arguments and calls
`prefix_linear_attention_triton`, which only asserts them. One program per (value block of BV columns, batch x head)
keeps its columns of the fp32 state on chip; x' = x / K**(1/4), phi(x) = [1, x', vec(x' x'^T) / sqrt(2)], the 2nd
order held symmetric (`_common`: K diagonal rows hd and K (K - 1) / 2 pair rows ho, in two halves).

Dims (fla naming): B batch, T decoder length, M encoder length, H heads, K feature dim, V value dim,
F = 1 + K + K**2 Taylor features; tiles BT (tokens), BK (feature dim, a power of two >= 16), BV (value columns per
program, a power of two), BP (pair rows, two halves of BP / 2).
"""

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRETED, _add_antisymmetric_part, _add_chunk_t, _dot, _dot_fp32, _key_range, _key_rows, _key_weights,
    _load_state_t, _pair_features_t, _pair_index, _scale_state, _store_encoder_state, _store_state_t, _tile,
    check_devices, dot_types, encoder_state_numel, feature_blocks,
)
from .prefix_linear_attention_backward import prefix_linear_attention_backward

# (BT, BV, num_warps) per GPU generation, from benchmarks/kernel_aot.py's builds (docs/kernels.md "Configurations and
# autotuning"): the first is the default (JRT_TRITON_AUTOTUNE=0), the others what the autotuner may pick. On sm_90
# BV = 64 builds without spills; elsewhere mma.sync holds both operands in registers and BV = 32 is the spill-free one.
_ARCH_CONFIGS = {"sm_90": [(32, 64, 4), (16, 64, 4), (32, 64, 8)], "other": [(16, 32, 4), (32, 32, 4), (16, 64, 4)]}


def _config(BT: int, BV: int, num_warps: int) -> triton.Config:
    return triton.Config({"BT": BT, "BV": BV}, num_warps=num_warps, num_stages=1)


def configs_for_architecture(major: int, V: int = 64) -> list[triton.Config]:
    """The autotune configs for a GPU of compute capability `major`.x and value dim V, the default first (BV is capped
    at V's power of two: a V = 16 head never takes a program of 64 columns)."""
    width = max(16, triton.next_power_of_2(V))
    table = _ARCH_CONFIGS["sm_90" if major == 9 else "other"]
    return [_config(*config) for config in dict.fromkeys((BT, min(BV, width), warps) for BT, BV, warps in table)]


# The interpreter (CPU tests): BT = 32 keeps the numpy cost per step low; BV = 32 splits the tests' wider values.
_INTERPRETER_CONFIGS = [_config(32, 32, 4)]


@triton.jit(do_not_specialize=["T", "T_BUCKET", "SEG", "NSEG"])
def _prefix_linear_attention_fwd_kernel(
    q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, key_rows, state_in, log_decay, gate, o, state_out,
    encoder_state_out, rden_out,
    s_qb, s_qt, s_qh, s_qk,
    s_kb, s_kt, s_kh, s_kk,
    s_vb, s_vt, s_vh, s_vv,
    s_keb, s_ket, s_keh, s_kek,
    s_veb, s_vet, s_veh, s_vev,
    s_mb, s_mt,
    s_ob, s_ot, s_oh, s_ov,
    T, T_BUCKET, SEG, NSEG, eps, key_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    MASK: tl.constexpr, STRICT: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr, SAVE_FOR_BACKWARD: tl.constexpr,
    SAVE_ENCODER_STATE: tl.constexpr, SEGMENTED: tl.constexpr,
    DOT: tl.constexpr, SDOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    # SEGMENTED: program i_s scans the tokens [i_s SEG, (i_s + 1) SEG) from the state before them (state_in
    # (B, NSEG, H, F, V + 1), encoder included); the last segment writes the final state. Else SEG >= T, NSEG = 1.
    if SEGMENTED:
        i_s = tl.program_id(2).to(tl.int64)
        t_lo = i_s * SEG
        t_hi = tl.minimum(t_lo + SEG, T)
    else:  # the one-pass build keeps no segment values live
        t_lo = 0
        t_hi = T
    # MASK = 1: the rows whose key mask is one range [lo, hi); MASK = 2: the others (`_key_range`).
    b_skip, b_key_lo, b_key_hi = _key_range(key_rows, i_b, MASK)
    if b_skip:
        return
    F: tl.constexpr = 1 + K + K * K
    W: tl.constexpr = V + 1  # state row length: V numerator columns and the denominator column

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # The symmetric 2nd order (`_common`): K diagonal rows r_d and the pairs, in two halves a, b of BH = BP / 2 rows
    # (each product's (BT, BH) feature operand half as large lowers the peak register use).
    r_d = 1 + K + o_k * (K + 1)
    BH: tl.constexpr = BP // 2
    m_pa, r_ija, r_jia, b_eia, b_eja, b_eiat, b_ejat = _pair_index(tl.arange(0, BH), o_k, K)
    m_pb, r_ijb, r_jib, b_eib, b_ejb, b_eibt, b_ejbt = _pair_index(BH + tl.arange(0, BH), o_k, K)
    r_kk = 1 + K + o_k[:, None] * K + o_k[None, :]
    p_m = key_mask + i_b * s_mb

    # The numerator state, fp32, transposed ([BV, features]): the read `num^T = h^T @ phi(Q)^T` takes it as the A
    # operand straight from its registers (as flash attention's P @ V) instead of staging a copy in shared memory
    # every chunk (docs/kernels.md "Registers"). hd, ho and Z carry no 1/sqrt(2) of phi (applied on read and write).
    b_h0 = tl.zeros([BV], dtype=tl.float32)
    b_h1 = tl.zeros([BV, BK], dtype=tl.float32)
    b_hd = tl.zeros([BV, BK], dtype=tl.float32)
    b_hoa = tl.zeros([BV, BH], dtype=tl.float32)
    b_hob = tl.zeros([BV, BH], dtype=tl.float32)
    b_z0 = tl.zeros([1], dtype=tl.float32)
    b_z1 = tl.zeros([BK], dtype=tl.float32)
    b_zz = tl.zeros([BK, BK], dtype=tl.float32)
    p_state = i_bh.to(tl.int64) * F * W
    if HAS_INITIAL_STATE:
        p_state_in = p_state
        if SEGMENTED:
            p_state_in = ((i_b * NSEG + i_s) * H + i_h) * F * W
        b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz = _load_state_t(
            state_in + p_state_in, o_k, m_k, o_v, m_v, r_d, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, K, V, W
        )

    # 1. Encoder reduction over the row's range [start, end) of the first M tokens: state updates only, no queries,
    #    no causal mask. Chunks are aligned on BT; positions outside the range weigh 0.
    b_start = tl.load(encoder_start + i_b)
    b_end = tl.load(encoder_end + i_b)
    p_ke = k_enc + i_b * s_keb + i_h * s_keh
    p_ve = v_enc + i_b * s_veb + i_h * s_veh
    o_c = tl.arange(0, BT)
    encoder_stop = tl.cdiv(b_end, BT)
    if SEGMENTED:  # a segment's state_in holds the encoder already (`_segment_states_kernel` reduced it)
        encoder_stop = b_start // BT
    for i_t in range(b_start // BT, encoder_stop):
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_t = o_t < b_end
        b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, b_start, b_end, b_key_lo, b_key_hi, MASK, STRICT, True)
        # [BT, BK] weighted keys (w is 0 or 1), [BV, BT] values
        b_k = tl.where(b_raw[:, None] & b_w[:, None], _tile(p_ke, o_t, m_t, s_ket, o_k, m_k, s_kek) * key_scale, 0.0)
        b_vt = tl.where(b_w[None, :], _tile(p_ve, o_v, m_v, s_vev, o_t, m_t, s_vet), 0.0)
        b_h0, b_h1, b_hd, b_hoa, b_hob = _add_chunk_t(
            b_h0, b_h1, b_hd, b_hoa, b_hob, b_vt, b_k, b_k, 1.0, b_eia, b_eja, b_eib, b_ejb,
            DOT, EMULATE, PRECISION,
        )
        b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
        b_z1 += tl.sum(b_k, axis=0)
        b_zz += _dot_fp32(tl.trans(b_k), b_k)  # [BK, BK]
    if SAVE_ENCODER_STATE:  # the state the decoder starts from, for the backward's dq scan
        _store_encoder_state(encoder_state_out, i_bh, b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz, i_v, o_k,
                             o_v, m_v, V, BK, BP)

    # 2. Causal chunk scan over the T decoder tokens, starting from the encoder state. Outputs are computed
    #    transposed, [BV, BT] (queries along the columns).
    p_q = q + i_b * s_qb + i_h * s_qh
    p_k = k + i_b * s_kb + i_h * s_kh
    p_v = v + i_b * s_vb + i_h * s_vh
    p_o = o + i_b * s_ob + i_h * s_oh
    p_g = gate + (i_b * T * H + i_h)
    p_rden = rden_out + (i_b * T * H + i_h)
    b_lg = tl.load(log_decay + i_h).to(tl.float32) if HAS_DECAY else 0.0
    for i_t in range(t_lo // BT, tl.cdiv(t_hi, BT)):  # SEG is a multiple of BT: chunks never straddle segments
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_t = o_t < t_hi
        b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, b_start, b_end, b_key_lo, b_key_hi, MASK, STRICT, False)
        # [BK, BT] queries, [BT, BK] keys, [BV, BT] values
        b_qt = _tile(p_q, o_k, m_k, s_qk, o_t, m_t, s_qt) * key_scale
        b_k = tl.where(b_raw[:, None], _tile(p_k, o_t, m_t, s_kt, o_k, m_k, s_kk) * key_scale, 0.0)
        b_vt = tl.where(b_w[None, :], _tile(p_v, o_v, m_v, s_vv, o_t, m_t, s_vt), 0.0)

        # inter-chunk: the state of everything before the chunk, encoder included. [BV, BT], [BT]
        b_num = b_h0[:, None] + _dot(b_h1, b_qt, SDOT, EMULATE, PRECISION)
        # the 1/2 on the [BK, BT] operand (exact) rather than the [BV, BT] product
        b_num += _dot(b_hd, 0.5 * (b_qt * b_qt), SDOT, EMULATE, PRECISION)
        b_num += _dot(b_hoa, _pair_features_t(b_qt, b_eiat, b_ejat, 1.0, DOT, EMULATE), SDOT, EMULATE, PRECISION)
        b_num += _dot(b_hob, _pair_features_t(b_qt, b_eibt, b_ejbt, 1.0, DOT, EMULATE), SDOT, EMULATE, PRECISION)
        b_den = tl.sum(b_z0) + tl.sum(b_qt * (b_z1[:, None] + 0.5 * _dot_fp32(b_zz, b_qt)), axis=0)  # Z = Z^T
        # intra-chunk: 1 + s + s^2 / 2 on the causal part, counted keys only; transposed, [BT keys, BT queries]
        b_s = _dot(b_k, b_qt, DOT, EMULATE, PRECISION)
        b_a = tl.where((o_c[None, :] >= o_c[:, None]) & b_w[:, None], 1.0 + b_s + 0.5 * b_s * b_s, 0.0)
        b_den += tl.sum(b_a, axis=0)
        if HAS_DECAY:
            b_num = b_num * tl.exp(b_lg * (o_c + 1).to(tl.float32))[None, :]  # the state is gamma**(p + 1) old
            b_gap = tl.exp(b_lg * tl.maximum(o_c[None, :] - o_c[:, None], 0).to(tl.float32))  # gamma**(i - j)
            b_num += _dot(b_vt, b_a * b_gap, DOT, EMULATE, PRECISION)
        else:
            b_num += _dot(b_vt, b_a, DOT, EMULATE, PRECISION)
        if HAS_GATE:
            b_num = b_num * tl.load(p_g + o_t * H, mask=m_t, other=0.0).to(tl.float32)[None, :]
        # fp32 division; a row without any counted key gives 0 / (0 + eps) = 0.
        p_y = p_o + o_t[None, :] * s_ot + o_v[:, None] * s_ov
        tl.store(p_y, (b_num / (b_den[None, :] + eps)).to(o.dtype.element_ty), mask=m_v[:, None] & m_t[None, :])
        if SAVE_FOR_BACKWARD:  # 1 / (den + eps) per query, which the backward's dq scan then reads
            if i_v == 0:
                tl.store(p_rden + o_t * H, 1.0 / (b_den + eps), mask=m_t)

        # state update with the chunk's counted keys; decayed: gamma**L old + gamma**(L - 1 - p) new
        b_kw = tl.where(b_w[:, None], b_k, 0.0)
        b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
        b_z1 += tl.sum(b_kw, axis=0)
        b_zz += _dot_fp32(tl.trans(b_kw), b_kw)
        if HAS_DECAY:
            b_len = tl.minimum(t_hi - i_t * BT, BT).to(tl.float32)
            b_vt = b_vt * tl.exp(b_lg * (b_len - 1.0 - o_c.to(tl.float32)))[None, :]
            b_h0, b_h1, b_hd, b_hoa, b_hob = _scale_state(b_h0, b_h1, b_hd, b_hoa, b_hob, tl.exp(b_lg * b_len))
        b_h0, b_h1, b_hd, b_hoa, b_hob = _add_chunk_t(
            b_h0, b_h1, b_hd, b_hoa, b_hob, b_vt, b_kw, b_kw, 1.0, b_eia, b_eja, b_eib, b_ejb,
            DOT, EMULATE, PRECISION,
        )

    # 3. Final state in the cache layout (B, H, F, V + 1), from the last segment.
    if (not SEGMENTED) or (tl.program_id(2) == NSEG - 1):
        _store_state_t(state_out + p_state, b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz, i_v, o_k, m_k, o_v,
                       m_v, r_d, r_kk, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, V, W)


@triton.jit(do_not_specialize=["T", "T_BUCKET", "SEG", "NSEG"])
def _segment_states_kernel(
    k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, key_rows, log_decay, state_out,
    s_kb, s_kt, s_kh, s_kk,
    s_vb, s_vt, s_vh, s_vv,
    s_keb, s_ket, s_keh, s_kek,
    s_veb, s_vet, s_veh, s_vev,
    s_mb, s_mt,
    T, T_BUCKET, SEG, NSEG, key_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    MASK: tl.constexpr, STRICT: tl.constexpr, HAS_DECAY: tl.constexpr,
    DOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """The first pass of the sequence-parallel prefill: the state of one segment's keys alone, no queries.

    Program (i_v, b * H + h, i_s) reduces, from a zero state, the decoder keys [i_s SEG, (i_s + 1) SEG) for
    i_s < NSEG (decayed to the segment's end with the Based decay: gamma**(end - 1 - t)), or for i_s >= NSEG the
    encoder keys of the row's range [start, end) that fall in [(i_s - NSEG) SEG, (i_s - NSEG + 1) SEG), and writes
    it to state_out `(B, NSEG + NENC, H, F, V + 1)` in the cache layout, with the one-pass kernel's key weights.

    The loop bodies repeat the forward kernel's state updates line for line on purpose: moved into shared
    `@triton.jit` helpers they made the forward's sm_90 build spill. A change to one must be made in both; the
    segment tests compare the two kernels."""
    i_v, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    b_skip, b_key_lo, b_key_hi = _key_range(key_rows, i_b, MASK)
    if b_skip:
        return
    F: tl.constexpr = 1 + K + K * K
    W: tl.constexpr = V + 1
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    r_d = 1 + K + o_k * (K + 1)
    BH: tl.constexpr = BP // 2
    m_pa, r_ija, r_jia, b_eia, b_eja, b_eiat, b_ejat = _pair_index(tl.arange(0, BH), o_k, K)
    m_pb, r_ijb, r_jib, b_eib, b_ejb, b_eibt, b_ejbt = _pair_index(BH + tl.arange(0, BH), o_k, K)
    r_kk = 1 + K + o_k[:, None] * K + o_k[None, :]
    p_m = key_mask + i_b * s_mb
    b_h0 = tl.zeros([BV], dtype=tl.float32)
    b_h1 = tl.zeros([BV, BK], dtype=tl.float32)
    b_hd = tl.zeros([BV, BK], dtype=tl.float32)
    b_hoa = tl.zeros([BV, BH], dtype=tl.float32)
    b_hob = tl.zeros([BV, BH], dtype=tl.float32)
    b_z0 = tl.zeros([1], dtype=tl.float32)
    b_z1 = tl.zeros([BK], dtype=tl.float32)
    b_zz = tl.zeros([BK, BK], dtype=tl.float32)
    b_start = tl.load(encoder_start + i_b)
    b_end = tl.load(encoder_end + i_b)
    o_c = tl.arange(0, BT)
    if i_s < NSEG:  # decoder keys of segment i_s
        t_lo = i_s * SEG
        t_hi = tl.minimum(t_lo + SEG, T)
        p_k = k + i_b * s_kb + i_h * s_kh
        p_v = v + i_b * s_vb + i_h * s_vh
        b_lg = tl.load(log_decay + i_h).to(tl.float32) if HAS_DECAY else 0.0
        for i_t in range(t_lo // BT, tl.cdiv(t_hi, BT)):
            o_t = (i_t * BT + o_c).to(tl.int64)
            m_t = o_t < t_hi
            b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, b_start, b_end, b_key_lo, b_key_hi, MASK, STRICT, False)
            b_kw = tl.where(b_raw[:, None] & b_w[:, None], _tile(p_k, o_t, m_t, s_kt, o_k, m_k, s_kk) * key_scale, 0.0)
            b_vt = tl.where(b_w[None, :], _tile(p_v, o_v, m_v, s_vv, o_t, m_t, s_vt), 0.0)
            b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
            b_z1 += tl.sum(b_kw, axis=0)
            b_zz += _dot_fp32(tl.trans(b_kw), b_kw)
            if HAS_DECAY:
                b_len = tl.minimum(t_hi - i_t * BT, BT).to(tl.float32)
                b_vt = b_vt * tl.exp(b_lg * (b_len - 1.0 - o_c.to(tl.float32)))[None, :]
                b_h0, b_h1, b_hd, b_hoa, b_hob = _scale_state(b_h0, b_h1, b_hd, b_hoa, b_hob, tl.exp(b_lg * b_len))
            b_h0, b_h1, b_hd, b_hoa, b_hob = _add_chunk_t(
                b_h0, b_h1, b_hd, b_hoa, b_hob, b_vt, b_kw, b_kw, 1.0, b_eia, b_eja, b_eib, b_ejb,
                DOT, EMULATE, PRECISION,
            )
    else:  # encoder keys of the row's range in segment i_s - NSEG
        e_lo = tl.maximum(b_start, (i_s - NSEG) * SEG)
        e_hi = tl.minimum(b_end, (i_s - NSEG + 1) * SEG)
        p_ke = k_enc + i_b * s_keb + i_h * s_keh
        p_ve = v_enc + i_b * s_veb + i_h * s_veh
        for i_t in range(e_lo // BT, tl.cdiv(tl.maximum(e_hi, e_lo), BT)):
            o_t = (i_t * BT + o_c).to(tl.int64)
            m_t = (o_t >= e_lo) & (o_t < e_hi)  # none when the range misses this segment
            b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, b_start, b_end, b_key_lo, b_key_hi, MASK, STRICT, True)
            b_k = tl.where(b_raw[:, None] & b_w[:, None], _tile(p_ke, o_t, m_t, s_ket, o_k, m_k, s_kek) * key_scale,
                           0.0)
            b_vt = tl.where(b_w[None, :], _tile(p_ve, o_v, m_v, s_vev, o_t, m_t, s_vet), 0.0)
            b_h0, b_h1, b_hd, b_hoa, b_hob = _add_chunk_t(
                b_h0, b_h1, b_hd, b_hoa, b_hob, b_vt, b_k, b_k, 1.0, b_eia, b_eja, b_eib, b_ejb,
                DOT, EMULATE, PRECISION,
            )
            b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
            b_z1 += tl.sum(b_k, axis=0)
            b_zz += _dot_fp32(tl.trans(b_k), b_k)
    p_state = ((i_b * tl.num_programs(2) + i_s) * H + i_h) * F * W
    _store_state_t(state_out + p_state, b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz, i_v, o_k, m_k, o_v, m_v,
                   r_d, r_kk, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, V, W)


# JRT_TRITON_AUTOTUNE=0 launches the architecture's default config, untuned.
AUTOTUNE = os.environ.get("JRT_TRITON_AUTOTUNE", "1") != "0"
# Each pick goes to triton's cache where triton can (3.2 and later), so a tuning run ahead of time leaves none to do.
_CACHE_TUNING = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


@functools.cache
def _autotuned_kernel(major: int, width: int, kernel=_prefix_linear_attention_fwd_kernel):
    """`kernel` (the prefill, or the segment states of the sequence-parallel prefill) autotuned over the configs of
    architecture family `major` (9: sm_90, 8: any other GPU, 0: the CPU interpreter) for value dims of power of two
    `width`."""
    configs = _INTERPRETER_CONFIGS if major == 0 else configs_for_architecture(major, width)
    return triton.autotune(configs=configs if AUTOTUNE else configs[:1], key=["K", "V", "T_BUCKET", "MASK"],
                           **_CACHE_TUNING)(kernel)


def _kernel_for(device: torch.device, V: int, kernel=_prefix_linear_attention_fwd_kernel):
    """The launching device's autotuned `kernel` (a non-CUDA device only in benchmarks/kernel_aot.py's CPU
    capture)."""
    if INTERPRETED:
        major = 0
    else:
        major = 9 if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 else 8
    return _autotuned_kernel(major, max(16, triton.next_power_of_2(V)), kernel)


# The sequence-parallel prefill (`auto_segment_length`): segments are multiples of SEGMENT_ALIGN tokens (of every BT);
# below SEGMENTED_FROM tokens its three launches cost more than the scan they split (docs/performance.md).
SEGMENT_ALIGN = 64
MIN_SEGMENT = 512
SEGMENTED_FROM = 8192


@torch.compiler.assume_constant_result  # a traced call (torch.compile) takes the value, not the query
@functools.cache
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_segment_length(B: int, H: int, T: int, device: torch.device) -> int:
    """Tokens per segment of the sequence-parallel prefill for B rows of H heads and T tokens on `device`, or 0 for
    the one-pass kernel (always off CUDA): when B * H programs are fewer than the SMs and T >= SEGMENTED_FROM,
    segments of at least MIN_SEGMENT tokens, enough of them for about two programs per SM."""
    if device.type != "cuda" or INTERPRETED or T < SEGMENTED_FROM:
        return 0
    processors = _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
    if B * H >= processors:
        return 0
    segments = min(triton.cdiv(2 * processors, B * H), T // MIN_SEGMENT)
    return 0 if segments < 2 else triton.cdiv(triton.cdiv(T, segments), SEGMENT_ALIGN) * SEGMENT_ALIGN


def _states_before_segments(parts: torch.Tensor, segments: int, initial_state: torch.Tensor | None,
                            log_decay: torch.Tensor | None, segment_length: int) -> torch.Tensor:
    """The state each segment starts from, `(B, NSEG, H, F, V + 1)` fp32, from `_segment_states_kernel`'s `parts`
    `(B, NSEG + NENC, H, F, V + 1)` (each decoder segment's keys alone, then the encoder's keys by segment):

        before[s] = initial_state + sum of the encoder parts + sum_{s' < s} part[s']                  (no decay)
        before[s] = g**s initial + sum_{s' < s} g**(s - 1 - s') part[s'],  g = gamma**segment_length  (Based decay,
                                                   numerator columns; the denominator column never decays)
    """
    local = parts[:, :segments]
    base = parts[:, segments:].sum(dim=1)  # (B, H, F, V + 1): the encoder (zeros without one)
    if initial_state is not None:
        base = base + initial_state
    earlier = torch.zeros_like(local)
    if log_decay is None:
        torch.cumsum(local[:, :-1], dim=1, out=earlier[:, 1:])
        return earlier.add_(base[:, None])
    V = parts.shape[-1] - 1
    steps = torch.arange(segments, device=parts.device, dtype=torch.float32)
    lag = steps[:, None] - 1.0 - steps[None, :]  # (NSEG, NSEG): s - 1 - s'
    log_step = log_decay.to(torch.float32) * segment_length  # (H,)
    weights = torch.where(lag >= 0, torch.exp(log_step[:, None, None] * lag.clamp(min=0)), 0.0)  # (H, NSEG, NSEG)
    earlier[..., :V] = torch.einsum("hst,bthfv->bshfv", weights, local[..., :V])
    torch.cumsum(local[:, :-1, ..., V:], dim=1, out=earlier[:, 1:, ..., V:])
    initial_age = torch.exp(log_step[:, None] * steps[None, :]).t()  # (NSEG, H): g**s
    earlier[..., :V] += initial_age[None, :, :, None, None] * base[:, None, ..., :V]
    earlier[..., V:] += base[:, None, ..., V:]
    return earlier


PAD_MASKINGS = ("strict", "reference")  # as in modeling_jrt.linear_attention (this module imports no modeling_jrt)


@torch.library.triton_op("jrt_kernels::prefix_linear_attention_fwd", mutates_args=())
def _prefix_linear_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_enc: torch.Tensor | None, v_enc: torch.Tensor | None,
    encoder_start: torch.Tensor, encoder_end: torch.Tensor, key_mask: torch.Tensor | None,
    initial_state: torch.Tensor | None, log_decay: torch.Tensor | None, gate: torch.Tensor | None, strict: bool,
    eps: float, save_for_backward: bool, segment_length: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the kernel on validated inputs (any strides). Returns `(o (B, T, H, V) in v.dtype, state fp32,
    encoder state, inverse denominator)`: the last two are `prefix_linear_attention_triton`'s saved tensors
    (`BACKWARD_INPUTS`) with `save_for_backward`, else empty. `segment_length` > 0 (not with `save_for_backward`)
    runs the sequence-parallel prefill (three launches) when it cuts T in two or more."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    segments = triton.cdiv(T, segment_length) if segment_length > 0 and not save_for_backward else 1
    encoder_length = 0 if k_enc is None else k_enc.shape[1]
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    state = torch.empty(B, H, 1 + K + K * K, V + 1, dtype=torch.float32, device=v.device)
    store_encoder_state = save_for_backward and k_enc is not None
    encoder_state = state.new_empty(B, H, encoder_state_numel(K, V)) if store_encoder_state else state.new_empty(0)
    inverse_denominator = state.new_empty(B, T, H) if save_for_backward else state.new_empty(0)
    # Absent optional tensors: never read (empty encoder ranges, HAS_* flags False); any pointer will do.
    k_enc = k if k_enc is None else k_enc
    v_enc = v if v_enc is None else v_enc
    mask = q if key_mask is None else key_mask.view(torch.uint8)
    initial_state = None if initial_state is None else initial_state.contiguous()  # small: 70 KB per (b, h)
    mask_strides = (0, 0) if key_mask is None else mask.stride()
    decay = state if log_decay is None else log_decay.to(torch.float32).contiguous()
    gate_in = state if gate is None else gate.contiguous()  # (B, T, H)
    BK, BP = feature_blocks(K)

    def grid(programs: int):
        """The launch grid of value blocks x (batch x head) x `programs`."""
        return lambda meta: (triton.cdiv(V, meta["BV"]), B * H, programs)

    key_rows = state if key_mask is None else _key_rows(key_mask)
    mask_kinds = (0,) if key_mask is None else (1, 2)
    state_in = initial_state
    seg_len, seg_bucket = max(T, 1), triton.next_power_of_2(max(T, 1))
    if segments > 1:
        seg_len, seg_bucket = segment_length, triton.next_power_of_2(segment_length)
        encoder_segments = triton.cdiv(encoder_length, segment_length)
        parts = torch.empty(B, segments + encoder_segments, H, *state.shape[2:], dtype=torch.float32, device=v.device)
        parts_grid = grid(segments + encoder_segments)
        for mask_kind in mask_kinds:
            torch.library.wrap_triton(_kernel_for(q.device, V, _segment_states_kernel))[parts_grid](
                k, v, k_enc, v_enc, encoder_start, encoder_end, mask, key_rows, decay, parts,
                *k.stride(), *v.stride(), *k_enc.stride(), *v_enc.stride(), *mask_strides,
                T, seg_bucket, seg_len, segments, K**-0.25,
                H=H, K=K, V=V, BK=BK, BP=BP, MASK=mask_kind, STRICT=strict, HAS_DECAY=log_decay is not None,
                **{name: value for name, value in dot_types(v.dtype, INTERPRETED).items() if name != "SDOT"},
            )
        state_in = _states_before_segments(parts, segments, initial_state, log_decay, segment_length)

    # A key mask takes two launches, the range rows and the other rows (each skips the other's programs at once).
    for mask_kind in mask_kinds:
        torch.library.wrap_triton(_kernel_for(q.device, V))[grid(segments)](
            q, k, v, k_enc, v_enc, encoder_start, encoder_end, mask, key_rows,
            state if state_in is None else state_in, decay, gate_in, o, state,
            encoder_state if store_encoder_state else state, inverse_denominator if save_for_backward else state,
            *q.stride(), *k.stride(), *v.stride(), *k_enc.stride(), *v_enc.stride(), *mask_strides, *o.stride(),
            T, seg_bucket, seg_len, segments, eps, K**-0.25,
            H=H, K=K, V=V, BK=BK, BP=BP,
            MASK=mask_kind, STRICT=strict, HAS_INITIAL_STATE=state_in is not None,
            HAS_DECAY=log_decay is not None, HAS_GATE=gate is not None, SAVE_FOR_BACKWARD=save_for_backward,
            SAVE_ENCODER_STATE=store_encoder_state, SEGMENTED=segments > 1, **dot_types(v.dtype, INTERPRETED),
        )
    if initial_state is not None:
        _add_antisymmetric_part(state, initial_state, log_decay, K, T)
    return o, state, encoder_state, inverse_denominator


# The op's 3rd and 4th outputs, by the keyword of `prefix_linear_attention_backward` that takes each.
BACKWARD_INPUTS = ("encoder_state", "inverse_denominator")


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    # the op's tensor inputs (q to gate), the output y (the dq scan takes dy . y from it) and the saved tensors
    # (`BACKWARD_INPUTS`)
    ctx.save_for_backward(*inputs[:11], output[0], *output[2:])
    ctx.mark_non_differentiable(*output[2:])
    ctx.strict, ctx.eps = inputs[11:13]


def _backward(ctx, grad_output: torch.Tensor | None, grad_state: torch.Tensor | None, *_grad_saved) -> tuple:
    """The fused backward (`prefix_linear_attention_backward`): gradients of q, k, v, k_enc, v_enc, initial_state
    and gate; none for the encoder range, the key mask, the (fixed) decay and the flags."""
    q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, initial_state, log_decay, gate, o, *saved = (
        ctx.saved_tensors
    )
    if grad_output is None:
        grad_output = torch.zeros_like(v)
    dq, dk, dv, dk_enc, dv_enc, dinitial, dgate = prefix_linear_attention_backward(
        q, k, v, k_enc, v_enc, grad_output, grad_state, encoder_start=encoder_start, encoder_end=encoder_end,
        key_mask=key_mask, strict=ctx.strict, initial_state=initial_state, log_decay=log_decay, gate=gate,
        eps=ctx.eps, output=o, **{name: t for name, t in zip(BACKWARD_INPUTS, saved) if t.numel()},
    )
    return dq, dk, dv, dk_enc, dv_enc, None, None, None, dinitial, None, dgate, None, None, None, None


torch.library.register_autograd("jrt_kernels::prefix_linear_attention_fwd", _backward, setup_context=_setup_context)


def prefix_linear_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_enc: torch.Tensor | None = None,
    v_enc: torch.Tensor | None = None,
    *,
    encoder_start: torch.Tensor | None = None,
    encoder_end: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    pad_masking: str = "strict",
    initial_state: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-12,
    return_saved: bool = False,
    segment_length: int | None = None,
) -> tuple[torch.Tensor, ...] | tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Fused prefill of prefix linear attention (JRT-RNN) or, with `k_enc = v_enc = None`, causal Based attention.

    The keyword signature and results of its reference, `prefix_linear_attention_chunked`, differentiable (a fused
    backward registered with `torch.library.register_autograd`). Call it through `prefix_linear_attention(...,
    implementation="triton")`, which validates the arguments; this function only asserts them. Inputs may be any
    strided views (e.g. heads split from a fused projection).

    Args:
        q, k: `(B, T, H, K)` decoder queries and keys (fp32, bf16 or fp16, one dtype for every input).
        v: `(B, T, H, V)` decoder values; V need not be a power of two.
        k_enc, v_enc: `(B, M, H, K)` / `(B, M, H, V)` encoder keys and values of the first M <= T tokens, or None.
        encoder_start, encoder_end: `(B,)` int64, row b's encoder range `[start, end)` within `[0, M]`; None =
            `[0, M)` for every row.
        key_mask: `(B, T)` bool, True for real tokens.
        pad_masking: `"strict"` (a pad contributes nothing) or `"reference"` (a pad inside the encoder range keeps
            its constant term).
        initial_state: `(B, H, F, V + 1)` fp32 state of earlier tokens, or None.
        log_decay: `(H,)` log gamma of the Based fixed decay (no gradient), or None; not with an encoder.
        gate: `(B, T, H)` Based numerator gate, or None.
        eps: added to the fp32 denominator.
        return_saved: also return what the fused backward reads instead of recomputing (see Returns).
        segment_length: inference only (no gradient, no `return_saved`): scan segments of this many tokens (a
            positive multiple of 64) in parallel, each from the state before it (the sequence-parallel prefill,
            docs/kernels.md). None: `auto_segment_length` on CUDA, one pass elsewhere and under `torch.compile`; 0:
            one pass.

    Returns:
        `(output (B, T, H, V) in v's dtype, final state (B, H, F, V + 1) fp32)`, and with `return_saved` a third
        entry: a dict of keyword arguments for `prefix_linear_attention_backward` (not differentiable) that its dq
        scan reads instead of recomputing: `"inverse_denominator"`, `1 / (den + eps)` per query `(B, T, H)` fp32,
        and with an encoder `"encoder_state"`, the state after the encoder keys (initial state included) in the
        kernels' own form `(B, H, encoder_state_numel(K, V))` fp32. Under autograd the op keeps them itself.

    Raises:
        ValueError: what the kernel does not support (dtype, device) with the way out.
    """
    B, T, H, K = q.shape
    M = 0 if k_enc is None else k_enc.shape[1]
    assert pad_masking in PAD_MASKINGS and k.shape == q.shape and v.shape[:3] == q.shape[:3] and M <= T
    assert key_mask is None or (key_mask.dtype == torch.bool and key_mask.shape == (B, T))
    assert k_enc is None or (log_decay is None and gate is None), "the Based decay has no encoder"
    assert log_decay is None or log_decay.shape == (H,)
    assert gate is None or gate.shape == (B, T, H)
    if encoder_start is None or k_enc is None:
        encoder_start = torch.zeros(B, dtype=torch.long, device=q.device)
    if encoder_end is None or k_enc is None:
        encoder_end = torch.full((B,), M, dtype=torch.long, device=q.device)
    assert encoder_start.shape == encoder_end.shape == (B,) and encoder_start.dtype == encoder_end.dtype == torch.long
    inputs = [t for t in (q, k, v, k_enc, v_enc) if t is not None]
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in inputs):
        raise ValueError("The Triton prefill kernel takes fp32, bf16 or fp16 inputs of one dtype; got "
                         f"{sorted({str(t.dtype) for t in inputs})}. Cast them, or use implementation='chunked' (fp64 "
                         "works there).")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"The Triton prefill kernel keeps its state in fp32; got an {initial_state.dtype} "
                         "initial_state.")
    tensors = [t for t in (*inputs, key_mask, initial_state, encoder_start, encoder_end, log_decay, gate)
               if t is not None]
    check_devices("prefill", tensors, INTERPRETED, "use implementation='chunked'")
    differentiated = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                     for t in (q, k, v, k_enc, v_enc, initial_state, gate))
    save_for_backward = return_saved or differentiated
    compiling = torch.compiler.is_compiling()
    if segment_length is None:  # torch.compile traces the one pass (the segmented launches failed to trace on an H200)
        segment_length = 0 if save_for_backward or compiling else auto_segment_length(B, H, T, q.device)
    elif segment_length and compiling:
        raise ValueError("segment_length: the sequence-parallel prefill runs eagerly only (torch.compile does not "
                         "trace its three launches yet); pass segment_length=None or 0 inside a compiled function.")
    elif segment_length < 0 or segment_length % SEGMENT_ALIGN:
        raise ValueError(f"segment_length must be 0 (one pass) or a positive multiple of {SEGMENT_ALIGN} tokens; got "
                         f"{segment_length}.")
    elif segment_length and save_for_backward:
        raise ValueError(
            "segment_length: the sequence-parallel prefill is for inference (its segments' states are not kept for "
            "a backward); call it under torch.no_grad() without return_saved, or pass segment_length=None."
        )
    output, state, *saved = _prefix_linear_attention_fwd(
        q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, initial_state, log_decay, gate,
        pad_masking == "strict", float(eps), save_for_backward, segment_length,
    )
    if not return_saved:
        return output, state
    return output, state, {name: t for name, t in zip(BACKWARD_INPUTS, saved) if t.numel()}


__all__ = ["auto_segment_length", "prefix_linear_attention_triton"]
