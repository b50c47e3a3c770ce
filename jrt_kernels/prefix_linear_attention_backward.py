"""Fused Triton backward of prefix linear attention (JRT-RNN) and causal Taylor linear attention (Based).

Forward (see `prefix_linear_attention.py`): with x' = x / K**(1/4), phi(q).phi(k) = 1 + q'.k' + (q'.k')**2 / 2 and

    o_i = [num_i, den_i] = phi(q_i) . S_0 + sum_{keys j of query i} w_j (1 + s_ij + s_ij**2 / 2) [v_j, 1]
    y_i = num_i / (den_i + eps),        final state S_T = S_0 + sum_{all keys j} w_j phi(k_j) [v_j, 1]

where the keys of query i are the encoder keys of its row and the decoder keys j <= i, and w_j is the key's weight
(0 for a removed pad). Given dy and dS (the gradient of S_T), the output's gradient with respect to [num_i, den_i]
is G_i = [g_i, c_i] = [dy_i, -dy_i . y_i] / (den_i + eps). Two scans, one program per batch x head each, whose
formulas, layouts and per-architecture forms docs/kernels.md ("The backward") gives: the dq kernel (forward in time)
rebuilds the forward state S feature-major, or starts from the training forward's saved state after the encoder, and
stores 1 / (den + eps) and c for the second; the dkv kernel (backward in time) carries the reverse state
R = dS + sum phi(q_i) G_i^T over the later queries in the forward's layout, stores dS_0 = R after the decoder chunks
(the launcher adds dS's antisymmetric 2nd-order part), and last reads the encoder keys, which see every query.

Both pair scatters take u x as SDOT operands (the 0/1 selections are exact: one rounding). In the dq scan the
numerator and denominator terms cancel (G_i . [v_j, 1] = dy_i . (v_j - y_i) / (den_i + eps)), so its u includes the
denominator's pair term c zp before that rounding. Masks and weights follow `_key_weights`; operand precision
follows `_common` (the dk/dv scan's Rz products: `_dot_tf32`; the dq scan's Z products: 3xTF32).

Dims: B batch, T decoder length, M encoder length, H heads, K feature dim, V value dim; tiles BT (tokens),
BK (feature dim, power of two >= 16), BV (whole value dim, power of two), BP (pair rows, two halves of BP / 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRETED, _add_antisymmetric_part, _add_chunk_t, _dot, _dot_alone, _dot_fp32, _dot_tf32, _key_range, _key_rows,
    _key_weights, _load_encoder_state_f, _load_state_t, _pair_features_t, _pair_index, _pair_scatter, _scale_state,
    _select, _store_state_t, _tile, dot_types, feature_blocks,
)


@triton.jit
def _add_chunk_f(b_h0, b_h1, b_hd, b_hoa, b_hob, b_zd, b_zpa, b_zpb, b_v, b_ktr, key_scale, b_eita, b_ejta, b_eitb,
                 b_ejtb, DOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
                 ISOLATED_UPDATE: tl.constexpr):
    """The dq scan's state update, for its encoder and its decoder keys: the forward state held feature-major (h1, hd
    [BK, BV], hoa, hob [BH, BV]) plus one chunk of keys, h0 += 1^T V, h1 += K'^T V, hd += (K'^T)**2 V, ho += P(K')^T
    V, for weighted values b_v [BT, BV] and raw keys b_ktr [BK, BT] (removed keys zeroed; K'^T = b_ktr * key_scale,
    the pair features P(K')^T [BH, BT] gathered from the raw keys, `_pair_features_t`), and the denominator's diagonal
    zd [BK] (sum k'**2) and pair entries zpa, zpb [BH] (sum k'_i k'_j) that dq's denominator terms take.
    ISOLATED_UPDATE: the 16-row h1 and hd updates through `_dot_alone` (`dq_constexprs`)."""
    b_kwt = b_ktr * key_scale
    b_pat = _pair_features_t(b_ktr, b_eita, b_ejta, key_scale, DOT, EMULATE)
    b_pbt = _pair_features_t(b_ktr, b_eitb, b_ejtb, key_scale, DOT, EMULATE)
    if ISOLATED_UPDATE:
        b_h1 = _dot_alone(b_kwt, b_v, b_h1, DOT, EMULATE, PRECISION)
        b_hd = _dot_alone(b_kwt * b_kwt, b_v, b_hd, DOT, EMULATE, PRECISION)
    else:
        b_h1 = b_h1 + _dot(b_kwt, b_v, DOT, EMULATE, PRECISION)
        b_hd = b_hd + _dot(b_kwt * b_kwt, b_v, DOT, EMULATE, PRECISION)
    return (
        b_h0 + tl.sum(b_v, axis=0),
        b_h1,
        b_hd,
        b_hoa + _dot(b_pat, b_v, DOT, EMULATE, PRECISION),
        b_hob + _dot(b_pbt, b_v, DOT, EMULATE, PRECISION),
        b_zd + tl.sum(b_kwt * b_kwt, axis=1),
        b_zpa + tl.sum(b_pat, axis=1),
        b_zpb + tl.sum(b_pbt, axis=1),
    )


@triton.jit(do_not_specialize=["T", "M"])
def _pla_bwd_dq_kernel(
    q, k, v, k_enc, v_enc, key_mask, key_rows, enc_start, enc_end, state_in, log_decay, gate, do, y, dq, rden, dcol,
    dgate,
    s_qb, s_qt, s_qh, s_qk,
    s_kb, s_kt, s_kh, s_kk,
    s_vb, s_vt, s_vh, s_vv,
    s_keb, s_ket, s_keh, s_kek,
    s_veb, s_vet, s_veh, s_vev,
    s_mb, s_mt,
    s_ob, s_ot, s_oh, s_ov,
    s_yb, s_yt, s_yh, s_yv,
    T, M, eps, key_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    MASK: tl.constexpr, STRICT: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr, RECOMPUTE: tl.constexpr, ENCODER_STATE: tl.constexpr,
    SAVED_RDEN: tl.constexpr, ISOLATED_UPDATE: tl.constexpr,
    DOT: tl.constexpr, SDOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """dq (stored in dq's dtype), 1 / (den + eps), c = -(dy . y) / (den + eps) and d gate (fp32, (B, T, H)).

    y is the forward's output (B, T, H, V), read for dy . y unless RECOMPUTE (always with a gate, whose gradient
    needs the ungated numerator): then dy . num is reduced from the products of dy^T with the rebuilt state and
    with the chunk's values, which dq's terms take too (g is dy scaled per query). The Based decay (never with an
    encoder) and the gate act as in the forward.

    With ENCODER_STATE, `state_in` is the forward's `encoder_state` (initial state included) and the encoder keys
    are not read again. With SAVED_RDEN, `rden` holds the forward's 1 / (den + eps), read instead of computed: no Z
    is carried then (its diagonal and pair entries, which dq's denominator terms take, still are).
    """
    i_bh = tl.program_id(0)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    skip, key_lo, key_hi = _key_range(key_rows, i_b, MASK)
    if skip:
        return
    F: tl.constexpr = 1 + K + K * K
    W: tl.constexpr = V + 1
    BH: tl.constexpr = BP // 2
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    r_d = 1 + K + o_k * (K + 1)  # diagonal rows (i, i) of the full layout
    # the pair rows in two halves a, b of BH = BP / 2 (each product's pair operand half as large; _common)
    m_pa, r_ija, r_jia, b_eia, b_eja, b_eita, b_ejta = _pair_index(tl.arange(0, BH), o_k, K)
    m_pb, r_ijb, r_jib, b_eib, b_ejb, b_eitb, b_ejtb = _pair_index(BH + tl.arange(0, BH), o_k, K)
    p_m = key_mask + i_b * s_mb
    start = tl.load(enc_start + i_b)
    end = tl.load(enc_end + i_b)

    # The forward state, feature-major and symmetric: h1 [BK, BV], diagonal hd [BK, BV] (read with 1/2), pair halves
    # hoa, hob [BH, BV] (read with 1), denominators z0, z1 [BK], Z [BK, BK] (sum k k^T).
    b_h0 = tl.zeros([BV], dtype=tl.float32)
    b_h1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_hd = tl.zeros([BK, BV], dtype=tl.float32)
    b_hoa = tl.zeros([BH, BV], dtype=tl.float32)
    b_hob = tl.zeros([BH, BV], dtype=tl.float32)
    b_z0 = tl.zeros([1], dtype=tl.float32)
    b_z1 = tl.zeros([BK], dtype=tl.float32)
    b_zz = tl.zeros([BK, BK], dtype=tl.float32)
    # Z's diagonal zd [BK] and symmetric pair entries zpa, zpb [BH] (sum k'_i k'_j), kept next to Z: dq folds the
    # denominator's pair term c Z_ij into the numerator's pair weights before their rounding (see the scatter).
    b_zd = tl.zeros([BK], dtype=tl.float32)
    b_zpa = tl.zeros([BH], dtype=tl.float32)
    b_zpb = tl.zeros([BH], dtype=tl.float32)
    if ENCODER_STATE:  # the forward's state after the encoder, in the kernels' form (`_store_encoder_state`)
        b_h0, b_h1, b_hd, b_hoa, b_hob, b_z0, b_z1, b_zz = _load_encoder_state_f(state_in, i_bh, o_k, o_v, m_v, V, BK,
                                                                                 BP)
    elif HAS_INITIAL_STATE:
        b_h0, b_h1t, b_hdt, b_hoat, b_hobt, b_z0, b_z1, b_zz = _load_state_t(
            state_in + i_bh.to(tl.int64) * F * W, o_k, m_k, o_v, m_v, r_d, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb,
            K, V, W,
        )
        b_h1, b_hd, b_hoa, b_hob = tl.trans(b_h1t), tl.trans(b_hdt), tl.trans(b_hoat), tl.trans(b_hobt)
    if ENCODER_STATE or HAS_INITIAL_STATE:
        b_zd = tl.sum(tl.where(o_k[:, None] == o_k[None, :], b_zz, 0.0), axis=1)
        b_zsym = 0.5 * (b_zz + tl.trans(b_zz))  # an initial Z may have an antisymmetric part, which no query reads
        b_zpa = tl.sum(b_eia * _dot_fp32(b_zsym, b_eja), axis=0)
        b_zpb = tl.sum(b_eib * _dot_fp32(b_zsym, b_ejb), axis=0)

    # 1. The encoder keys of this row (positions [start, end) of k_enc / v_enc): state updates only (none with the
    #    forward's encoder state, which holds them already).
    p_ke = k_enc + i_b * s_keb + i_h * s_keh
    p_ve = v_enc + i_b * s_veb + i_h * s_veh
    o_c = tl.arange(0, BT)
    if not ENCODER_STATE:
        for i_t in range(start // BT, tl.cdiv(end, BT)):
            o_t = (i_t * BT + o_c).to(tl.int64)
            m_t = o_t < M
            b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, start, end, key_lo, key_hi, MASK, STRICT, True)
            # weighted keys [BT, BK] and raw [BK, BT] (w is 0 or 1; raw = unscaled, for the exact pair gathers),
            # values [BT, BV]
            b_kw = tl.where(b_raw[:, None] & b_w[:, None], _tile(p_ke, o_t, m_t, s_ket, o_k, m_k, s_kek), 0.0)
            b_kw = b_kw * key_scale
            b_ktr = tl.where(b_raw[None, :] & b_w[None, :], _tile(p_ke, o_k, m_k, s_kek, o_t, m_t, s_ket), 0.0)
            b_v = tl.where(b_w[:, None], _tile(p_ve, o_t, m_t, s_vet, o_v, m_v, s_vev), 0.0)
            b_h0, b_h1, b_hd, b_hoa, b_hob, b_zd, b_zpa, b_zpb = _add_chunk_f(
                b_h0, b_h1, b_hd, b_hoa, b_hob, b_zd, b_zpa, b_zpb, b_v, b_ktr, key_scale,
                b_eita, b_ejta, b_eitb, b_ejtb, DOT, EMULATE, PRECISION, ISOLATED_UPDATE,
            )
            b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
            b_z1 += tl.sum(b_kw, axis=0)
            b_zz += _dot_fp32(tl.trans(b_kw), b_kw)

    # 2. The decoder scan, queries along the columns (as the forward's read): den, G = [g, c], then dq^T [BK, BT];
    #    the state moves past the chunk at the end.
    p_q = q + i_b * s_qb + i_h * s_qh
    p_k = k + i_b * s_kb + i_h * s_kh
    p_v = v + i_b * s_vb + i_h * s_vh
    p_do = do + i_b * s_ob + i_h * s_oh
    p_y = y + i_b * s_yb + i_h * s_yh
    p_dq = dq + i_b * s_qb + i_h * s_qh
    p_r = rden + (i_b * T * H + i_h)
    p_c = dcol + (i_b * T * H + i_h)
    p_g = gate + (i_b * T * H + i_h)
    p_dg = dgate + (i_b * T * H + i_h)
    b_lg = tl.load(log_decay + i_h).to(tl.float32) if HAS_DECAY else 0.0
    for i_t in range(0, tl.cdiv(T, BT)):
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_t = o_t < T
        b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, start, end, key_lo, key_hi, MASK, STRICT, False)
        # queries [BK, BT] (raw, for the pair gathers, and scaled), keys [BT, BK] and raw [BK, BT], values [BT, BV].
        # Keys of weight 0 are zeroed too: every use of a key here is weighted (the intra-chunk block, the update).
        b_qtr = _tile(p_q, o_k, m_k, s_qk, o_t, m_t, s_qt)
        b_qt = b_qtr * key_scale
        # Without a key mask the weight is "in bounds" and the loads zero the tail already (its keys reach only
        # queries past T, which are not stored; the count z0 still takes the weights).
        b_k = _tile(p_k, o_t, m_t, s_kt, o_k, m_k, s_kk)
        b_causal = o_c[None, :] >= o_c[:, None]
        if MASK != 0:
            b_k = tl.where(b_raw[:, None] & b_w[:, None], b_k, 0.0)
            b_causal = b_causal & b_w[:, None]
        b_k = b_k * key_scale

        # den [BT] as the forward's (fp32), or the forward's 1 / (den + eps). s^T [BT keys, BT queries] serves dq.
        b_st = _dot(b_k, b_qt, DOT, EMULATE, PRECISION)
        if SAVED_RDEN:
            b_rden = tl.load(p_r + o_t * H, mask=m_t, other=0.0)
        else:
            b_at = tl.where(b_causal, 1.0 + b_st + 0.5 * b_st * b_st, 0.0)
            b_zq = _dot_fp32(b_zz, b_qt)  # [BK, BT]
            b_den = tl.sum(b_z0) + tl.sum(b_qt * (b_z1[:, None] + 0.5 * b_zq), axis=0) + tl.sum(b_at, axis=0)
            b_rden = 1.0 / (b_den + eps)
        b_dot = _tile(p_do, o_v, m_v, s_ov, o_t, m_t, s_ot)  # dy^T [BV, BT]
        if RECOMPUTE:
            # dy . num (ungated) from the products of dy^T with the state and the chunk's values, which dq's terms
            # share (g is dy^T scaled per query); the query features multiply the products in fp32.
            b_ktr = _tile(p_k, o_k, m_k, s_kk, o_t, m_t, s_kt)
            b_v = _tile(p_v, o_t, m_t, s_vt, o_v, m_v, s_vv)
            if MASK != 0:
                b_ktr = tl.where(b_raw[None, :] & b_w[None, :], b_ktr, 0.0)
                b_v = tl.where(b_w[:, None], b_v, 0.0)
            b_kt = b_ktr * key_scale
            b_x1 = _dot(b_h1, b_dot, SDOT, EMULATE, PRECISION)  # [BK, BT]
            b_xd = _dot(b_hd, b_dot, SDOT, EMULATE, PRECISION)
            b_xa = _dot(b_hoa, b_dot, SDOT, EMULATE, PRECISION)  # [BH, BT]
            b_xb = _dot(b_hob, b_dot, SDOT, EMULATE, PRECISION)
            b_dwt = _dot(b_v, b_dot, DOT, EMULATE, PRECISION)  # [BT keys, BT queries]
            b_dyn = tl.sum(b_h0[:, None] * b_dot, axis=0) + tl.sum(b_qt * (b_x1 + 0.5 * (b_qt * b_xd)), axis=0)
            b_dyn += tl.sum(_pair_features_t(b_qtr, b_eita, b_ejta, key_scale, DOT, EMULATE) * b_xa, axis=0)
            b_dyn += tl.sum(_pair_features_t(b_qtr, b_eitb, b_ejtb, key_scale, DOT, EMULATE) * b_xb, axis=0)
            b_gs = b_rden  # g = dy^T * b_gs per query
            if HAS_DECAY:
                b_dec = tl.exp(b_lg * (o_c + 1).to(tl.float32))  # the state is gamma**(p + 1) old
                b_dwt = b_dwt * tl.exp(b_lg * tl.maximum(o_c[None, :] - o_c[:, None], 0).to(tl.float32))
                b_dyn = b_dyn * b_dec
            if SAVED_RDEN:
                b_at = tl.where(b_causal, 1.0 + b_st + 0.5 * b_st * b_st, 0.0)
            b_dyn = (b_dyn + tl.sum(b_at * b_dwt, axis=0)) * b_rden  # dy . num / (den + eps)
            if HAS_GATE:
                b_gate = tl.load(p_g + o_t * H, mask=m_t, other=0.0).to(tl.float32)
                tl.store(p_dg + o_t * H, b_dyn, mask=m_t)
                b_dyn = b_dyn * b_gate
                b_gs = b_gs * b_gate
            # G = [g, c]: the gradient with respect to the (ungated) numerator and the denominator
            b_c = -b_dyn * b_rden
            if not SAVED_RDEN:
                tl.store(p_r + o_t * H, b_rden, mask=m_t)
            tl.store(p_c + o_t * H, b_c, mask=m_t)
            # intra-chunk: dw_ji = G_i . [gamma**(i - j) v_j, 1], ds_ji = dw_ji (1 + s_ji), dq'^T = K'^T ds^T
            b_dwt = b_dwt * b_gs[None, :]
            b_dst = tl.where(b_causal, (b_dwt + b_c[None, :]) * (1.0 + b_st), 0.0)
            b_dqt = _dot(b_kt, b_dst, DOT, EMULATE, PRECISION)
            # inter-chunk as below, the state products h g^T being h dy^T scaled per query (and decayed). The raw
            # queries are loaded again for the scatter's gathers: otherwise the compiler keeps the numerator's
            # gathers of them ([BH, BT], four) live from the read to here.
            if HAS_DECAY:
                b_gs = b_gs * b_dec
            b_qtr = _tile(p_q, o_k, m_k, s_qk, o_t, m_t, s_qt)
            b_dqt += b_x1 * b_gs[None, :] + b_c[None, :] * b_z1[:, None]
            b_dqt += b_qt * (b_xd * b_gs[None, :] + b_c[None, :] * b_zd[:, None])
            b_ut = b_xa * b_gs[None, :] + b_c[None, :] * b_zpa[:, None]
            b_dqp = _dot(b_eia, b_ut * _select(b_ejta, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_dqp += _dot(b_eja, b_ut * _select(b_eita, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_ut = b_xb * b_gs[None, :] + b_c[None, :] * b_zpb[:, None]
            b_dqp += _dot(b_eib, b_ut * _select(b_ejtb, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_dqp += _dot(b_ejb, b_ut * _select(b_eitb, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_dqt += b_dqp * key_scale
            p_out = p_dq + o_t[None, :] * s_qt + o_k[:, None] * s_qk
            tl.store(p_out, (b_dqt * key_scale).to(dq.dtype.element_ty), mask=m_k[:, None] & m_t[None, :])
        else:
            # the forward's output y (no gate here, in its dtype): dy . y per query
            b_dyn = tl.sum(b_dot * _tile(p_y, o_v, m_v, s_yv, o_t, m_t, s_yt), axis=0)
            # G = [g, c]: the gradient with respect to the (ungated) numerator and the denominator. [BV, BT], [BT]
            b_c = -b_dyn * b_rden
            if not SAVED_RDEN:
                tl.store(p_r + o_t * H, b_rden, mask=m_t)
            tl.store(p_c + o_t * H, b_c, mask=m_t)
            b_gt = b_dot * b_rden[None, :]

            # intra-chunk first (s and ds are then dead during the pair scatter): dw_ji = G_i . [gamma**(i - j) v_j,
            # 1], ds_ji = dw_ji (1 + s_ji) [BT keys, BT queries], dq'^T = K'^T ds^T. Raw keys and values stay for the
            # state update.
            b_ktr = _tile(p_k, o_k, m_k, s_kk, o_t, m_t, s_kt)
            b_v = _tile(p_v, o_t, m_t, s_vt, o_v, m_v, s_vv)
            if MASK != 0:
                b_ktr = tl.where(b_raw[None, :] & b_w[None, :], b_ktr, 0.0)
                b_v = tl.where(b_w[:, None], b_v, 0.0)
            b_kt = b_ktr * key_scale
            b_dwt = _dot(b_v, b_gt, DOT, EMULATE, PRECISION)
            if HAS_DECAY:
                b_dwt = b_dwt * tl.exp(b_lg * tl.maximum(o_c[None, :] - o_c[:, None], 0).to(tl.float32))
            b_dst = tl.where(b_causal, (b_dwt + b_c[None, :]) * (1.0 + b_st), 0.0)
            b_dqt = _dot(b_kt, b_dst, DOT, EMULATE, PRECISION)

            # inter-chunk, transposed: dq'^T += h1 g^T + q'^T * (hd g^T) + pairs (ho g^T) scattered + c (z1 + Z_sym q').
            # The state is the A operand of each product (feature-major); decayed, it is gamma**(p + 1) old. [BK, BT]
            if HAS_DECAY:
                b_gt = b_gt * tl.exp(b_lg * (o_c + 1).to(tl.float32))[None, :]
            # c Z_sym q' split like the numerator: its diagonal joins hd g, its pairs join u = ho g before the rounding
            b_dqt += _dot(b_h1, b_gt, SDOT, EMULATE, PRECISION) + b_c[None, :] * b_z1[:, None]
            b_dqt += b_qt * (_dot(b_hd, b_gt, SDOT, EMULATE, PRECISION) + b_c[None, :] * b_zd[:, None])
            # (the pair terms from the raw gathered queries, the key scale applied to their [BK, BT] sum)
            b_ut = _dot(b_hoa, b_gt, SDOT, EMULATE, PRECISION) + b_c[None, :] * b_zpa[:, None]
            b_dqp = _dot(b_eia, b_ut * _select(b_ejta, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_dqp += _dot(b_eja, b_ut * _select(b_eita, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_ut = _dot(b_hob, b_gt, SDOT, EMULATE, PRECISION) + b_c[None, :] * b_zpb[:, None]
            b_dqp += _dot(b_eib, b_ut * _select(b_ejtb, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_dqp += _dot(b_ejb, b_ut * _select(b_eitb, b_qtr, DOT, EMULATE), SDOT, EMULATE, PRECISION)
            b_dqt += b_dqp * key_scale
            p_out = p_dq + o_t[None, :] * s_qt + o_k[:, None] * s_qk
            tl.store(p_out, (b_dqt * key_scale).to(dq.dtype.element_ty), mask=m_k[:, None] & m_t[None, :])

        # state update with the chunk's counted keys; decayed: gamma**L old + gamma**(L - 1 - p) new. The count
        # and Z only serve den.
        b_z1 += tl.sum(b_k, axis=0)
        if not SAVED_RDEN:
            b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
            b_zz += _dot_fp32(tl.trans(b_k), b_k)
        if HAS_DECAY:
            b_len = tl.minimum(T - i_t * BT, BT).to(tl.float32)
            b_v = b_v * tl.exp(b_lg * (b_len - 1.0 - o_c.to(tl.float32)))[:, None]
            b_h0, b_h1, b_hd, b_hoa, b_hob = _scale_state(b_h0, b_h1, b_hd, b_hoa, b_hob, tl.exp(b_lg * b_len))
        b_h0, b_h1, b_hd, b_hoa, b_hob, b_zd, b_zpa, b_zpb = _add_chunk_f(
            b_h0, b_h1, b_hd, b_hoa, b_hob, b_zd, b_zpa, b_zpb, b_v, b_ktr, key_scale,
            b_eita, b_ejta, b_eitb, b_ejtb, DOT, EMULATE, PRECISION, ISOLATED_UPDATE,
        )


@triton.jit
def _key_dv(b_ktr, key_scale, b_r0, b_r1, b_rd, b_roa, b_rob, b_eita, b_ejta, b_eitb, b_ejtb,
            DOT: tl.constexpr, SDOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
    """dv^T = R^T phi(k')^T [BV, BT] of keys through the reverse state R (without weight and decay); b_ktr [BK, BT]
    the raw keys. The state is the A operand, as in the forward's read."""
    b_kt = b_ktr * key_scale
    b_dvt = b_r0[:, None] + _dot(b_r1, b_kt, SDOT, EMULATE, PRECISION)
    b_dvt += _dot(b_rd, 0.5 * (b_kt * b_kt), SDOT, EMULATE, PRECISION)
    # the pair features of the raw keys (exact products, one rounding to SDOT), the scale applied to the sum
    b_dvp = _dot(b_roa, _pair_features_t(b_ktr, b_eita, b_ejta, 1.0, DOT, EMULATE), SDOT, EMULATE, PRECISION)
    b_dvp += _dot(b_rob, _pair_features_t(b_ktr, b_eitb, b_ejtb, 1.0, DOT, EMULATE), SDOT, EMULATE, PRECISION)
    return b_dvt + b_dvp * (key_scale * key_scale)


@triton.jit
def _key_dk(b_kr, key_scale, b_vd, b_r1, b_rd, b_roa, b_rob, b_rz1, b_rzz, b_eia, b_eja, b_eita, b_ejta,
            b_eib, b_ejb, b_eitb, b_ejtb,
            DOT: tl.constexpr, SDOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr):
    """dk' [BT, BK] of keys through the reverse state (without weight): R1 v + k' * (Rd v) + the pairs' u = Ro v
    scattered + rz1 + Rz k', for b_kr [BT, BK] the raw keys and b_vd [BT, BV] the (decayed) values."""
    b_k = b_kr * key_scale
    b_dk = _dot(b_vd, b_r1, SDOT, EMULATE, PRECISION) + b_rz1[None, :] + _dot_tf32(b_k, b_rzz, DOT, EMULATE)
    b_dk += b_k * _dot(b_vd, b_rd, SDOT, EMULATE, PRECISION)
    # the pair scatter of u times the raw gathered keys; the key scale applied to the [BT, BK] sum
    b_dkp = _pair_scatter(_dot(b_vd, b_roa, SDOT, EMULATE, PRECISION), _select(b_kr, b_eia, DOT, EMULATE),
                          _select(b_kr, b_eja, DOT, EMULATE), b_eita, b_ejta, SDOT, EMULATE, PRECISION)
    b_dkp += _pair_scatter(_dot(b_vd, b_rob, SDOT, EMULATE, PRECISION), _select(b_kr, b_eib, DOT, EMULATE),
                           _select(b_kr, b_ejb, DOT, EMULATE), b_eitb, b_ejtb, SDOT, EMULATE, PRECISION)
    return b_dk + b_dkp * key_scale


@triton.jit
def _sel_at(b_e, p_sel, m: tl.constexpr, R: tl.constexpr, C: tl.constexpr, SEL_TABLE: tl.constexpr):
    """The selection matrix b_e [R, C], or with SEL_TABLE the same matrix loaded from the launcher's table
    (`_selection_table`, entry m) at its point of use, so that no register copy of it is held across the loop."""
    if SEL_TABLE:
        o_r = tl.arange(0, R)
        o_c = tl.arange(0, C)
        b_e = tl.load(p_sel + m * R * C + o_r[:, None] * C + o_c[None, :])
    return b_e


@triton.jit(do_not_specialize=["T", "M"])
def _pla_bwd_dkv_kernel(
    q, k, v, k_enc, v_enc, key_mask, key_rows, enc_start, enc_end, rden, dcol, log_decay, gate, do, dstate,
    dk, dv, dk_enc, dv_enc, dstate_in, sel, sel_s,
    s_qb, s_qt, s_qh, s_qk,
    s_kb, s_kt, s_kh, s_kk,
    s_vb, s_vt, s_vh, s_vv,
    s_keb, s_ket, s_keh, s_kek,
    s_veb, s_vet, s_veh, s_vev,
    s_mb, s_mt,
    s_ob, s_ot, s_oh, s_ov,
    T, M, key_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    MASK: tl.constexpr, STRICT: tl.constexpr, HAS_DSTATE: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr, SEL_TABLE: tl.constexpr, UPDATE_RELOADS: tl.constexpr,
    DOT: tl.constexpr, SDOT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """dk, dv (decoder), dk_enc, dv_enc (encoder range of the row) and d initial state, by a reverse scan.

    The reverse state is held as the forward kernel holds its state: symmetric 2nd order, transposed ([BV,
    features]: the read dv^T = R^T phi(K)^T takes it as the A operand from registers), Rz [BK, BK] for the
    denominator. The antisymmetric part of dS's 2nd-order blocks, which no key reads, is added by the launcher.
    """
    i_bh = tl.program_id(0)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    skip, key_lo, key_hi = _key_range(key_rows, i_b, MASK)
    if skip:
        return
    F: tl.constexpr = 1 + K + K * K
    W: tl.constexpr = V + 1
    BH: tl.constexpr = BP // 2
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    r_d = 1 + K + o_k * (K + 1)
    r_kk = 1 + K + o_k[:, None] * K + o_k[None, :]
    # the pair rows in two halves a, b of BH = BP / 2 (each product's pair operand half as large; _common)
    m_pa, r_ija, r_jia, b_eia, b_eja, b_eita, b_ejta = _pair_index(tl.arange(0, BH), o_k, K)
    m_pb, r_ijb, r_jib, b_eib, b_ejb, b_eitb, b_ejtb = _pair_index(BH + tl.arange(0, BH), o_k, K)
    p_m = key_mask + i_b * s_mb
    start = tl.load(enc_start + i_b)
    end = tl.load(enc_end + i_b)
    p_state = i_bh.to(tl.int64) * F * W

    # Reverse state R = dS + sum phi(q) G^T (kernel convention), transposed and symmetric: r1 [BV, BK], diagonal rd
    # [BV, BK] (read with 1/2), pair halves roa, rob [BV, BH] (R_ij + R_ji) / 2 (read with 1), denominators rz0,
    # rz1 [BK] and the symmetric part of the 2nd-order block, Rz [BK, BK] (`_dot_tf32` products).
    b_r0 = tl.zeros([BV], dtype=tl.float32)
    b_r1 = tl.zeros([BV, BK], dtype=tl.float32)
    b_rd = tl.zeros([BV, BK], dtype=tl.float32)
    b_roa = tl.zeros([BV, BH], dtype=tl.float32)
    b_rob = tl.zeros([BV, BH], dtype=tl.float32)
    b_rz0 = tl.zeros([1], dtype=tl.float32)
    b_rz1 = tl.zeros([BK], dtype=tl.float32)
    b_rzz = tl.zeros([BK, BK], dtype=tl.float32)
    if HAS_DSTATE:
        b_r0, b_r1, b_rd, b_roa, b_rob, b_rz0, b_rz1, b_rzz = _load_state_t(
            dstate + p_state, o_k, m_k, o_v, m_v, r_d, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, K, V, W
        )
        b_rzz = 0.5 * (b_rzz + tl.trans(b_rzz))

    p_q = q + i_b * s_qb + i_h * s_qh
    p_k = k + i_b * s_kb + i_h * s_kh
    p_v = v + i_b * s_vb + i_h * s_vh
    p_do = do + i_b * s_ob + i_h * s_oh
    p_dk = dk + i_b * s_kb + i_h * s_kh
    p_dv = dv + i_b * s_vb + i_h * s_vh
    p_r = rden + (i_b * T * H + i_h)
    p_c = dcol + (i_b * T * H + i_h)
    p_g = gate + (i_b * T * H + i_h)
    b_lg = tl.load(log_decay + i_h).to(tl.float32) if HAS_DECAY else 0.0
    o_c = tl.arange(0, BT)
    n_t = tl.cdiv(T, BT)
    # 1. Decoder chunks, last to first.
    for i_r in range(0, n_t):
        i_t = n_t - 1 - i_r
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_t = o_t < T
        b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, start, end, key_lo, key_hi, MASK, STRICT, False)
        # queries [BT, BK] (raw, for the exact pair gathers, and scaled) and [BK, BT] (the update's only), raw keys
        # [BT, BK] and [BK, BT], values [BT, BV], g^T [BV, BT]
        b_qr = _tile(p_q, o_t, m_t, s_qt, o_k, m_k, s_qk)
        b_q = b_qr * key_scale
        if not UPDATE_RELOADS or HAS_DECAY:
            b_qt = _tile(p_q, o_k, m_k, s_qk, o_t, m_t, s_qt) * key_scale
        b_kr = _tile(p_k, o_t, m_t, s_kt, o_k, m_k, s_kk)
        b_ktr = _tile(p_k, o_k, m_k, s_kk, o_t, m_t, s_kt)
        if MASK != 0:  # without a key mask, raw and weight are "in bounds": the loads and stores mask already
            b_kr = tl.where(b_raw[:, None], b_kr, 0.0)
            b_ktr = tl.where(b_raw[None, :], b_ktr, 0.0)
        b_v = _tile(p_v, o_t, m_t, s_vt, o_v, m_v, s_vv)
        b_rden = tl.load(p_r + o_t * H, mask=m_t, other=0.0)
        b_c = tl.load(p_c + o_t * H, mask=m_t, other=0.0)
        b_gt = _tile(p_do, o_v, m_v, s_ov, o_t, m_t, s_ot) * b_rden[None, :]
        if HAS_GATE:
            b_gt = b_gt * tl.load(p_g + o_t * H, mask=m_t, other=0.0).to(tl.float32)[None, :]
        b_kd = tl.zeros([BT], dtype=tl.float32)
        if HAS_DECAY:
            b_len = tl.minimum(T - i_t * BT, BT).to(tl.float32)
            b_kd = tl.exp(b_lg * (b_len - 1.0 - o_c.to(tl.float32)))  # [BT] gamma**(L - 1 - p)

        # dv first, then dk, so that dv's [BV, BT] accumulator and the intra-chunk a are dead before the dk pair
        # scatter. dv^T: through the reverse state (later queries, dS), then intra-chunk g^T a (a: [queries, keys])
        b_wf = b_w.to(tl.float32)
        b_dvt = _key_dv(b_ktr, key_scale, b_r0, b_r1, b_rd, b_roa, b_rob,
                        _sel_at(b_eita, sel, 4, BH, BK, SEL_TABLE), _sel_at(b_ejta, sel, 5, BH, BK, SEL_TABLE),
                        _sel_at(b_eitb, sel, 6, BH, BK, SEL_TABLE), _sel_at(b_ejtb, sel, 7, BH, BK, SEL_TABLE),
                        DOT, SDOT, EMULATE, PRECISION)
        if HAS_DECAY:
            b_dvt = b_dvt * (b_kd * b_wf)[None, :] if MASK != 0 else b_dvt * b_kd[None, :]
        elif MASK != 0:
            b_dvt = b_dvt * b_wf[None, :]
        b_s = _dot(b_q, b_ktr * key_scale, DOT, EMULATE, PRECISION)
        b_causal = o_c[:, None] >= o_c[None, :]
        if MASK != 0:
            b_causal = b_causal & b_w[None, :]
        b_a = tl.where(b_causal, 1.0 + b_s + 0.5 * b_s * b_s, 0.0)
        if HAS_DECAY:
            b_dvt += _dot(b_gt, b_a * tl.exp(b_lg * tl.maximum(o_c[:, None] - o_c[None, :], 0).to(tl.float32)),
                          DOT, EMULATE, PRECISION)
        else:
            b_dvt += _dot(b_gt, b_a, DOT, EMULATE, PRECISION)
        tl.store(p_dv + o_t[None, :] * s_vt + o_v[:, None] * s_vv, b_dvt.to(dv.dtype.element_ty),
                 mask=m_v[:, None] & m_t[None, :])
        # dk: intra-chunk from [keys, queries] tiles (s^T: the transpose of s, not a second product), then through
        # the reverse state
        b_st = tl.trans(b_s)
        b_keep = o_c[:, None] <= o_c[None, :]
        if MASK != 0:
            b_keep = b_keep & b_w[:, None]
        b_dwt = _dot(b_v, b_gt, DOT, EMULATE, PRECISION)
        if HAS_DECAY:
            b_dwt = b_dwt * tl.exp(b_lg * tl.maximum(o_c[None, :] - o_c[:, None], 0).to(tl.float32))  # gamma**(i-j)
        b_dwt += b_c[None, :]
        b_dst = tl.where(b_keep, b_dwt * (1.0 + b_st), 0.0)
        b_dk = _dot(b_dst, b_q, DOT, EMULATE, PRECISION)
        b_vd = b_v * b_kd[:, None] if HAS_DECAY else b_v
        if MASK != 0:
            b_dk += _key_dk(b_kr, key_scale, b_vd, b_r1, b_rd, b_roa, b_rob, b_rz1, b_rzz,
                            _sel_at(b_eia, sel, 0, BK, BH, SEL_TABLE), _sel_at(b_eja, sel, 1, BK, BH, SEL_TABLE),
                            _sel_at(b_eita, sel_s, 4, BH, BK, SEL_TABLE), _sel_at(b_ejta, sel_s, 5, BH, BK, SEL_TABLE),
                            _sel_at(b_eib, sel, 2, BK, BH, SEL_TABLE), _sel_at(b_ejb, sel, 3, BK, BH, SEL_TABLE),
                            _sel_at(b_eitb, sel_s, 6, BH, BK, SEL_TABLE), _sel_at(b_ejtb, sel_s, 7, BH, BK, SEL_TABLE),
                            DOT, SDOT, EMULATE, PRECISION) * b_wf[:, None]
            b_dk = tl.where(b_raw[:, None], b_dk, 0.0)
        else:
            b_dk += _key_dk(b_kr, key_scale, b_vd, b_r1, b_rd, b_roa, b_rob, b_rz1, b_rzz,
                            _sel_at(b_eia, sel, 0, BK, BH, SEL_TABLE), _sel_at(b_eja, sel, 1, BK, BH, SEL_TABLE),
                            _sel_at(b_eita, sel_s, 4, BH, BK, SEL_TABLE), _sel_at(b_ejta, sel_s, 5, BH, BK, SEL_TABLE),
                            _sel_at(b_eib, sel, 2, BK, BH, SEL_TABLE), _sel_at(b_ejb, sel, 3, BK, BH, SEL_TABLE),
                            _sel_at(b_eitb, sel_s, 6, BH, BK, SEL_TABLE), _sel_at(b_ejtb, sel_s, 7, BH, BK, SEL_TABLE),
                            DOT, SDOT, EMULATE, PRECISION)
        tl.store(p_dk + o_t[:, None] * s_kt + o_k[None, :] * s_kk, (b_dk * key_scale).to(dk.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])

        # R += G_c^T phi(Q_c) (as the forward's update); decayed: R <- gamma**L R + sum_i gamma**(p_i + 1) g_i
        # phi(q_i). UPDATE_RELOADS (not with the decay): its chunk operands are loaded again here (`dkv_constexprs`).
        if UPDATE_RELOADS and not HAS_DECAY:
            b_qr = _tile(p_q, o_t, m_t, s_qt, o_k, m_k, s_qk)
            b_q = b_qr * key_scale
            b_qt = _tile(p_q, o_k, m_k, s_qk, o_t, m_t, s_qt) * key_scale
            b_c = tl.load(p_c + o_t * H, mask=m_t, other=0.0)
            b_gt = _tile(p_do, o_v, m_v, s_ov, o_t, m_t, s_ot) * tl.load(p_r + o_t * H, mask=m_t, other=0.0)[None, :]
            if HAS_GATE:
                b_gt = b_gt * tl.load(p_g + o_t * H, mask=m_t, other=0.0).to(tl.float32)[None, :]
        if HAS_DECAY:
            b_gt = b_gt * tl.exp(b_lg * (o_c + 1).to(tl.float32))[None, :]
            b_r0, b_r1, b_rd, b_roa, b_rob = _scale_state(b_r0, b_r1, b_rd, b_roa, b_rob, tl.exp(b_lg * b_len))
        b_r0, b_r1, b_rd, b_roa, b_rob = _add_chunk_t(
            b_r0, b_r1, b_rd, b_roa, b_rob, b_gt, b_q, b_qr, key_scale,
            _sel_at(b_eia, sel, 0, BK, BH, SEL_TABLE), _sel_at(b_eja, sel, 1, BK, BH, SEL_TABLE),
            _sel_at(b_eib, sel, 2, BK, BH, SEL_TABLE), _sel_at(b_ejb, sel, 3, BK, BH, SEL_TABLE),
            DOT, EMULATE, PRECISION,
        )
        b_rz0 += tl.sum(b_c)
        b_rz1 += tl.sum(b_q * b_c[:, None], axis=0)
        b_rzz += _dot_tf32(b_qt, b_q * b_c[:, None], DOT, EMULATE)

    # 2. d initial state = R, in the cache layout (the launcher adds dS's antisymmetric part). Stored before the
    #    encoder loop, which reads R only as matmul operands, so the fp32 R is dead there (held across it, it spilled).
    _store_state_t(dstate_in + p_state, b_r0, b_r1, b_rd, b_roa, b_rob, b_rz0, b_rz1, b_rzz, 0, o_k, m_k, o_v, m_v,
                   r_d, r_kk, r_ija, r_jia, m_pa, r_ijb, r_jib, m_pb, V, W)

    # 3. The encoder keys of the row see every query: gradients through the complete R.
    p_ke = k_enc + i_b * s_keb + i_h * s_keh
    p_ve = v_enc + i_b * s_veb + i_h * s_veh
    p_dke = dk_enc + i_b * s_keb + i_h * s_keh
    p_dve = dv_enc + i_b * s_veb + i_h * s_veh
    for i_t in range(start // BT, tl.cdiv(end, BT)):
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_t = o_t < M
        b_raw, b_w = _key_weights(p_m, s_mt, o_t, m_t, start, end, key_lo, key_hi, MASK, STRICT, True)
        b_kr = tl.where(b_raw[:, None], _tile(p_ke, o_t, m_t, s_ket, o_k, m_k, s_kek), 0.0)
        b_ktr = tl.where(b_raw[None, :], _tile(p_ke, o_k, m_k, s_kek, o_t, m_t, s_ket), 0.0)
        b_v = _tile(p_ve, o_t, m_t, s_vet, o_v, m_v, s_vev)
        b_wf = b_w.to(tl.float32)
        b_dvt = _key_dv(b_ktr, key_scale, b_r0, b_r1, b_rd, b_roa, b_rob, b_eita, b_ejta, b_eitb, b_ejtb,
                        DOT, SDOT, EMULATE, PRECISION) * b_wf[None, :]
        tl.store(p_dve + o_t[None, :] * s_vet + o_v[:, None] * s_vev, b_dvt.to(dv_enc.dtype.element_ty),
                 mask=m_v[:, None] & m_t[None, :])
        b_dk = _key_dk(b_kr, key_scale, b_v, b_r1, b_rd, b_roa, b_rob, b_rz1, b_rzz, b_eia, b_eja, b_eita, b_ejta,
                       b_eib, b_ejb, b_eitb, b_ejtb, DOT, SDOT, EMULATE, PRECISION) * b_wf[:, None]
        b_dk = tl.where(b_raw[:, None], b_dk, 0.0)
        tl.store(p_dke + o_t[:, None] * s_ket + o_k[None, :] * s_kek, (b_dk * key_scale).to(dk_enc.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])


# Launch configs per GPU generation, (BT, num_warps) per scan, 1 stage, from benchmarks/kernel_aot.py's builds
# (docs/kernels.md "Configurations and autotuning", docs/performance.md "Backward pass 5" and "7"): the first of each
# list is launched, kernel_aot.py also builds the others. "dq_recompute" is the dq scan that reads the numerator again
# (a gate, or no saved output). At (64, 4) each warp of the sm_90 dk/dv scan owns 16 whole rows, so the pair weights
# u = v Ro^T feed the scatter from registers. The interpreter (CPU tests) takes the "other" list.
_ARCH_CONFIGS = {
    "sm_90": {"dq": [(32, 4), (16, 4)], "dq_recompute": [(16, 4), (32, 4)], "dkv": [(64, 4), (32, 4), (64, 8)]},
    "other": {"dq": [(16, 4), (32, 4)], "dq_recompute": [(16, 4), (32, 4), (64, 4)],
              "dkv": [(32, 4), (64, 4), (32, 8)]},
}


def configs_for_architecture(major: int) -> dict[str, list[tuple[int, int]]]:
    """{"dq": [(BT, num_warps), ...], "dq_recompute": [...], "dkv": [...]} for a GPU of compute capability
    `major`.x, the launched config first ("dq_recompute": the dq scan without a saved output or with a gate)."""
    return _ARCH_CONFIGS["sm_90" if major == 9 else "other"]


# The per-architecture forms of the two scans for compute capability `major`.x; docs/kernels.md ("The backward",
# "Per-architecture forms") says what each switch does and why.


def dq_constexprs(major: int) -> dict[str, bool]:
    """The dq scan's constexprs: ISOLATED_UPDATE off sm_90 (the 16-row h1, hd updates by `_dot_alone`)."""
    return {"ISOLATED_UPDATE": major != 9}


def dkv_constexprs(major: int) -> dict[str, bool]:
    """The dk/dv scan's constexprs: SEL_TABLE off sm_90 (`_selection_table`), UPDATE_RELOADS on sm_90 (the kernel
    ignores it with the decay)."""
    return {"SEL_TABLE": major != 9, "UPDATE_RELOADS": major == 9}


def launch_options(major: int) -> dict[str, int]:
    """Compile options of both scans on a CUDA GPU: `maxnreg=255` off sm_90 (`.maxnreg 255` in the PTX)."""
    return {} if major == 9 else {"maxnreg": 255}


def _selection_table(K: int, BK: int, BH: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(8, BK * BH) the pair selection matrices of `_pair_index` (e_i, e_j of the halves a, b, [BK, BH] row-major,
    then their transposes [BH, BK]) in the operands' dtype, for the dk/dv scan's SEL_TABLE loads."""
    o_k = torch.arange(BK, device=device)
    mats = []
    for half in range(2):
        o_p = half * BH + torch.arange(BH, device=device)
        m_p = o_p < K * (K - 1) // 2
        p_i = o_p % K
        p_j = (p_i + o_p // K + 1) % K
        mats += [(o_k[:, None] == p_i[None, :]) & m_p[None, :], (o_k[:, None] == p_j[None, :]) & m_p[None, :]]
    mats += [e.T for e in mats]
    return torch.stack([e.reshape(-1) for e in mats]).to(dtype).contiguous()


def _dense(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each tensor as is when `empty_like` keeps its strides, else a contiguous copy."""
    return [t if t is None or torch.empty_like(t).stride() == t.stride() else t.contiguous() for t in tensors]


def prefix_linear_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_enc: torch.Tensor | None, v_enc: torch.Tensor | None,
    grad_output: torch.Tensor, grad_state: torch.Tensor | None, *, encoder_start: torch.Tensor | None = None,
    encoder_end: torch.Tensor | None = None, key_mask: torch.Tensor | None = None, strict: bool = True,
    initial_state: torch.Tensor | None = None, log_decay: torch.Tensor | None = None, gate: torch.Tensor | None = None,
    eps: float = 1e-12, chunk_size: int | None = None, output: torch.Tensor | None = None,
    encoder_state: torch.Tensor | None = None, inverse_denominator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of `prefix_linear_attention` from validated inputs; launches the two scans.

    Args:
        q, k, v, k_enc, v_enc, key_mask, initial_state, eps: the forward's inputs (k_enc / v_enc may be None).
        grad_output: `(B, T, H, V)` gradient of the output.
        grad_state: `(B, H, F, V + 1)` gradient of the final state, or None (zero).
        encoder_start, encoder_end: `(B,)` int64 encoder range per row (default `[0, M)`).
        strict: pad_masking == "strict".
        log_decay: `(H,)` log gamma of the Based decay (no gradient: the decay is fixed), or None.
        gate: `(B, T, H)` Based numerator gate, or None.
        chunk_size: BT of both scans (default: the architecture's configs, `configs_for_architecture`).
        output: `(B, T, H, V)` the forward's output y, or None. Given (and without a gate), the dq scan takes
            `dy . y` from it instead of recomputing the numerator.
        encoder_state, inverse_denominator: the forward's saved tensors
            (`prefix_linear_attention_triton(..., return_saved=True)`), or None (recomputed). Given, the dq scan
            starts from the state after the encoder keys (with an encoder) and reads `1 / (den + eps)` instead of
            computing them.

    Returns:
        `(dq, dk, dv, dk_enc, dv_enc, d initial_state, d gate)` in the inputs' dtypes (fp32 for the state), None
        for absent inputs.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    M = 0 if k_enc is None else k_enc.shape[1]
    device = q.device
    if encoder_start is None:
        encoder_start = torch.zeros(B, dtype=torch.long, device=device)
        encoder_end = torch.full((B,), M, dtype=torch.long, device=device)
    # The kernels store each gradient with its input's strides: inputs whose layout empty_like cannot reproduce
    # (e.g. heads split from a fused projection) are copied once.
    q, k, v, k_enc, v_enc = _dense(q, k, v, k_enc, v_enc)
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
    recompute = output is None or gate is not None
    configs = configs_for_architecture(major)
    options = launch_options(major) if device.type == "cuda" and torch.version.hip is None else {}
    (BT_DQ, warps_dq), (BT_DKV, warps_dkv) = configs["dq_recompute" if recompute else "dq"][0], configs["dkv"][0]
    if chunk_size is not None:
        BT_DQ = BT_DKV = chunk_size
    BK, BP = feature_blocks(K)
    BV = max(16, triton.next_power_of_2(V))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    dk_enc, dv_enc = (None if t is None else torch.zeros_like(t) for t in (k_enc, v_enc))
    dstate_in = torch.empty(B, H, 1 + K + K * K, V + 1, dtype=torch.float32, device=device)
    saved_rden = inverse_denominator is not None
    rden = inverse_denominator.contiguous() if saved_rden else torch.empty(B, T, H, dtype=torch.float32, device=device)
    dcol = torch.empty(B, T, H, dtype=torch.float32, device=device)
    dgate = None if gate is None else torch.empty(B, T, H, dtype=torch.float32, device=device)
    gate_in = rden if gate is None else gate.contiguous()
    decay_in = rden if log_decay is None else log_decay.to(torch.float32).contiguous()
    # Absent optional tensors are never read (flags off, empty ranges); any pointer of the right kind will do.
    ke, ve, dke, dve = (x if t is None else t for x, t in ((k, k_enc), (v, v_enc), (dk, dk_enc), (dv, dv_enc)))
    mask = q if key_mask is None else key_mask.view(torch.uint8)
    mask_strides = (0, 0) if key_mask is None else mask.stride()
    from_encoder_state = encoder_state is not None and k_enc is not None
    if from_encoder_state:
        state_in = encoder_state.contiguous()
    else:
        state_in = dstate_in if initial_state is None else initial_state.contiguous()
    dstate = dstate_in if grad_state is None else grad_state.contiguous()
    grad_output = grad_output if grad_output.stride(-1) == 1 else grad_output.contiguous()
    y = grad_output if recompute else output  # never read when recompute
    key_rows = rden if key_mask is None else _key_rows(key_mask)
    common = dict(H=H, K=K, V=V, BK=BK, BV=BV, BP=BP, STRICT=strict, HAS_DECAY=log_decay is not None,
                  HAS_GATE=gate is not None, num_stages=1, **dot_types(q.dtype, INTERPRETED))
    strides = (*q.stride(), *k.stride(), *v.stride(), *ke.stride(), *ve.stride(), *mask_strides,
               *grad_output.stride())
    # A key mask takes two launches of each scan, as in the forward: the rows whose mask is one range, the others.
    mask_kinds = (0,) if key_mask is None else (1, 2)
    for mask_kind in mask_kinds:
        _pla_bwd_dq_kernel[(B * H,)](
            q, k, v, ke, ve, mask, key_rows, encoder_start, encoder_end, state_in, decay_in, gate_in, grad_output,
            y, dq, rden, dcol, rden if dgate is None else dgate,
            *strides, *y.stride(), T, M, eps, K**-0.25, BT=BT_DQ, MASK=mask_kind,
            HAS_INITIAL_STATE=initial_state is not None, RECOMPUTE=recompute,
            ENCODER_STATE=from_encoder_state, SAVED_RDEN=saved_rden, num_warps=warps_dq, **dq_constexprs(major),
            **options, **common,
        )
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == v.stride()
    sel = sel_s = rden
    if dkv_constexprs(major)["SEL_TABLE"]:
        # in the operands' dtypes: DOT for the gathers, SDOT for the dk scatter (bf16 for fp16 inputs)
        sel = _selection_table(K, BK, BP // 2, q.dtype, device)
        sel_s = sel if q.dtype != torch.float16 else sel.to(torch.bfloat16)
    for mask_kind in mask_kinds:
        _pla_bwd_dkv_kernel[(B * H,)](
            q, k, v, ke, ve, mask, key_rows, encoder_start, encoder_end, rden, dcol, decay_in, gate_in, grad_output,
            dstate, dk, dv, dke, dve, dstate_in, sel, sel_s,
            *strides, T, M, K**-0.25, BT=BT_DKV, MASK=mask_kind, HAS_DSTATE=grad_state is not None,
            num_warps=warps_dkv, **dkv_constexprs(major), **options, **common,
        )
    if grad_state is not None and initial_state is not None:
        # dS's antisymmetric 2nd-order part reaches the initial state unread (numerator decayed over the T tokens)
        _add_antisymmetric_part(dstate_in, grad_state, log_decay, K, T, denominator=True)
    dgate = None if dgate is None else dgate.to(gate.dtype)
    return dq, dk, dv, dk_enc, dv_enc, (None if initial_state is None else dstate_in), dgate


__all__ = ["prefix_linear_attention_backward"]
