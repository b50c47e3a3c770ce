"""Sliding-window softmax attention in O(T * W) time and memory: the blocked prefill of the `sliding_attention` layers.

A query at position t sees the keys at positions t - W + 1 ... t (W = `sliding_window`, itself included), minus the
padding keys. Instead of all T x S scores, the queries are cut into blocks of `block` rows, and block i reads only
the slab of `block + W - 1` keys that its rows can see:

    keys (aligned)  | W-1 keys before the first query | keys of the T queries ... |
    block 0 slab    [<------ block + W - 1 ------>]
    block 1 slab                 [<------ block + W - 1 ------>]      (step: block)
    inside a slab, row r (query i*block + r) sees slab columns r ... r + W - 1 (both ends inclusive)

The only mask is a `(block, block + W - 1)` band plus the per-key padding, and the slabs are a strided view
(`Tensor.unfold`) of the keys. Letters: B batch, H heads, T queries, S keys, D head dim, W window, N number of
blocks, Q block rows, L slab length = Q + W - 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCKED_IMPLEMENTATIONS = ("eager", "sdpa")
"""`config._attn_implementation` values whose prefill runs `blocked_sliding_window_attention`."""

MIN_BLOCK_SIZE = 64
"""Smallest query block: tiny windows (1 ... 4) would otherwise give thousands of one-row matmuls."""


def default_block_size(sliding_window: int) -> int:
    """Query rows per block: `max(64, W // 2)`. A query scores `Q + W - 1` keys (W useful) and the slabs hold
    `T * (1 + (W - 1) / Q)` keys: Q = W / 2 keeps both within 3x of the minimum, 64 rows keep the matmuls large."""
    return max(MIN_BLOCK_SIZE, sliding_window // 2)


def _fold_blocks(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, Q, D) -> (B * N, H, Q, D): the fused SDPA kernels take 4D inputs only."""
    batch_size, num_heads, num_blocks, rows, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch_size * num_blocks, num_heads, rows, head_dim)


