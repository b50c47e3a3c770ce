"""Prefix linear attention (JRT-RNN) and causal linear attention (Based) with the 2nd-order Taylor feature map.

The function, its math and the recurrent state, one fp32 tensor `(B, H, F, V + 1)` per layer (F = 1 + K + K**2
Taylor features; the encoder sum included, so decoding is the same for both kinds): docs/prefill.md §1-3 and
docs/reference_architecture.md §1.3-1.5. Without k_enc / v_enc (M = 0) it is causal Based attention.

The encoder range (per row): row b's encoder reads the positions `encoder_start[b] <= m < encoder_end[b]` of k_enc /
v_enc, the first M positions of the sequence (`0 <= start <= end <= M <= T`), so rows can have different prefixes.
Without a range every row reads all M encoder positions.

Padding: `key_mask` `(B, T)` marks real tokens. A masked key outside the row's encoder range (batch padding) never
contributes. A masked key inside it (the JRT prefix fill) is removed as `pad_masking` says: `"strict"` zeroes phi(k)
*after* the feature map (phi(0) is not 0); `"reference"` zeroes the raw key *before* it, as the original code does,
so the pad still adds its value with weight 1 (the reference's leak, docs/reference_architecture.md §2.1).

Layouts: `LinearAttentionInputs` (`linear_attention_inputs.py`), checked once for every implementation.

Implementations, chosen by `kernel_choice.py`, one file each: "quadratic" the O(T^2) oracle of the tests
(`linear_attention_naive.py`), "chunked" the O(T) scan in PyTorch (`linear_attention_chunk.py`), "triton" the fused
kernel of `jrt_kernels` (`linear_attention_fused.py`). The decode step: `linear_attention_recurrent.py`.
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

    q, k, v, k_enc, v_enc and `**options` (by name) are the fields of `LinearAttentionInputs`; `implementation`:
    `"auto"`, `"chunked"`, `"triton"` or `"quadratic"`, or the caller's `KernelChoice`. Returns `(output (B, T, H, V)
    in v's dtype, final state (B, H, F, V + 1) in fp32)`.
    """
    inputs = validate_linear_attention_inputs(q, k, v, k_enc, v_enc, **options)
    choice = KernelChoice.of(implementation)
    chosen = choice.linear_attention(q.device)
    if 0 in q.shape[:2]:
        return empty_prefill(inputs)  # no rows or no tokens: nothing to scan or launch a kernel for
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
    """Chunked scan, `prefix_linear_attention(..., implementation="chunked")`: O(T) time, differentiable
    (`chunked_scan.py`; with autograd or under torch.compile the custom op of `chunked_scan_autograd.py`)."""
    return prefix_linear_attention(*args, **kwargs, implementation="chunked")


__all__ = [
    "LinearAttentionInputs", "fixed_log_decay", "linear_attention_step", "linear_attention_step_at_slots",
    "num_taylor_features", "prefix_linear_attention", "prefix_linear_attention_chunked",
    "prefix_linear_attention_quadratic", "taylor_feature_map", "validate_linear_attention_inputs",
]
