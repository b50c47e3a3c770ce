"""Prefix linear attention (JRT-RNN) and causal linear attention (Based) with the 2nd-order Taylor feature map.

Math (docs/reference_architecture.md §1.3-1.5; the algorithms and numerics: docs/prefill.md). For per-head
queries/keys of dimension K (the feature dim, 16 in the released models) the Taylor feature map is

    phi(x) = [1, x / K**(1/4), vec(x x^T) / (sqrt(2) sqrt(K))]        (F = 1 + K + K**2 features)

so that phi(q) . phi(k) = 1 + s + s**2 / 2 with s = q . k / sqrt(K); every weight is >= 1/2.

Prefix linear attention reads the first M tokens twice: once non-causally through separate encoder keys and
values (k_enc, v_enc) and once causally with the decoder keys and values (k, v). With one shared denominator:

    y_i = [sum_{m<M} phi(q_i).phi(ke_m) ve_m + sum_{j<=i} phi(q_i).phi(k_j) v_j]
          / [sum_{m<M} phi(q_i).phi(ke_m)    + sum_{j<=i} phi(q_i).phi(k_j)    + eps]

    query i \\ key:  encoder keys (m < M)    decoder keys j
                     e e e e                 x . . . . .
                     e e e e                 x x . . . .       every query sees the whole encoder,
                     e e e e                 x x x . . .       and the decoder keys causally
                     e e e e                 x x x x . .

M = 0 gives causal Based linear attention. The Based decay variant (based-360M-30B) multiplies the numerator
weights by gamma_h**(i-j) and by an input-dependent gate g_{i,h}; its denominator has neither.

Recurrent state (shared by every implementation and stored in the generation cache), fp32 whatever the model dtype:

    state[b, h, :, :V] = sum_j phi(k_j) v_j^T   (decayed when a decay is set)      shape (B, H, F, V)
    state[b, h, :, V]  = sum_j phi(k_j)          (never decayed)                     shape (B, H, F)

i.e. one tensor of shape (B, H, F, V + 1), with the encoder sum included. Decoding is then
    state <- state (decayed) + phi(k_t) [v_t, 1];  y_t = g_t phi(q_t).state[:, :V] / (phi(q_t).state[:, V] + eps).

The encoder range (per row). Row b's encoder reads the positions `encoder_start[b] <= m < encoder_end[b]` of k_enc /
v_enc, which cover the first M positions of the same sequence (`0 <= start <= end <= M <= T`). The rows of a batch
can so have different prefixes: a left-padded row starts after its padding, a scored row ends where its context
ends. Without a range every row reads all M encoder positions. Positions outside the range are no encoder keys.

Padding: `key_mask` `(B, T)` marks real tokens (its first M columns also describe the encoder positions). A masked
key outside the row's encoder range (batch padding, which lies before the range or after the row) never contributes.
A masked key inside the range (the fill of the JRT prefix) is removed as `pad_masking` says:
`"strict"` removes it (phi(k) is zeroed *after* the feature map: phi(0) is not 0, its constant term is 1); with
`"reference"` the raw key is zeroed *before* the feature map as the original code does, so the pad still adds its
value with weight 1, to the encoder and to the decoder sums (the leak of the reference,
docs/reference_architecture.md §2.1).

Layouts at every function boundary: q, k `(B, T, H, K)`, v and outputs `(B, T, H, V)`, encoder tensors
`(B, M, H, K)` / `(B, M, H, V)` for the first M tokens, encoder_start / encoder_end `(B,)` int64, key_mask `(B, T)`
bool (True = real token), gate `(B, T, H)`, log_decay `(H,)` = log gamma. `validate_linear_attention_inputs` checks
them once for every implementation and makes the immutable `LinearAttentionInputs` they take
(`linear_attention_inputs.py`; the Triton kernel too: the dispatcher validates before it calls the kernel).

Implementations behind `prefix_linear_attention(..., implementation=...)` (a name, or the `KernelChoice` of the
model that calls: `kernel_choice.py` is the one place that decides, and remembers a kernel that failed), one file
each, all taking the validated `LinearAttentionInputs` (`linear_attention_inputs.py`):
    "quadratic"  materialises the (T, T) weights and the full feature map: the oracle of the tests (use fp64;
                 `linear_attention_naive.py`).
    "chunked"    O(T) time, O(block x state) working memory chunked scan in PyTorch (`linear_attention_chunk.py`,
                 `chunked_scan.py`); the encoder sum is its initial state; with autograd and under torch.compile one
                 custom op with an explicit backward (`chunked_scan_autograd.py`).
    "triton"     the fused GPU kernel of `jrt_kernels` (optional dependency; forward and backward, decay and gate;
                 `linear_attention_fused.py`).
    "auto"       "triton" on CUDA tensors when the kernels are installed, else "chunked"; a kernel that fails to
                 compile or launch on the device (forward or backward) warns once and the call (and every later one
                 of the same choice) runs "chunked" (a failed backward: its gradients are those of the chunked path).
The decode step from the state: `linear_attention_recurrent.py`; the feature map: `feature_map.py`.
"""