def blocked_sliding_window_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None, *,
    sliding_window: int, scaling: float, implementation: str = "sdpa", block_size: int | None = None,
) -> torch.Tensor:
    """Sliding-window attention of T queries over the S >= T keys that end with their own, in query blocks.

    Equal (up to rounding) to softmax attention with the mask `kv_position in (q_position - W, q_position]` and
    `key_mask`, at O(T * (Q + W)) cost. One query (a decode step) goes to `_one_query_attention`.

    Args:
        query: `(B, H, T, D)`; key, value: `(B, H, S, D)`, the `S - T` cached keys first.
        key_mask: `(B, S)` bool, False for padding keys, or None. sliding_window: W. scaling: the softmax scale.
        implementation: `"sdpa"` (`F.scaled_dot_product_attention` per block) or `"eager"` (matmul + softmax).
        block_size: query rows per block; default `default_block_size(W)` (at most T).

    Returns `(B, T, H, D)` in the query's dtype; a query whose window holds only padding (don't-care) gets the mean of
    its window's values instead of NaN.
    """
    if implementation not in BLOCKED_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not blocked; use one of {BLOCKED_IMPLEMENTATIONS}.")
    batch_size, num_heads, query_length, head_dim = query.shape
    window = sliding_window
    if query_length == 1:  # a decode step: the last W keys, no band and no blocks
        return _one_query_attention(query, key, value, key_mask, window, scaling, implementation)
    padded = key_mask is not None  # without padding every query sees at least itself
    key_mask = torch.ones(1, key.shape[2], dtype=torch.bool, device=key.device) if key_mask is None else key_mask.bool()
    # Exactly W - 1 keys before the first query: drop those no query can see, or pad invalid keys in front. key, value
    # (B, H, T + W - 1, D), key_mask (B', T + W - 1), B' in {1, B}.
    lead = window - 1 - (key.shape[2] - query_length)  # keys before the first query: the cached window
    if lead < 0:  # more history than any query can see
        key, value, key_mask = key[:, :, -lead:], value[:, :, -lead:], key_mask[:, -lead:]
    elif lead > 0:
        key, value = F.pad(key, (0, 0, lead, 0)), F.pad(value, (0, 0, lead, 0))
        key_mask = F.pad(key_mask, (lead, 0), value=False)

    # 1. Blocks of Q query rows; the last one is padded at the end (its extra rows are cut off at the end).
    rows = min(query_length, block_size or default_block_size(window))
    num_blocks = -(-query_length // rows)
    tail = num_blocks * rows - query_length
    slab = rows + window - 1
    if tail:
        query = F.pad(query, (0, 0, 0, tail))
        key, value = F.pad(key, (0, 0, 0, tail)), F.pad(value, (0, 0, 0, tail))
        key_mask = F.pad(key_mask, (0, tail), value=True)  # seen only by the cut-off rows
    query = query.view(batch_size, num_heads, num_blocks, rows, head_dim)  # (B, H, N, Q, D)
    key = key.unfold(2, slab, rows).transpose(-1, -2)  # (B, H, N, L, D), a strided view
    value = value.unfold(2, slab, rows).transpose(-1, -2)  # (B, H, N, L, D)

    # 2. Mask: the band r <= column <= r + W - 1, and the key's padding. A row with no visible key (a left pad)
    # attends to its whole slab rather than producing NaN (only padding can empty a row: each query sees itself).
    column = torch.arange(slab, device=query.device)
    row = torch.arange(rows, device=query.device)[:, None]
    band = (column >= row) & (column < row + window)  # (Q, L)
    mask = band & key_mask.unfold(1, slab, rows)[:, :, None, :]  # (B', N, Q, L)
    if padded:
        mask = mask | ~mask.any(-1, keepdim=True)

    # 3. Attention inside each block.
    if implementation == "sdpa":
        mask = mask.expand(batch_size, -1, -1, -1).reshape(-1, 1, rows, slab)  # (B * N, 1, Q, L)
        output = F.scaled_dot_product_attention(
            _fold_blocks(query), _fold_blocks(key), _fold_blocks(value), attn_mask=mask, scale=scaling
        )  # (B * N, H, Q, D)
        output = output.view(batch_size, num_blocks, num_heads, rows, head_dim).transpose(1, 2)  # (B, H, N, Q, D)
    else:
        output = _masked_attention(query, key, value, mask[:, None], scaling)  # (B, H, N, Q, D)
    output = output.reshape(batch_size, num_heads, num_blocks * rows, head_dim)[:, :, :query_length]
    return output.transpose(1, 2).contiguous()  # (B, T, H, D)


def _one_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None, window: int,
    scaling: float, implementation: str,
) -> torch.Tensor:
    """`blocked_sliding_window_attention` for one query (a decode step): softmax attention over the last `W` keys minus
    the padding keys, in a handful of ops. q `(B, H, 1, D)`, k / v `(B, H, S, D)`, key_mask `(B, S)` or None ->
    `(B, 1, H, D)`. A query whose keys are all padding (don't-care) attends to all of them instead of NaN."""
    key, value = key[:, :, -window:], value[:, :, -window:]
    mask = None
    if key_mask is not None:
        mask = key_mask[:, -window:].bool()
        mask = (mask | ~mask.any(-1, keepdim=True))[:, None, None, :]  # (B, 1, 1, S')
    if implementation == "sdpa":
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)  # (B, H, 1, D)
    else:
        output = _masked_attention(query, key, value, mask, scaling)  # (B, H, 1, D)
    return output.transpose(1, 2)  # (B, 1, H, D): a size-1 dim moved, so as contiguous as SDPA's output


def _masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """The "eager" attention of the blocked and one-query paths: q `(..., Q, D)`, k / v `(..., L, D)`, a bool mask
    that broadcasts to the `(..., Q, L)` scores (True = visible) or None -> `(..., Q, D)`; softmax in fp32."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def eager_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with an additive (B, 1, T, S) mask. q (B, H, T, D), k/v (B, H, S, D) -> (B, T, H, D)."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return output, weights


def sliding_window_additive_mask(
    key_mask: torch.Tensor | None, query_length: int, key_length: int, sliding_window: int, dtype: torch.dtype
) -> torch.Tensor:
    """The `(B or 1, 1, T, S)` additive mask of T queries that are the last T of S keys: query i (at key position
    `S - T + i`) sees keys `j` with `0 <= S - T + i - j < sliding_window` that are not padding."""
    query_positions = torch.arange(key_length - query_length, key_length)[:, None]
    key_positions = torch.arange(key_length)[None, :]
    distance = query_positions - key_positions
    allowed = ((distance >= 0) & (distance < sliding_window))[None, None]  # (1, 1, T, S)
    if key_mask is not None:
        allowed = allowed.to(key_mask.device) & key_mask[:, None, None, :]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


__all__ = [
    "BLOCKED_IMPLEMENTATIONS", "blocked_sliding_window_attention", "default_block_size", "eager_attention_forward",
    "sliding_window_additive_mask",
]
