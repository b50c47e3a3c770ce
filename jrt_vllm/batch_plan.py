"""How one vLLM forward maps onto the layers of `jrt_vllm.model`: which rows are O(1) decode steps, which are read in
one pass (a prompt, with the JRT prefix fill in front), and at which state slot each request lives.

Two kinds of forward (docs/serving.md, "CUDA graphs"): **decode-only** (`DECODE_STEP`), nothing planned on the host:
each mixer runs its batched step at the slots of the metadata's device tensor (`decode_slots`), with no host sync;
**any other** (`BatchPlan`, from `plan_batch`, which reads the query bounds on the host): the prefill requests read
in groups of segments of one shape (one call of each mixer per group), the decoding requests in one step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

# A request's first-forward tokens `(T,)` and its original prompt length (None: all T are prompt) -> the tokens with
# the JRT fill in front, the rows its encoder reads, and its linear attention's key mask (`JRTRNNForCausalLM.fill`).
Fill = Callable[[torch.Tensor, "int | None"], "tuple[torch.Tensor, int, torch.Tensor | None]"]


class DecodeStep:
    """The plan of a decode-only forward (module docstring): it carries nothing, as what each row reads is in vLLM's
    metadata on the device."""

    def __repr__(self) -> str:
        return "DECODE_STEP"


DECODE_STEP = DecodeStep()


class ForwardPlan:
    """The plan of the forward in progress, set by `JRTRNNForCausalLM.forward` and read by every mixer, outside any
    traced graph: `DECODE_STEP`, a `BatchPlan`, or None in a forward without metadata (vLLM's profiling run)."""

    plan: BatchPlan | DecodeStep | None = None


@dataclass
class Segment:
    """The tokens of one request that are read in one pass (a prompt, or any forward that is not an O(1) step).

    Attributes:
        request: index of the request in vLLM's batch order (decodes first), to look up its state slot.
        start, end: its rows in the expanded batch (fill included).
        fresh: the first forward of the request (no state yet: the encoder reads and the states start empty).
        encoder_rows: rows the JRT encoder reads from `start` (the fill and the prompt's first tokens, as
            `modeling_jrt.prefix_fill.plan_prefix` lays them out); 0 when nothing is read non-causally.
        key_mask: `(end - start,)` False at the keys the linear attention ignores (the `"pad"` fill:
            `fill_prefix`'s `linear_attention_mask`), or None when it ignores none.
    """

    request: int
    start: int
    end: int
    fresh: bool
    encoder_rows: int | None = None
    key_mask: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, bool, int | None]:
        """What must agree for segments to be read as the rows of one batch: length, freshness, encoder rows (the
        fill may differ: it only decides which keys the "pad" strategy masks, row by row: `key_mask`)."""
        return self.end - self.start, self.fresh, self.encoder_rows


@dataclass
class SegmentGroup:
    """Segments of one shape (`Segment.shape`), read together: G requests of T rows each, stacked as a `(G, T)` batch,
    so that each mixer runs once per group. With the "pad" and "repeat" fills the short fresh prompts of a prefill
    all become `prefix_length` rows, one group.

    Attributes:
        requests: the G requests (indices in vLLM's batch order).
        index: the same, to pick their slots from `slot_table` (`selector`).
        rows: their `G * T` rows in the expanded batch, request after request (`selector`).
        key_mask: `(G, T)` the segments' `key_mask`s (all True for a segment without one), or None when no segment
            has one.
        length, fresh, encoder_rows: the shared shape (see `Segment`).
    """

    requests: list[int]
    index: slice | torch.Tensor
    rows: slice | torch.Tensor
    key_mask: torch.Tensor | None
    length: int
    fresh: bool
    encoder_rows: int | None = None

    @classmethod
    def of(cls, segments: list[Segment], device: torch.device) -> SegmentGroup:
        """The group of `segments` (all of one shape, in batch order)."""
        length, fresh, encoder_rows = segments[0].shape
        requests = [s.request for s in segments]
        rows = selector([row for s in segments for row in range(s.start, s.end)], device)
        key_mask = None
        if any(s.key_mask is not None for s in segments):
            every_key = torch.ones(length, dtype=torch.bool, device=device)
            key_mask = torch.stack([every_key if s.key_mask is None else s.key_mask for s in segments])
        return cls(requests, selector(requests, device), rows, key_mask, length, fresh, encoder_rows)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """`(N, w)` rows of the expanded batch -> this group's `(G, T, w)`."""
        taken = rows[self.rows] if isinstance(self.rows, slice) else rows.index_select(0, self.rows)
        return taken.view(len(self.requests), self.length, rows.shape[-1])

    def put(self, rows: torch.Tensor, output: torch.Tensor) -> None:
        """Write this group's `(G, T, w)` output into its `(N, w)` rows of the expanded batch (`take`'s inverse)."""
        output = output.reshape(-1, rows.shape[-1])
        if isinstance(self.rows, slice):
            rows[self.rows] = output
        else:
            rows.index_copy_(0, self.rows, output)


@dataclass
class BatchPlan:
    """How one vLLM forward maps onto the layers.

    Attributes:
        decode_requests: requests that read one token on top of their state (the batched O(1) step), in order.
        decode_index: the same, to pick their slots from `slot_table` (`selector`).
        decode_rows: their rows in the expanded batch (`selector`: a slice, as vLLM puts the decodes first).
        groups: every other request, in groups of segments of one shape, each read in one pass.
        input_rows: `(num_actual_tokens,)` the expanded row of each of vLLM's tokens.
    """

    decode_requests: list[int]
    decode_index: slice | torch.Tensor
    decode_rows: slice | torch.Tensor
    groups: list[SegmentGroup]
    input_rows: torch.Tensor


