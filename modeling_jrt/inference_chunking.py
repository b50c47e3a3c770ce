"""Inference-time token chunking: how many positions a position-wise op takes at once when autograd is off and
nothing is traced (docs/performance.md, "Layers in token chunks"): a long prefill's `(B, T, width)` intermediates
stay within a budget of elements per chunk, `INFERENCE_CHUNK_ELEMENTS` on a CPU, `ACCELERATOR_CHUNK_ELEMENTS` on an
accelerator (whose caching allocator reuses blocks: small chunks would only add launches).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INFERENCE_CHUNK_ELEMENTS = 1 << 21
ACCELERATOR_CHUNK_ELEMENTS = 1 << 27
MIN_INFERENCE_CHUNK = 64


def inference_chunk_rows(rows: int, width: int, device: torch.device) -> int | None:
    """Rows per chunk for `rows` positions on `device` whose widest intermediate has `width` elements per row, or None
    when the op runs unchunked (autograd on, `torch.compile` tracing, or `rows` fits one chunk of the budget)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    budget = INFERENCE_CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    chunk = max(MIN_INFERENCE_CHUNK, budget // max(width, 1))
    return chunk if rows > chunk else None


def map_position_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor, width: int
) -> torch.Tensor:
    """`fn(hidden_states)` for a position-wise `fn` (each output row depends on its own input row only), computed over
    row chunks of `hidden_states` `(..., C)` viewed as `(rows, C)` when `inference_chunk_rows` says so; the rows land
    in one preallocated output `(..., C_out)`. `width`: the widest intermediate of `fn` per row, in elements."""
    rows = hidden_states.numel() // max(hidden_states.shape[-1], 1)
    chunk = inference_chunk_rows(rows, width, hidden_states.device)
    if chunk is None:
        return fn(hidden_states)
    flat = hidden_states.reshape(rows, hidden_states.shape[-1])
    output = None
    for start in range(0, rows, chunk):
        part = fn(flat[start : start + chunk])
        if output is None:
            output = part.new_empty(rows, part.shape[-1])
        output[start : start + chunk] = part
    return output.view(*hidden_states.shape[:-1], output.shape[-1])


__all__ = [
    "ACCELERATOR_CHUNK_ELEMENTS", "INFERENCE_CHUNK_ELEMENTS", "MIN_INFERENCE_CHUNK", "inference_chunk_rows",
    "map_position_chunks",
]
