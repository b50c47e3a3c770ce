"""Fused Triton prefill of prefix linear attention (JRT-RNN) and causal Taylor linear attention (Based).

The math, the state layout, the argument checks and the reference (`prefix_linear_attention_chunked`) are in
`modeling_jrt.linear_attention` (KERNELS.md §2.1, §2.6). This module imports torch and triton only: the dispatcher
`modeling_jrt.linear_attention.prefix_linear_attention(..., implementation="triton")` validates the arguments with
`validate_linear_attention_inputs` and then calls `prefix_linear_attention_triton`, which only asserts them.
One program per (value block, batch x head) keeps the whole fp32 state on chip and

    1. reduces the encoder over the row's range: state = initial_state + sum_{start<=m<end} phi(ke_m) [ve_m, 1]
    2. scans the T decoder tokens in chunks of BT, starting from that state:
           inter  o_c  = h0 + Q'_c h1 + 1/2 (Q'_c (x) Q'_c) h2                        state of everything before
           intra  o_c += tril(1 + S + S**2 / 2) [V_c, 1]     S = Q'_c K'_c^T           no (BT, F) features needed
           update h0 += 1^T V_c,  h1 += K'_c^T V_c,  h2 += (K'_c (x) K'_c)^T V_c        (and z* with V -> 1)
           y_c = o_c[:, :V] / (o_c[:, V] + eps)
    3. writes the final state (sum over all keys, fp32) in the layout of the generation cache.

Here x' = x / K**(1/4) and (x) is the row-wise outer product, so phi(x) = [1, x', vec(x' x'^T) / sqrt(2)] and
phi(q).phi(k) = 1 + s + s**2 / 2. The 2nd-order features (BK * BK per token) exist only per chunk, in registers:
the Taylor feature map is never written to HBM. State and denominators are fp32; only the operands of `tl.dot`
are cast to the input dtype (KERNELS.md §5). Padded keys are removed in all three orders (strict masking) or,
with `pad_masking="reference"` and inside the row's encoder range, keep their weight-1 constant term as the original
code does.

Scope: forward only (a gradient request raises; training uses the chunked PyTorch path), no Based decay or gate
(`prefix_linear_attention(..., implementation="auto")` sends those to the chunked path). Inputs are read through
their strides (no copies). Grid (cdiv(V, BV), B * H); autotuned over a few (BT, BV, warps, stages) per (K, V, dtype)
unless JRT_TRITON_AUTOTUNE=0.

Dims (fla naming): B batch, T decoder length, M encoder length, H heads, K feature dim, V value dim,
F = 1 + K + K**2 Taylor features; tiles BT (tokens), BK (feature dim, a power of two >= 16), BV (value dim).
"""

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


