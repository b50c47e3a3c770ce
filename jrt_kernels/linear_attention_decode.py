"""Fused decode step of linear attention that updates each request's state where it lives, in a pool of slots.

A serving engine keeps every request's recurrent state in one `(N, H, F, V + 1)` fp32 pool. Where the PyTorch step
gathers the states, updates the copy and writes it back, this kernel reads each state once and writes it once, at its
slot (docs/kernels.md "The decode step at its slot"):

    S[slot_b, h]  = S[slot_b, h] * [gamma_h ... gamma_h, 1] + phi(k_bh) [v_bh, 1]^T      (in place)
    o_bh          = g_bh * (phi(q_bh)^T S[slot_b, h])[:V] / ((phi(q_bh)^T S[slot_b, h])[V] + eps)

with `phi` the Taylor feature map (`modeling_jrt.linear_attention.taylor_feature_map`, F = 1 + K + K^2, computed on
chip), gamma the Based fixed decay (numerator columns only) and g the Based numerator gate.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import INTERPRETED, check_devices


@triton.jit
def _taylor_features(p_x, s_x, o_f, m_f, K: tl.constexpr, linear_scale, quadratic_scale):
    """Features `o_f` (BF,) of phi(x) for one head's `x` (K values at `p_x`, stride `s_x`), zeros where not `m_f`:
    feature 0 is 1, features 1..K are x / K^(1/4), feature 1 + K + i K + j is x_i x_j / (sqrt(2) sqrt(K))."""
    is_linear = (o_f >= 1) & (o_f <= K)
    pair = o_f - 1 - K
    is_quadratic = m_f & (pair >= 0)
    i = tl.where(is_quadratic, pair // K, 0)
    j = tl.where(is_quadratic, pair % K, 0)
    x_linear = tl.load(p_x + tl.where(is_linear, o_f - 1, 0) * s_x, mask=m_f & is_linear, other=0.0).to(tl.float32)
    x_i = tl.load(p_x + i * s_x, mask=is_quadratic, other=0.0).to(tl.float32)
    x_j = tl.load(p_x + j * s_x, mask=is_quadratic, other=0.0).to(tl.float32)
    phi = tl.where(o_f == 0, 1.0, tl.where(is_linear, x_linear * linear_scale, x_i * x_j * quadratic_scale))
    return tl.where(m_f, phi, 0.0)


@triton.jit
def _linear_attention_decode_kernel(
    q, k, v, slots, state, log_decay, gate, o,
    s_qb, s_qh, s_qk,
    s_kb, s_kh, s_kk,
    s_vb, s_vh, s_vv,
    s_sn, s_sh, s_sf,
    s_gb, s_gh,
    s_ob, s_oh,
    eps, linear_scale, quadratic_scale,
    K: tl.constexpr, V: tl.constexpr, F: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    i_b, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    slot = i_b  # without slots, request b's state is row b
    if HAS_SLOTS:
        slot = tl.load(slots + i_b).to(tl.int64)
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    b_v = tl.load(v + i_b * s_vb + i_h * s_vh + o_v * s_vv, mask=m_v, other=0.0).to(tl.float32)
    gamma = 1.0
    if HAS_DECAY:
        gamma = tl.exp(tl.load(log_decay + i_h).to(tl.float32))
    p_q, p_k = q + i_b * s_qb + i_h * s_qh, k + i_b * s_kb + i_h * s_kh
    p_state = state + slot * s_sn + i_h * s_sh  # the last dimension (V + 1) is contiguous
    b_numerator = tl.zeros([BV], dtype=tl.float32)
    b_denominator = tl.zeros([BF], dtype=tl.float32)
    for f_start in range(0, F, BF):
        o_f = f_start + tl.arange(0, BF)
        m_f = o_f < F
        b_phi_q = _taylor_features(p_q, s_qk, o_f, m_f, K, linear_scale, quadratic_scale)
        b_phi_k = _taylor_features(p_k, s_kk, o_f, m_f, K, linear_scale, quadratic_scale)
        # Numerator columns (BF, BV): decayed, plus phi(k) v^T; then read by phi(q).
        p_s = p_state + o_f[:, None] * s_sf + o_v[None, :]
        m_s = m_f[:, None] & m_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0) * gamma + b_phi_k[:, None] * b_v[None, :]
        tl.store(p_s, b_s, mask=m_s)
        b_numerator += tl.sum(b_phi_q[:, None] * b_s, axis=0)
        # Denominator column (BF,): the key sum, never decayed.
        p_z = p_state + o_f * s_sf + V
        b_z = tl.load(p_z, mask=m_f, other=0.0) + b_phi_k
        tl.store(p_z, b_z, mask=m_f)
        b_denominator += b_phi_q * b_z
    if HAS_GATE:
        b_numerator *= tl.load(gate + i_b * s_gb + i_h * s_gh).to(tl.float32)
    b_o = b_numerator / (tl.sum(b_denominator, axis=0) + eps)
    tl.store(o + i_b * s_ob + i_h * s_oh + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def linear_attention_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor | None = None,
    *,
    log_decay: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-12,
) -> torch.Tensor:
    """One decode step for B requests whose states live in `state` at `slots`, updated there in place.

    Equal to `linear_attention_step(q, k, v, state[slots], ...)` followed by `state[slots] = new_state` (its
    PyTorch reference), without the gather and the write-back.

    Args:
        q, k: `(B, H, K)` query and key of each request's new token (fp32, bf16 or fp16; any strides).
        v: `(B, H, V)` its value.
        state: `(N, H, F, V + 1)` fp32 pool of states, F = 1 + K + K^2, its last dimension contiguous.
        slots: `(B,)` integer slots of the B requests in `state`, distinct (two rows on one slot would race); None:
            request b's state is row b (a batch's own `(B, H, F, V + 1)` states, no index tensor to build).
        log_decay: `(H,)` log gamma of the Based fixed decay, or None.
        gate: `(B, H)` Based numerator gate, or None.
        eps: added to the fp32 denominator.

    Returns:
        `(B, H, V)` output in v's dtype.

    Raises:
        ValueError: shapes, dtypes or devices the kernel does not take, with the way out.
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be (B, H, K) and v (B, H, V) with the same B and H; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
    B, H, K = q.shape
    V = v.shape[-1]
    F = 1 + K + K * K
    if state.ndim != 4 or state.shape[1:] != (H, F, V + 1) or state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError(f"state must be an fp32 (N, {H}, {F}, {V + 1}) pool with a contiguous last dimension; got "
                         f"{tuple(state.shape)} {state.dtype} with strides {state.stride()}.")
    if slots is None and state.shape[0] != B:
        raise ValueError(f"Without slots, state must hold the B = {B} requests' states in order; got {state.shape[0]}.")
    if slots is not None and (slots.shape != (B,) or slots.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slots must be ({B},) int32 / int64; got {tuple(slots.shape)} {slots.dtype}.")
    if log_decay is not None and log_decay.shape != (H,):
        raise ValueError(f"log_decay must be ({H},); got {tuple(log_decay.shape)}.")
    if gate is not None and gate.shape != (B, H):
        raise ValueError(f"gate must be ({B}, {H}); got {tuple(gate.shape)}.")
    tensors = [t for t in (q, k, v, state, slots, log_decay, gate) if t is not None]
    check_devices("decode", tensors, INTERPRETED, "use linear_attention_step")
    return _linear_attention_decode(q, k, v, state, slots, log_decay, gate, float(eps))


def _linear_attention_decode(q, k, v, state, slots, log_decay, gate, eps: float) -> torch.Tensor:
    """The launch of `linear_attention_decode_triton` on checked arguments (benchmarks/kernel_aot.py builds it)."""
    B, H, K = q.shape
    V = v.shape[-1]
    F = 1 + K + K * K
    output = torch.empty(B, H, V, dtype=v.dtype, device=v.device)
    if B == 0:
        return output
    BV = triton.next_power_of_2(V)
    BF = max(16, min(triton.next_power_of_2(F), 4096 // BV))  # a (BF, BV) fp32 tile of at most 16 KiB
    # Absent optional tensors are never read (HAS_* False): any pointer will do.
    decay = state if log_decay is None else log_decay.to(torch.float32).contiguous()
    gate_in, gate_strides = (state, (0, 0)) if gate is None else (gate, gate.stride())
    _linear_attention_decode_kernel[(B, H)](
        q, k, v, state if slots is None else slots, state, decay, gate_in, output,
        *q.stride(), *k.stride(), *v.stride(), *state.stride()[:3], *gate_strides, *output.stride()[:2],
        eps, K ** -0.25, 1.0 / (math.sqrt(2.0) * math.sqrt(K)),
        K=K, V=V, F=F, BF=BF, BV=BV, HAS_DECAY=log_decay is not None, HAS_GATE=gate is not None,
        HAS_SLOTS=slots is not None,
    )
    return output


__all__ = ["linear_attention_decode_triton"]