from __future__ import annotations

import functools

import torch

from .feature_map import num_taylor_features, taylor_feature_map
from .kernel_choice import LINEAR_ATTENTION, KernelChoice
from .linear_attention_chunk import chunked_prefill, empty_prefill
from .linear_attention_fused import fused_prefill
from .linear_attention_inputs import LinearAttentionInputs, fixed_log_decay, validate_linear_attention_inputs
from .linear_attention_naive import quadratic_prefill
from .linear_attention_recurrent import linear_attention_step, linear_attention_step_at_slots


def prefix_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_enc: torch.Tensor | None = None,
    v_enc: torch.Tensor | None = None,
    *,
    implementation: str | KernelChoice = "auto",
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of prefix (JRT-RNN) or causal (Based, `k_enc = v_enc = None`) linear attention.

    Args:
        q, k: `(B, T, H, K)` decoder queries and keys; v: `(B, T, H, V)` decoder values.
        k_enc, v_enc: `(B, M, H, K)` / `(B, M, H, V)` encoder keys and values of the first M <= T tokens, or None.
        implementation: `"auto"`, `"chunked"`, `"triton"` or `"quadratic"`, or the `KernelChoice` of the caller (a
            model's: it remembers a kernel that failed); see `kernel_choice.py`.
        **options: the other fields of `LinearAttentionInputs`, by name: `encoder_start`, `encoder_end` (each row's
            encoder range), `key_mask`, `pad_masking`, `initial_state`, `log_decay`, `gate`, `eps`, `chunk_size`.

    Returns:
        `(output (B, T, H, V) in v's dtype, final state (B, H, F, V + 1) in fp32)`.
    """
    inputs = validate_linear_attention_inputs(q, k, v, k_enc, v_enc, **options)
    choice = KernelChoice.of(implementation)
    chosen = choice.linear_attention(q.device)
    if inputs.is_empty:
        return empty_prefill(inputs)  # nothing to scan or launch a kernel for
    # The inputs are validated: the implementations below start at their work (no second check).
    if chosen == "quadratic":
        return quadratic_prefill(inputs)
    run_chunked = functools.partial(chunked_prefill, inputs)
    if chosen == "triton":
        return choice.run(LINEAR_ATTENTION, fused_prefill(choice, inputs), run_chunked)
    return run_chunked()


def prefix_linear_attention_quadratic(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The O(T^2) oracle, `prefix_linear_attention(..., implementation="quadratic")`: materialises phi (F features)
    and the (T, T) weights. Tests only; pass fp64 inputs (the state is then fp64 too)."""
    return prefix_linear_attention(*args, **kwargs, implementation="quadratic")


def prefix_linear_attention_chunked(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan, `prefix_linear_attention(..., implementation="chunked")`: O(T) time, differentiable.

    Per chunk of C tokens (docs/prefill.md §4.2):

        inter-chunk  o_c  = phi(Q_c) @ state                         everything before the chunk (and the encoder)
        intra-chunk  o_c += tril(1 + S + S**2 / 2) @ [V_c, 1]          S = Q_c K_c^T / sqrt(K): no (C, F) features
        update       state += phi(K_c)^T @ [V_c, 1]

    The encoder sum over each row's encoder range is the initial state. The features are the compact ones of
    `compact_taylor.CompactTaylor` (153 instead of 273 rows for K = 16); the state is returned in the full layout.
    Two executions of the same scan:

    - without autograd (inference), eagerly: `chunked_scan.scan_in_place`, blocks of chunks in one reused
      workspace, the state read and updated chunk by chunk (the Based decay included);
    - with autograd, or under torch.compile: the custom op `chunked_scan_autograd.scan`, whose forward is the same
      scan and whose backward is explicit (two sweeps over the chunks, keeping only the output and one denominator
      per token for the backward pass; docs/prefill.md §4.4). A compiled graph holds the op as one node whatever T
      is: compile time and memory do not depend on T, and `dynamic=True` does not recompile for a new length.
    """
    return prefix_linear_attention(*args, **kwargs, implementation="chunked")


__all__ = [
    "LinearAttentionInputs",
    "fixed_log_decay",
    "linear_attention_step",
    "linear_attention_step_at_slots",
    "num_taylor_features",
    "prefix_linear_attention",
    "prefix_linear_attention_chunked",
    "prefix_linear_attention_quadratic",
    "taylor_feature_map",
    "validate_linear_attention_inputs",
]