# Few configs (a 15-minute GPU lease must not be spent tuning), keyed on (K, V) and, through the tensor
# arguments, on the input dtype. h2 is a (BK * BK, BV) fp32 accumulator: 64 registers per thread for
# BV = 32 on 4 warps, hence 8 warps for BV = 64. The interpreter (CPU tests) gets a single config: BT = 32
# keeps the per-step numpy cost low, and BV = 64 exercises the value split for V = 112.
_GPU_CONFIGS = [
    triton.Config({"BT": BT, "BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BT, BV, num_warps, num_stages in [
        (64, 32, 4, 2),
        (64, 32, 4, 3),
        (64, 64, 8, 2),
        (64, 64, 4, 2),
        (32, 32, 4, 2),
        (32, 64, 4, 2),
        (128, 32, 8, 2),
        (128, 64, 8, 2),
    ]
]
_INTERPRETER_CONFIGS = [triton.Config({"BT": 32, "BV": 64}, num_warps=4, num_stages=1)]


@triton.jit
def _load_chunk(p_base, o_t, m_t, s_t, o_d, m_d, s_d):
    """A (BT, BD) tile of a (T, D) slice with strides (s_t, s_d); zeros outside."""
    p = p_base + o_t[:, None] * s_t + o_d[None, :] * s_d
    return tl.load(p, mask=m_t[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _load_keys_values(
    p_k, p_v, p_m, o_t, m_t, m_r, s_kt, s_kk, s_vt, s_vv, s_mt, o_k, m_k, o_v, m_v, key_scale,
    HAS_MASK: tl.constexpr, STRICT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Scaled keys k' (fp32), values (matmul dtype) and key weights (0/1) of one chunk.

    A padded key has k' = 0 under both maskings. phi(0) = [1, 0, ...] is not 0, so a padded key also gets weight 0,
    which removes its value and its count (the 0th order), unless the masking is "reference" and the key lies in the
    row's encoder range (`m_r`): then both stay, as in the original code.
    """
    b_w = m_t
    # [BT, BK]
    b_k = _load_chunk(p_k, o_t, m_t, s_kt, o_k, m_k, s_kk).to(tl.float32) * key_scale
    if HAS_MASK:
        b_m = tl.load(p_m + o_t * s_mt, mask=m_t, other=0) != 0
        b_k = tl.where(b_m[:, None], b_k, 0.0)
        if STRICT:
            b_w = b_w & b_m
        else:
            b_w = b_w & (b_m | m_r)
    # [BT, BV]
    b_v = _load_chunk(p_v, o_t, m_t, s_vt, o_v, m_v, s_vv)
    b_v = tl.where(b_w[:, None], b_v, 0.0).to(tl.float32 if DOT_FP32 else b_v.dtype)
    return b_k, b_v, b_w


@triton.jit
def _outer(b_x, BT: tl.constexpr, BK: tl.constexpr):
    """Row-wise outer product [BT, BK] -> [BT, BK * BK]: the 2nd-order Taylor features of one chunk, on chip."""
    return tl.reshape(b_x[:, :, None] * b_x[:, None, :], [BT, BK * BK])


@triton.jit
def _accumulate(b_h0, b_h1, b_h2, b_z0, b_z1, b_z2, b_k, b_k2, b_v, b_w, DOT_PRECISION: tl.constexpr):
    """state += phi(K_c)^T [V_c, 1], order by order (h2 and z2 without the 1/sqrt(2) of phi)."""
    b_h0 += tl.sum(b_v.to(tl.float32), axis=0)
    # [BK, BV]
    b_h1 += tl.dot(tl.trans(b_k).to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    # [BK * BK, BV]
    b_h2 += tl.dot(tl.trans(b_k2).to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    b_z0 += tl.sum(b_w.to(tl.float32), axis=0)
    b_z1 += tl.sum(b_k, axis=0)
    b_z2 += tl.sum(b_k2, axis=0)
    return b_h0, b_h1, b_h2, b_z0, b_z1, b_z2


@triton.jit(do_not_specialize=["T"])
def _prefix_linear_attention_fwd_kernel(
    q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, state_in, o, state_out,
    s_qb, s_qt, s_qh, s_qk,
    s_kb, s_kt, s_kh, s_kk,
    s_vb, s_vt, s_vh, s_vv,
    s_keb, s_ket, s_keh, s_kek,
    s_veb, s_vet, s_veh, s_vev,
    s_mb, s_mt,
    s_ob, s_ot, s_oh, s_ov,
    T, eps, key_scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_MASK: tl.constexpr, STRICT: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), (i_bh % H).to(tl.int64)
    F: tl.constexpr = 1 + K + K * K
    W: tl.constexpr = V + 1  # state row length: V numerator columns and the denominator column
    SQRT2: tl.constexpr = 1.4142135623730951

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # 2nd-order feature f = BK * i + j <-> state row 1 + K + K * i + j (only i, j < K exist).
    o_k2 = tl.arange(0, BK * BK)
    m_k2 = ((o_k2 // BK) < K) & ((o_k2 % BK) < K)
    r_k2 = 1 + K + (o_k2 // BK) * K + (o_k2 % BK)
    p_m = key_mask + i_b * s_mb

    # fp32 state; h2 and z2 hold sums of k' (x) k' without the 1/sqrt(2) of phi, applied on read and on write.
    b_h0 = tl.zeros([BV], dtype=tl.float32)
    b_h1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_h2 = tl.zeros([BK * BK, BV], dtype=tl.float32)
    b_z0 = tl.zeros([1], dtype=tl.float32)
    b_z1 = tl.zeros([BK], dtype=tl.float32)
    b_z2 = tl.zeros([BK * BK], dtype=tl.float32)
    p_state = i_bh.to(tl.int64) * F * W
    if HAS_INITIAL_STATE:
        p_s = state_in + p_state
        b_h0 += tl.load(p_s + o_v, mask=m_v, other=0.0)
        b_h1 += tl.load(p_s + (1 + o_k[:, None]) * W + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_h2 += tl.load(p_s + r_k2[:, None] * W + o_v[None, :], mask=m_k2[:, None] & m_v[None, :], other=0.0) * SQRT2
        b_z0 += tl.load(p_s + V + tl.zeros([1], dtype=tl.int32))
        b_z1 += tl.load(p_s + (1 + o_k) * W + V, mask=m_k, other=0.0)
        b_z2 += tl.load(p_s + r_k2 * W + V, mask=m_k2, other=0.0) * SQRT2

    # 1. Encoder reduction over the row's range [start, end) of the first M tokens: state updates only, no queries,
    #    no causal mask. Chunks are aligned on BT; positions outside the range weigh 0.
    b_start = tl.load(encoder_start + i_b)
    b_end = tl.load(encoder_end + i_b)
    p_ke = k_enc + i_b * s_keb + i_h * s_keh
    p_ve = v_enc + i_b * s_veb + i_h * s_veh
    o_c = tl.arange(0, BT)
    for i_t in range(b_start // BT, tl.cdiv(b_end, BT)):
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_e = (o_t >= b_start) & (o_t < b_end)
        b_k, b_v, b_w = _load_keys_values(
            p_ke, p_ve, p_m, o_t, m_e, m_e, s_ket, s_kek, s_vet, s_vev, s_mt, o_k, m_k, o_v, m_v, key_scale,
            HAS_MASK, STRICT, DOT_FP32,
        )
        b_h0, b_h1, b_h2, b_z0, b_z1, b_z2 = _accumulate(
            b_h0, b_h1, b_h2, b_z0, b_z1, b_z2, b_k, _outer(b_k, BT, BK), b_v, b_w, DOT_PRECISION
        )

    # 2. Causal chunk scan over the T decoder tokens, starting from the encoder state.
    p_q = q + i_b * s_qb + i_h * s_qh
    p_k = k + i_b * s_kb + i_h * s_kh
    p_v = v + i_b * s_vb + i_h * s_vh
    p_o = o + i_b * s_ob + i_h * s_oh
    for i_t in range(0, tl.cdiv(T, BT)):
        o_t = (i_t * BT + o_c).to(tl.int64)
        m_t = o_t < T
        # [BT, BK]
        b_q = _load_chunk(p_q, o_t, m_t, s_qt, o_k, m_k, s_qk).to(tl.float32) * key_scale
        b_k, b_v, b_w = _load_keys_values(
            p_k, p_v, p_m, o_t, m_t, (o_t >= b_start) & (o_t < b_end), s_kt, s_kk, s_vt, s_vv, s_mt,
            o_k, m_k, o_v, m_v, key_scale, HAS_MASK, STRICT, DOT_FP32,
        )
        # [BT, BK * BK]
        b_q2 = _outer(b_q, BT, BK)
        b_k2 = _outer(b_k, BT, BK)

        # inter-chunk: the state of everything before the chunk, encoder included. [BT, BV]
        b_o = b_h0[None, :] + tl.dot(b_q.to(b_v.dtype), b_h1.to(b_v.dtype), input_precision=DOT_PRECISION)
        b_o += 0.5 * tl.dot(b_q2.to(b_v.dtype), b_h2.to(b_v.dtype), input_precision=DOT_PRECISION)
        # [BT]
        b_z = b_z0 + tl.sum(b_q * b_z1[None, :], axis=1) + 0.5 * tl.sum(b_q2 * b_z2[None, :], axis=1)
        # intra-chunk: 1 + s + s^2 / 2 on the causal part, valid keys only. [BT, BT]
        b_s = tl.dot(b_q.to(b_v.dtype), tl.trans(b_k).to(b_v.dtype), input_precision=DOT_PRECISION)
        b_a = tl.where((o_c[:, None] >= o_c[None, :]) & b_w[None, :], 1.0 + b_s + 0.5 * b_s * b_s, 0.0)
        # [BT, BV]
        b_o += tl.dot(b_a.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_z += tl.sum(b_a, axis=1)
        # fp32 division; a row without any valid key gives 0 / (0 + eps) = 0.
        p_y = p_o + o_t[:, None] * s_ot + o_v[None, :] * s_ov
        tl.store(p_y, (b_o / (b_z[:, None] + eps)).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        b_h0, b_h1, b_h2, b_z0, b_z1, b_z2 = _accumulate(
            b_h0, b_h1, b_h2, b_z0, b_z1, b_z2, b_k, b_k2, b_v, b_w, DOT_PRECISION
        )

    # 3. Final state in the cache layout (B, H, F, V + 1); the denominator column is written once, by i_v = 0.
    p_s = state_out + p_state
    tl.store(p_s + o_v, b_h0, mask=m_v)
    tl.store(p_s + (1 + o_k[:, None]) * W + o_v[None, :], b_h1, mask=m_k[:, None] & m_v[None, :])
    tl.store(p_s + r_k2[:, None] * W + o_v[None, :], b_h2 / SQRT2, mask=m_k2[:, None] & m_v[None, :])
    if i_v == 0:
        tl.store(p_s + V + tl.zeros([1], dtype=tl.int32), b_z0)
        tl.store(p_s + (1 + o_k) * W + V, b_z1, mask=m_k)
        tl.store(p_s + r_k2 * W + V, b_z2 / SQRT2, mask=m_k2)


# TRITON_INTERPRET=1 when this module is first imported makes `triton.jit` return the CPU interpreter's function.
INTERPRETED = isinstance(_prefix_linear_attention_fwd_kernel, InterpretedFunction)
# JRT_TRITON_AUTOTUNE=0 keeps the first GPU config only (quick compiled test runs; no tuning at first call).
AUTOTUNE = os.environ.get("JRT_TRITON_AUTOTUNE", "1") != "0"
_prefix_linear_attention_fwd_kernel = triton.autotune(
    configs=_INTERPRETER_CONFIGS if INTERPRETED else (_GPU_CONFIGS if AUTOTUNE else _GPU_CONFIGS[:1]),
    key=["K", "V"],
)(_prefix_linear_attention_fwd_kernel)


PAD_MASKINGS = ("strict", "reference")  # as in modeling_jrt.linear_attention (this module imports no modeling_jrt)


@torch.library.triton_op("jrt_kernels::prefix_linear_attention_fwd", mutates_args=())
def _prefix_linear_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_enc: torch.Tensor | None,
    v_enc: torch.Tensor | None,
    encoder_start: torch.Tensor,
    encoder_end: torch.Tensor,
    key_mask: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    strict: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel on validated inputs (any strides). Returns `(o (B, T, H, V) in v.dtype, state fp32)`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    state = torch.empty(B, H, 1 + K + K * K, V + 1, dtype=torch.float32, device=v.device)
    # Absent optional tensors: never read (empty encoder ranges, HAS_MASK / HAS_INITIAL_STATE False).
    k_enc = k if k_enc is None else k_enc
    v_enc = v if v_enc is None else v_enc
    mask = q if key_mask is None else key_mask.view(torch.uint8)
    initial_state = None if initial_state is None else initial_state.contiguous()  # small: 70 KB per (b, h)
    mask_strides = (0, 0) if key_mask is None else mask.stride()

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), B * H)

    torch.library.wrap_triton(_prefix_linear_attention_fwd_kernel)[grid](
        q, k, v, k_enc, v_enc, encoder_start, encoder_end, mask,
        state if initial_state is None else initial_state, o, state,
        *q.stride(), *k.stride(), *v.stride(), *k_enc.stride(), *v_enc.stride(), *mask_strides, *o.stride(),
        T, eps, K**-0.25,
        H=H, K=K, V=V, BK=max(16, triton.next_power_of_2(K)),
        HAS_MASK=key_mask is not None, STRICT=strict, HAS_INITIAL_STATE=initial_state is not None,
        # Matmul operands are cast to the input dtype, except in the interpreter with bf16 (triton 3.9 multiplies
        # the raw uint16 bits there): fp32 operands, i.e. the same loads and stores with exact products.
        DOT_FP32=v.dtype == torch.float32 or (INTERPRETED and v.dtype == torch.bfloat16),
        DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32",
    )
    return o, state


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused prefill of prefix linear attention (JRT-RNN) or, with `k_enc = v_enc = None`, causal Based attention.

    The keyword signature and the results of `modeling_jrt.linear_attention.prefix_linear_attention_chunked` (its
    reference), forward only. Call it through `prefix_linear_attention(..., implementation="triton")`, which checks
    the arguments (`validate_linear_attention_inputs`: shapes, the encoder range) and passes them normalised; this
    function only asserts them. Inputs may be any strided views (e.g. heads split from a fused projection).

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
        log_decay, gate: the Based decay variant; not supported by the kernel (must be None).
        eps: added to the fp32 denominator.

    Returns:
        `(output (B, T, H, V) in v's dtype, final state (B, H, F, V + 1) fp32)`.

    Raises:
        ValueError: what the kernel does not support (decay, gate, dtype, device) with the way out.
        RuntimeError: a gradient is required (the kernel has no backward).
    """
    if log_decay is not None or gate is not None:
        raise ValueError(
            "The Triton prefill kernel does not implement the Based decay (log_decay) or gate: use "
            "implementation='chunked' (implementation='auto' does so automatically)."
        )
    B, T, H, K = q.shape
    M = 0 if k_enc is None else k_enc.shape[1]
    assert pad_masking in PAD_MASKINGS and k.shape == q.shape and v.shape[:3] == q.shape[:3] and M <= T
    assert key_mask is None or (key_mask.dtype == torch.bool and key_mask.shape == (B, T))
    if encoder_start is None or k_enc is None:
        encoder_start = torch.zeros(B, dtype=torch.long, device=q.device)
    if encoder_end is None or k_enc is None:
        encoder_end = torch.full((B,), M, dtype=torch.long, device=q.device)
    assert encoder_start.shape == encoder_end.shape == (B,) and encoder_start.dtype == encoder_end.dtype == torch.long
    inputs = [t for t in (q, k, v, k_enc, v_enc) if t is not None]
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in inputs):
        raise ValueError(
            f"The Triton prefill kernel takes fp32, bf16 or fp16 inputs of one dtype; got "
            f"{sorted({str(t.dtype) for t in inputs})}. Cast them, or use implementation='chunked' (fp64 works there)."
        )
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise ValueError(f"The Triton prefill kernel keeps its state in fp32; got an {initial_state.dtype} initial_state.")
    tensors = [t for t in (*inputs, key_mask, initial_state, encoder_start, encoder_end) if t is not None]
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"All inputs must be on one device; got {sorted({str(t.device) for t in tensors})}.")
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"The Triton prefill kernel runs on CUDA tensors (got {q.device}); on CPU use implementation='chunked', "
            "or set TRITON_INTERPRET=1 before importing triton to run it in the interpreter (tests)."
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            "The Triton prefill kernel has no backward: use implementation='chunked' (or 'auto') when gradients "
            "are needed, or run under torch.no_grad()."
        )
    return _prefix_linear_attention_fwd(
        q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, initial_state, pad_masking == "strict", float(eps)
    )


__all__ = ["prefix_linear_attention_triton"]