def slot_table(metadata) -> torch.Tensor:
    """`(requests,)` int64: the state slot of every request of this forward, in batch order (decodes first), for one
    layer group; read on the device, from vLLM's metadata tensors."""
    parts = []
    if metadata.num_decodes > 0:
        parts.append(_slot_column(metadata.state_indices_tensor_d)[: metadata.num_decodes])
    if metadata.num_prefills > 0:
        parts.append(_slot_column(metadata.state_indices_tensor_p)[: metadata.num_prefills])
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).long()


def _slot_column(indices: torch.Tensor) -> torch.Tensor:
    """vLLM's state indices `(requests,)` or `(requests, 1 + speculative blocks)` -> each request's slot `(requests,)`
    (the first column)."""
    return indices[:, 0] if indices.dim() > 1 else indices


def selector(indices: list[int], device: torch.device) -> slice | torch.Tensor:
    """Positions to select: a slice when they are consecutive (a view), else an int64 tensor on `device`."""
    first = indices[0] if indices else 0
    if indices == list(range(first, first + len(indices))):
        return slice(first, first + len(indices))
    return torch.tensor(indices, dtype=torch.long, device=device)


def forward_metadata(layer_name: str | None = None):
    """The metadata of layer `layer_name` in the forward in progress, or of any of its layers when None (all agree on
    the batch's requests); None in a forward without metadata (vLLM's profiling run)."""
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict) or not metadata:
        return None
    return next(iter(metadata.values())) if layer_name is None else metadata.get(layer_name)


def is_decode_only(metadata) -> bool:
    """Whether every request of the forward reads one token on top of its state. vLLM's state backends count a
    request as a prefill when it has no state yet (a one-token prompt included), so a forward without prefills holds
    decode steps only (and the rows vLLM pads it with)."""
    return metadata.num_prefills == 0 and metadata.num_decodes > 0


def decode_slots(metadata, rows: int) -> torch.Tensor:
    """`(rows,)` int64: the state slot of each row of a decode-only forward, read on the device. Rows past vLLM's
    slots (a batch padded to a CUDA graph's size) point at its null block (`NULL_BLOCK_ID`, a slot no request owns)."""
    slots = _slot_column(metadata.state_indices_tensor_d)[:rows].long()
    if slots.shape[0] < rows:
        slots = F.pad(slots, (0, rows - slots.shape[0]), value=NULL_BLOCK_ID)
    return slots


def plan_batch(input_ids: torch.Tensor, metadata, fill: Fill,
               prompt_lengths: dict[int, int] | None) -> tuple[torch.Tensor, BatchPlan]:
    """The expanded ids `(rows,)` (each fresh request's fill in front of its tokens) and the plan of a forward that is
    not decode-only.

    Args:
        input_ids: `(N,)` vLLM's flattened batch, decodes first.
        metadata: one layer's metadata (`forward_metadata`).
        fill: the model's prefix fill of a request's first forward (`Fill`).
        prompt_lengths: each request's original prompt length by its place in the batch (`jrt_vllm.prompt_lengths`),
            or None; a preempted request is recomputed with the encoder reading its original prompt's prefix.
    """
    num_decodes, num_prefills = metadata.num_decodes, metadata.num_prefills
    seq_lens = metadata.seq_lens[: num_decodes + num_prefills].tolist()
    bounds = list(range(num_decodes + 1))
    if num_prefills > 0:
        bounds += [num_decodes + int(x) for x in metadata.query_start_loc_p[1 : num_prefills + 1].tolist()]
    pieces, input_rows, decode_requests, decode_rows = [], [], [], []
    by_shape: dict[tuple, list[Segment]] = {}  # segments of one shape, read as one batch
    row = 0
    for request in range(num_decodes + num_prefills):
        tokens = input_ids[bounds[request] : bounds[request + 1]]
        fresh = seq_lens[request] == tokens.shape[0]
        if not fresh and tokens.shape[0] == 1:
            decode_requests.append(request)
            decode_rows.append(row)
            pieces.append(tokens)
            input_rows.append(row)
            row += 1
            continue
        # A fresh forward of a preempted request holds its prompt and the tokens it generated: the encoder reads the
        # original prompt's prefix, the generated tokens are read causally (as generate() read them).
        prompt_length = None if prompt_lengths is None else prompt_lengths.get(request)
        filled, encoder_rows, key_mask = fill(tokens, prompt_length) if fresh else (tokens, 0, None)
        fill_rows = filled.shape[0] - tokens.shape[0]
        pieces.append(filled)
        segment = Segment(request, row, row + filled.shape[0], fresh, encoder_rows, key_mask)
        by_shape.setdefault(segment.shape, []).append(segment)
        input_rows.extend(range(row + fill_rows, row + filled.shape[0]))
        row += filled.shape[0]
    device = input_ids.device
    plan = BatchPlan(
        decode_requests, selector(decode_requests, device), selector(decode_rows, device),
        [SegmentGroup.of(segments, device) for segments in by_shape.values()],
        torch.tensor(input_rows, dtype=torch.long, device=device),
    )
    return torch.cat(pieces), plan


__all__ = [
    "DECODE_STEP", "BatchPlan", "DecodeStep", "ForwardPlan", "Segment", "SegmentGroup", "decode_slots",
    "forward_metadata", "is_decode_only", "plan_batch", "selector", "slot_table",
]
