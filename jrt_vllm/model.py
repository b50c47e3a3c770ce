"""JRT-RNN / Based as a vLLM model: every mixer keeps a constant-size per-request state that vLLM pages.

vLLM sees an attention-free model (`IsAttentionFree`, like Mamba2): each mixer is a `MambaBase` layer that declares
its state, and vLLM allocates one slot per request, binds it and hands the slot indices to every forward (the
metadata of its short-conv backend). The states hold what transformers' cache in `modeling_jrt` holds:

    "conv"               the last K - 1 inputs of the depthwise convolution             (K - 1, D)      model dtype
    "sliding_attention"  the last W - 1 rotated keys and values (a ring), tokens read  (H, W - 1, d) x 2, (1,) fp32
    "linear_attention"   the Taylor-feature state, encoder sum included                (H, F, V + 1)   fp32

The sliding window is a state as well (not vLLM's paged `Attention`): the JRT prefix fill below adds tokens that
vLLM never schedules, and a fixed window of W - 1 keys is what an O(1) model keeps anyway.

The JRT prefix (docs: docs/serving.md). The first forward of a request reads its whole prompt (chunked
prefill is off for prefix models, `jrt_vllm.config`). A prompt of L < prefix_length tokens is filled in front, as
the transformers model's first forward fills it (`config.prefix_strategy`, `modeling_jrt.prefix_fill`): "pad" prepends
`prefix_length - L` copies of `prefix_pad_token_id` (read by convolutions and sliding attention, removed from the
linear attention as `prefix_pad_masking` says), "repeat" repeats the prompt, "none" adds nothing. The fill runs
through every layer inside this forward and never reaches vLLM (no logits, no logprobs, not counted in the
request's length). The linear-attention encoder then reads the first `min(prefix_length, tokens)` tokens
non-causally; later forwards are O(1) recurrent steps.

A request vLLM preempts is recomputed from its prompt and generated tokens in one fresh forward: the encoder then
reads the original prompt's prefix (its length from `jrt_vllm.prompt_lengths`), the generated tokens causally.

The math is `modeling_jrt`'s (linear attention, blocked sliding-window attention, the causal depthwise convolution,
RMSNorm, RoPE); the dense parts are vLLM's layers (merged column-parallel projections, SiLU-and-multiply,
row-parallel output projections, vocabulary-parallel embedding and head), which also split the model over
tensor-parallel ranks: heads of both attentions, conv channels and the MLP, each rank keeping its share of every
state. This file maps vLLM's flattened batch onto the layers: the requests of a prefill are read in groups of
segments of the same shape (stacked as the rows of one batch: one call of each mixer per group), and all decoding
requests together in one step.

Compilation: each mixer runs inside one opaque op, `jrt_vllm::mix` (`mix`), which reads the forward's plan
(`ForwardPlan`) and the state slots at every call; vLLM's `support_torch_compile` on `JRTModel` traces everything
around those ops (embedding, norms, fp32 residual stream, MLPs) once, for every batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.model_executor.utils import set_weight_attrs
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from modeling_jrt.configuration_jrt import JRTRNNConfig
from modeling_jrt.kernel_choice import KernelChoice
from modeling_jrt.linear_attention import (
    fixed_log_decay,
    linear_attention_step_at_slots,
    num_taylor_features,
    prefix_linear_attention,
)
from modeling_jrt.modeling_jrt import JRTRNNRMSNorm
from modeling_jrt.prefix_fill import check_prefix_strategy, fill_prefix, never_generated_ids, plan_prefix
from modeling_jrt.rotary import JRTRNNRotaryEmbedding, apply_rotary_pos_emb
from modeling_jrt.short_conv import causal_depthwise_conv
from modeling_jrt.sliding_window import blocked_sliding_window_attention

from .prompt_lengths import tracker_for

logger = logging.getLogger(__name__)


@torch.library.custom_op("jrt_vllm::mix", mutates_args=("output",))
def mix(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The mixer `layer_name` (a `JRTStateLayer`, found in vLLM's forward context) on hidden_states `(N, hidden)`,
    written into output `(N, hidden)`.

    One opaque op per mixer: a compiled model (vLLM's `support_torch_compile`) traces the dense parts around it, while
    the mixer maps this forward's batch onto requests in Python (the plan, the state slots) at every call, which no
    graph may bake in. The same boundary vLLM's own recurrent layers have (their mixers are custom ops too)."""
    get_forward_context().no_compile_layers[layer_name].mix(hidden_states, output)


@mix.register_fake
def _(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


class ForwardPlan:
    """The plan of the forward in progress (`BatchPlan`, or None in a forward without metadata), set by
    `JRTRNNForCausalLM.forward` before the layers run and read by every mixer: one holder shared by the model's
    layers, outside any traced graph."""

    plan: BatchPlan | None = None


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
    so that each mixer runs once per group rather than once per request. With the "pad" and "repeat" fills, every
    fresh prompt shorter than `prefix_length` becomes `prefix_length` rows that the encoder reads, so the short
    prompts of a prefill are one group.

    Attributes:
        requests: the G requests (indices in vLLM's batch order).
        index: the same, to pick their slots from `_slot_table` on the device (`_positions`: a slice when they are
            consecutive).
        rows: their rows in the expanded batch, request after request (`G * T`; `_positions`: a slice when the
            segments are adjacent, so that taking them is a view).
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
        rows = _positions([row for s in segments for row in range(s.start, s.end)], device)
        key_mask = None
        if any(s.key_mask is not None for s in segments):
            every_key = torch.ones(length, dtype=torch.bool, device=device)
            key_mask = torch.stack([every_key if s.key_mask is None else s.key_mask for s in segments])
        return cls(requests, _positions(requests, device), rows, key_mask, length, fresh, encoder_rows)

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
        decode_index: the same, to pick their slots from `_slot_table` on the device (`_positions`: a slice when
            they are consecutive, as vLLM orders them).
        decode_rows: their rows in the expanded batch (`_positions`: a slice when they are consecutive, as when
            vLLM puts the decodes first, so that selecting them is a view, not a gather).
        groups: every other request, in groups of segments of one shape, each read in one pass.
        input_rows: `(num_actual_tokens,)` the expanded row of each of vLLM's tokens.
    """

    decode_requests: list[int]
    decode_index: slice | torch.Tensor
    decode_rows: slice | torch.Tensor
    groups: list[SegmentGroup]
    input_rows: torch.Tensor


def _slot_table(metadata) -> torch.Tensor:
    """`(requests,)` int64: the state slot of every request of this forward, in batch order (decodes first), for one
    layer group. Read on the device, from vLLM's metadata tensors: no host read per layer."""
    parts = []
    if metadata.num_decodes > 0:
        decode = metadata.state_indices_tensor_d
        parts.append((decode[:, 0] if decode.dim() > 1 else decode)[: metadata.num_decodes])
    if metadata.num_prefills > 0:
        prefill = metadata.state_indices_tensor_p
        parts.append((prefill[:, 0] if prefill.dim() > 1 else prefill)[: metadata.num_prefills])
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).long()


def _positions(positions: list[int], device: torch.device) -> slice | torch.Tensor:
    """Positions to select: a slice when they are consecutive (selecting is a view), else an int64 tensor on
    `device`."""
    first = positions[0] if positions else 0
    if positions == list(range(first, first + len(positions))):
        return slice(first, first + len(positions))
    return torch.tensor(positions, dtype=torch.long, device=device)


def _shard_rows(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Weight loader of a parameter split along its first dimension over the tensor-parallel ranks (the channels of
    the depthwise convolution): this rank's rows of the checkpoint's tensor."""
    rows = param.shape[0]
    param.data.copy_(loaded_weight.narrow(0, get_tensor_model_parallel_rank() * rows, rows))


class JRTStateLayer(MambaBase, nn.Module):
    """A mixer whose per-request state vLLM allocates (`get_state_shape` / `get_state_dtype`) and binds to
    `self.kv_cache`. All three mixers use the metadata of vLLM's short-conv backend (slots, query ranges).

    Tensor parallel: every mixer is split by heads (attention) or channels (convolution) over the ranks, with vLLM's
    column-parallel input projections and a row-parallel output projection (which sums the ranks' parts); each rank
    keeps its share of every request's state. `stacked_params` maps a checkpoint projection (the transformers
    model's name) to the merged parameter that holds it and its shard there."""

    stacked_params: dict[str, tuple[str, int | str]] = {}

    def __init__(self, config: JRTRNNConfig, layer_idx: int, prefix: str, plans: ForwardPlan):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.prefix = prefix
        self.plans = plans
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        vllm_config = get_current_vllm_config()
        self.model_dtype = vllm_config.model_config.dtype
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def local(self, total: int, what: str) -> int:
        """This rank's share of `total` heads or channels."""
        if total % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size={self.tp_size} must divide the {what} of {self.prefix} ({total}): choose a "
                "tensor_parallel_size that divides num_attention_heads and the convolution width."
            )
        return total // self.tp_size

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    def slot_table(self) -> torch.Tensor | None:
        """This layer's state slot per request (`_slot_table`), or None in a forward without metadata (vLLM's
        profiling run)."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or metadata.get(self.prefix) is None:
            return None
        return _slot_table(metadata[self.prefix])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `(N, hidden)`: the expanded batch -> `(N, hidden)` in the model dtype, through the opaque op
        `jrt_vllm::mix` (`mix`)."""
        output = torch.empty(hidden_states.shape[0], self.config.hidden_size, dtype=self.model_dtype,
                             device=hidden_states.device)
        torch.ops.jrt_vllm.mix(hidden_states, output, self.prefix)
        return output

    def mix(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        """The mixer on the forward's plan (`self.plans`), into output `(N, hidden)`.

        The input projections (`project`) and the output projection (`o_proj` / `out_proj`, which sums the
        tensor-parallel ranks' parts) run once over all N rows; only the mixing that reads and writes the states runs
        per request (`read`) or for all decoding requests at once (`step`)."""
        plan = self.plans.plan
        projected = self.project(hidden_states)  # (N, width) each: this rank's share
        slots = None if plan is None else self.slot_table()  # (requests,) on the device
        if slots is None:  # profiling: one stateless pass, the output does not matter
            whole = SegmentGroup([], slice(None), slice(None), None, hidden_states.shape[0], True)
            mixed = self.read([p[None] for p in projected], hidden_states[None], None, whole)[0]
        else:
            mixed = projected[0].new_empty(hidden_states.shape[0], self.mixed_width)
            if plan.decode_requests:
                rows = plan.decode_rows
                mixed[rows] = self.step([p[rows] for p in projected], slots[plan.decode_index])
            for group in plan.groups:
                taken = [group.take(p) for p in projected]  # (G, T, width) each
                group.put(mixed, self.read(taken, group.take(hidden_states), slots[group.index], group))
        output.copy_(self.output_projection(mixed))


class JRTShortConv(JRTStateLayer):
    """`JRTRNNShortConv` (same weights): u, g = in_proj(x); y = out_proj(SiLU(causal_conv_K(u)) * g), in the
    `(T, D)` layout throughout (`modeling_jrt.short_conv.causal_depthwise_conv`: K shifted multiply-adds, no
    transposed copies). State: the last K - 1 inputs u `(K - 1, D / tp)`."""

    def __init__(self, config: JRTRNNConfig, layer_idx: int, prefix: str, plans: ForwardPlan):
        super().__init__(config, layer_idx, prefix, plans)
        self.kernel_size = config.conv_kernel_size
        inner = config.conv_expansion * config.hidden_size
        self.inner_size = self.local(inner, "convolution width")
        self.history = max(self.kernel_size - 1, 1)  # a state of at least one row (K = 1 keeps nothing)
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size, [inner, inner], bias=config.conv_bias, prefix=f"{prefix}.in_proj", return_bias=False
        )  # [u; g], split by channel: each rank holds its channels of both
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(self.inner_size, 1, self.kernel_size), requires_grad=False)
        set_weight_attrs(self.conv.weight, {"weight_loader": _shard_rows})
        self.out_proj = RowParallelLinear(
            inner, config.hidden_size, bias=config.conv_bias, prefix=f"{prefix}.out_proj", return_bias=False
        )

    def get_state_shape(self) -> tuple[tuple[int, ...]]:
        return ((self.history, self.inner_size),)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return (self.model_dtype,)

    @property
    def mixed_width(self) -> int:
        return self.inner_size

    def project(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """(N, hidden) -> [u and g side by side (N, 2 D)] (this rank's channels)."""
        return [self.in_proj(hidden_states)]

    def output_projection(self, mixed: torch.Tensor) -> torch.Tensor:
        return self.out_proj(mixed)

    def _mix(self, projected: torch.Tensor, past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, t, 2 D) projections, (B, h, D) inputs before them (or None) -> SiLU(conv(u)) * g (B, t, D), and u."""
        conv_input, gate = projected.chunk(2, dim=-1)  # (B, t, D) each
        conv_output = causal_depthwise_conv(conv_input, past, self.conv.weight)  # (B, t, D)
        return F.silu(conv_output, inplace=True).mul_(gate), conv_input

    def read(self, projected: list[torch.Tensor], hidden_states: torch.Tensor, slots: torch.Tensor | None,
             group: SegmentGroup) -> torch.Tensor:
        """The T rows of each of G requests `[(G, T, 2 D)]` -> `(G, T, D)`; updates their states."""
        past = None if group.fresh or slots is None else self.kv_cache[0].index_select(0, slots).to(projected[0].dtype)
        mixed, conv_input = self._mix(projected[0], past)
        if slots is not None:
            full = conv_input if past is None else torch.cat([past, conv_input], dim=1)
            newest = full[:, -self.history :]  # fewer inputs than the state holds: zeros before them, as at the start
            newest = F.pad(newest, (0, 0, self.history - newest.shape[1], 0))
            self.kv_cache[0].index_copy_(0, slots, newest.to(self.kv_cache[0].dtype))
        return mixed

    def step(self, projected: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B requests `[(B, 2 D)]` -> `(B, D)`."""
        past = self.kv_cache[0].index_select(0, slots).to(projected[0].dtype)  # (B, history, D)
        mixed, conv_input = self._mix(projected[0][:, None], past)
        self.kv_cache[0].index_copy_(0, slots, torch.cat([past[:, 1:], conv_input], dim=1).to(self.kv_cache[0].dtype))
        return mixed[:, 0]


class JRTSlidingWindowAttention(JRTStateLayer):
    """`JRTRNNSlidingWindowAttention` (same weights): softmax attention over the last W tokens, RoPE on q and k.

    State: a ring of the last W - 1 rotated keys and values, `(H / tp, W - 1, d)` each, the key of token t (counted
    from the start of the request, fill included) at row t mod (W - 1); and the number of tokens the request has read
    `(1,)` fp32 (its next RoPE position; it also tells which rows hold keys). A decode step writes one row per request
    and reads the rows as they lie (softmax attention does not care about the order of its keys: their positions are
    in their rotation); a read of several tokens puts them in order first.
    """

    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def __init__(self, config: JRTRNNConfig, layer_idx: int, prefix: str, plans: ForwardPlan):
        super().__init__(config, layer_idx, prefix, plans)
        self.num_heads = self.local(config.num_attention_heads, "attention heads")
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.rows = max(self.window - 1, 1)  # ring rows (a window of 1 keeps nothing: one row, never read)
        self.scaling = self.head_dim**-0.5
        hidden = config.hidden_size
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, config.num_attention_heads, bias=False, prefix=f"{prefix}.qkv_proj",
            return_bias=False,
        )
        self.o_proj = RowParallelLinear(hidden, hidden, bias=False, prefix=f"{prefix}.o_proj", return_bias=False)
        self.rotary_emb = JRTRNNRotaryEmbedding(config)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        ring = (self.num_heads, self.rows, self.head_dim)
        return (ring, ring, (1,))

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (self.model_dtype, self.model_dtype, torch.float32)

    @property
    def mixed_width(self) -> int:
        return self.num_heads * self.head_dim

    def project(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """(N, hidden) -> [q, k, v side by side (N, 3 H d)] (this rank's heads)."""
        return [self.qkv_proj(hidden_states)]

    def output_projection(self, mixed: torch.Tensor) -> torch.Tensor:
        return self.o_proj(mixed)

    def _rotated(self, projected: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """projected `(B, T, 3 H d)`, positions `(B, T)` -> q, k, v `(B, H, T, d)`, q and k rotated."""
        batch_size, seq_len, _ = projected.shape
        shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        query, key, value = (part.reshape(shape).transpose(1, 2) for part in projected.chunk(3, dim=-1))
        cos, sin = self.rotary_emb(projected, positions)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    def _held(self, seen: torch.Tensor) -> torch.Tensor:
        """(B,) tokens read -> (B,) int64 keys of them a new query sees (the last min(seen, W - 1))."""
        return torch.clamp(seen.long(), max=self.window - 1)

    def _ring_order(self, seen: torch.Tensor, end: int = 0) -> torch.Tensor:
        """`(B, W - 1)` ring row of each of the last W - 1 tokens, oldest first, when `seen + end` tokens have been
        read (token t at row t mod (W - 1); places before the first token hold nothing)."""
        order = torch.arange(self.rows, device=seen.device)
        return (order[None, :] + seen.long()[:, None] + end) % self.rows

    def read(self, projected: list[torch.Tensor], hidden_states: torch.Tensor, slots: torch.Tensor | None,
             group: SegmentGroup) -> torch.Tensor:
        """The T rows of each of G requests `[(G, T, 3 H d)]` -> `(G, T, H d)`; updates their states."""
        batch_size, seq_len = hidden_states.shape[:2]
        device = hidden_states.device
        if group.fresh or slots is None:
            seen = torch.zeros(batch_size, device=device)
            past_keys = past_values = projected[0].new_zeros(batch_size, self.num_heads, self.rows, self.head_dim)
        else:  # a request read before: its ring, in token order (`_ring_order`)
            seen = self.kv_cache[2].index_select(0, slots).float().view(batch_size)
            order = self._ring_order(seen)[:, None, :, None].expand(-1, self.num_heads, -1, self.head_dim)
            past_keys, past_values = (
                torch.gather(self.kv_cache[i].index_select(0, slots), 2, order).to(projected[0].dtype) for i in (0, 1)
            )
        positions = seen.long()[:, None] + torch.arange(seq_len, device=device)[None]  # (G, T)
        query, key, value = self._rotated(projected[0], positions)
        keys = torch.cat([past_keys, key], dim=2)  # (G, H, W - 1 + T, d): the held rows, then the new keys
        values = torch.cat([past_values, value], dim=2)
        row = torch.arange(self.rows, device=device)
        key_mask = torch.cat(
            [row[None, :] >= (self.rows - self._held(seen))[:, None], row.new_ones(batch_size, seq_len, dtype=torch.bool)],
            dim=1,
        )  # (G, W - 1 + T): the state rows that hold keys, then the new keys
        output = blocked_sliding_window_attention(
            query, keys, values, key_mask, sliding_window=self.window, scaling=self.scaling, implementation="sdpa"
        )  # (G, T, H, d)
        if slots is not None:  # the last W - 1 keys, each at its ring row
            index = self._ring_order(seen, seq_len)[:, None, :, None].expand(-1, self.num_heads, -1, self.head_dim)
            for state, rows in ((self.kv_cache[0], keys), (self.kv_cache[1], values)):
                ring = rows.new_empty(batch_size, self.num_heads, self.rows, self.head_dim)
                ring.scatter_(2, index, rows[:, :, -self.rows :])
                state.index_copy_(0, slots, ring.to(state.dtype))
            self.kv_cache[2].index_copy_(0, slots, (seen + seq_len)[:, None].to(self.kv_cache[2].dtype))
        return output.reshape(batch_size, seq_len, -1)

    def step(self, projected: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """One token of each of B requests `[(B, 3 H d)]` -> `(B, H d)`: attention over the ring rows that hold keys
        and the new key, then the new key and value written at their ring row (one row per request)."""
        batch_size = projected[0].shape[0]
        keys, values, count = self.kv_cache
        seen = count.index_select(0, slots).view(batch_size).long()  # (B,)
        query, key, value = self._rotated(projected[0][:, None], seen[:, None])  # (B, H, 1, d) each
        past_keys = keys.index_select(0, slots).to(query.dtype)  # (B, H, W - 1, d), ring order
        past_values = values.index_select(0, slots).to(query.dtype)
        held = torch.arange(self.rows, device=seen.device)[None, :] < self._held(seen)[:, None]  # (B, W - 1)
        scores = torch.matmul(query, past_keys.transpose(-1, -2)).float()  # (B, H, 1, W - 1)
        scores = scores.masked_fill(~held[:, None, None, :], float("-inf"))
        own = (query.float() * key.float()).sum(-1, keepdim=True)  # (B, H, 1, 1): the new token's own key
        weights = torch.softmax(torch.cat([scores, own], dim=-1) * self.scaling, dim=-1)
        output = torch.matmul(weights[..., :-1].to(past_values.dtype), past_values).float()
        output = (output + weights[..., -1:] * value.float()).to(query.dtype)  # (B, H, 1, d)
        ring_row = seen % self.rows
        keys[slots, :, ring_row] = key[:, :, 0].to(keys.dtype)  # (B, H, d) at (slot, :, row)
        values[slots, :, ring_row] = value[:, :, 0].to(values.dtype)
        count.index_copy_(0, slots, (seen + 1)[:, None].to(count.dtype))
        return output.reshape(batch_size, -1)


class JRTLinearAttention(JRTStateLayer):
    """`JRTRNNLinearAttention` (same weights): prefix (JRT-RNN) or causal (Based, optional decay) linear attention.
    State: `(H / tp, F, V + 1)` fp32 (`modeling_jrt.linear_attention`), the encoder sum included."""

    stacked_params = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "k_enc_proj": ("kv_enc_proj", 0), "v_enc_proj": ("kv_enc_proj", 1),
    }

    def __init__(self, config: JRTRNNConfig, layer_idx: int, prefix: str, plans: ForwardPlan):
        super().__init__(config, layer_idx, prefix, plans)
        heads = config.num_attention_heads
        self.num_heads = self.local(heads, "attention heads")
        self.feature_dim = config.feature_dim
        self.head_dim = config.head_dim
        self.is_prefix = config.linear_attention_type == "prefix"
        self.kernels = KernelChoice(config=config)  # the model's own choice replaces it (`KernelChoice.install`)
        hidden = config.hidden_size
        features = heads * self.feature_dim
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, [features, features, hidden], bias=False, prefix=f"{prefix}.qkv_proj", return_bias=False
        )
        if self.is_prefix:
            self.kv_enc_proj = MergedColumnParallelLinear(
                hidden, [features, hidden], bias=False, prefix=f"{prefix}.kv_enc_proj", return_bias=False
            )
        if config.use_decay_proj:
            self.decay_proj = ColumnParallelLinear(
                hidden, heads, bias=False, prefix=f"{prefix}.decay_proj", return_bias=False
            )
        self.o_proj = RowParallelLinear(hidden, hidden, bias=False, prefix=f"{prefix}.o_proj", return_bias=False)
        # This rank's heads of the fixed decay, on the device of the first forward.
        self.heads = range(self.tp_rank * self.num_heads, (self.tp_rank + 1) * self.num_heads)

    def log_decay(self, device: torch.device) -> torch.Tensor | None:
        if not self.config.linear_attention_decay:
            return None
        return fixed_log_decay(self.config.decay_const, self.heads, device)

    def get_state_shape(self) -> tuple[tuple[int, ...]]:
        return ((self.num_heads, num_taylor_features(self.feature_dim), self.head_dim + 1),)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return (torch.float32,)

    @property
    def mixed_width(self) -> int:
        return self.num_heads * self.head_dim

    def project(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """(N, hidden) -> [q, k, v side by side (N, H (2 K + V))] and, for the decay variant, [the gate (N, H)]."""
        projected = [self.qkv_proj(hidden_states)]
        if self.config.use_decay_proj:
            projected.append(self.decay_proj(hidden_states))
        return projected

    def output_projection(self, mixed: torch.Tensor) -> torch.Tensor:
        return self.o_proj(mixed)

    def _split(self, projected: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """[(..., H (2 K + V)), gate] -> q, k (..., H, K), v (..., H, V), gate (..., H) or None."""
        lead = projected[0].shape[:-1]
        features = self.num_heads * self.feature_dim
        query, key, value = projected[0].split([features, features, self.num_heads * self.head_dim], -1)
        query = query.reshape(*lead, self.num_heads, self.feature_dim)
        key = key.reshape(*lead, self.num_heads, self.feature_dim)
        value = value.reshape(*lead, self.num_heads, self.head_dim)
        return query, key, value, projected[1] if self.config.use_decay_proj else None

    def read(self, projected: list[torch.Tensor], hidden_states: torch.Tensor, slots: torch.Tensor | None,
             group: SegmentGroup) -> torch.Tensor:
        """The T rows of each of G requests -> `(G, T, H V)`; updates their states."""
        batch_size, seq_len = hidden_states.shape[:2]
        query, key, value, gate = self._split(projected)  # (G, T, H, K), (G, T, H, V), (G, T, H)
        k_enc = v_enc = None
        if group.fresh and self.is_prefix:
            # The encoder reads each segment's first rows (fill included, `Segment.encoder_rows`), this forward only.
            length = group.encoder_rows
            if length is None:  # vLLM's profiling run (no request behind it): as many rows as a prefix can have
                length = min(self.config.prefix_length, seq_len)
            if length > 0:
                features = self.num_heads * self.feature_dim
                k_enc, v_enc = self.kv_enc_proj(hidden_states[:, :length]).split(
                    [features, self.num_heads * self.head_dim], -1
                )
                k_enc = k_enc.reshape(batch_size, length, self.num_heads, self.feature_dim)  # (G, M, H, K)
                v_enc = v_enc.reshape(batch_size, length, self.num_heads, self.head_dim)  # (G, M, H, V)
        initial_state = None if (group.fresh or slots is None) else self.kv_cache[0].index_select(0, slots)
        output, state = prefix_linear_attention(
            query, key, value, k_enc, v_enc,
            key_mask=group.key_mask,  # the "pad" fill of each row, removed as `prefix_pad_masking` says
            pad_masking=self.config.prefix_pad_masking,
            initial_state=initial_state,
            log_decay=self.log_decay(hidden_states.device),
            gate=gate,
            eps=self.config.linear_attention_eps,
            chunk_size=self.config.linear_attention_chunk_size,
            implementation=self.kernels,
        )  # (G, T, H, V), (G, H, F, V + 1)
        if slots is not None:
            self.kv_cache[0].index_copy_(0, slots, state)
        return output.reshape(batch_size, seq_len, -1).to(value.dtype)

    def step(self, projected: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        query, key, value, gate = self._split(projected)  # (B, H, K), (B, H, K), (B, H, V), (B, H)
        # Each state is updated where it lives in the pool: the fused Triton step on a GPU, PyTorch's index_add_ and a
        # weighted embedding_bag elsewhere (`linear_attention_step_at_slots`).
        output = linear_attention_step_at_slots(
            query, key, value, self.kv_cache[0], slots, log_decay=self.log_decay(query.device), gate=gate,
            eps=self.config.linear_attention_eps, implementation=self.kernels,
        )  # (B, H, V)
        return output.reshape(query.shape[0], -1).to(value.dtype)


MIXER_CLASSES = {
    "conv": JRTShortConv,
    "sliding_attention": JRTSlidingWindowAttention,
    "linear_attention": JRTLinearAttention,
}


class JRTMLP(nn.Module):
    """`JRTRNNMLP` (same weights) with vLLM's layers: gate and up projections in one column-parallel matmul, fused
    SiLU-and-multiply, row-parallel down projection."""

    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: JRTRNNConfig, prefix: str):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=False, prefix=f"{prefix}.gate_up_proj", return_bias=False
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj", return_bias=False
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden_states)))


class JRTRMSNorm(JRTRNNRMSNorm):
    """`JRTRNNRMSNorm` (same weight, same arithmetic) in one pass over the batch: its `forward` cuts long inputs into
    token chunks by a size-dependent loop, which a graph traced once for every batch size must not contain. A vLLM
    batch is bounded by `max_num_batched_tokens`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.normalize(hidden_states)


class JRTDecoderLayer(nn.Module):
    """Pre-norm block on an fp32 residual stream: r += mixer(norm(r)); r += mlp(norm(r)) (`JRTRNNDecoderLayer`)."""

    def __init__(self, config: JRTRNNConfig, layer_idx: int, prefix: str, plans: ForwardPlan):
        super().__init__()
        self.layer_type = config.mixer_types[layer_idx]
        self.input_layernorm = JRTRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.layer_type](config, layer_idx, f"{prefix}.mixer", plans)
        has_mlp = config.intermediate_size > 0
        self.post_attention_layernorm = JRTRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if has_mlp else None
        self.mlp = JRTMLP(config, f"{prefix}.mlp") if has_mlp else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.mixer(self.input_layernorm(hidden_states)).float()
        if self.mlp is None:
            return hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)).float()


@support_torch_compile(dynamic_arg_dims={"input_ids": 0})
class JRTModel(nn.Module):
    """Embeddings, blocks, final norm (`JRTRNNModel`'s names, so the safetensors load by them).

    vLLM compiles it when the engine compiles (`support_torch_compile`: on vLLM's CPU backend, traced once by dynamo
    and built by inductor, `jrt_vllm.config` says when): the embedding, norms, residual stream and MLPs become one
    graph around the mixers' opaque `jrt_vllm::mix` ops."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", plans: ForwardPlan):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleList(
            [JRTDecoderLayer(config, i, f"{prefix}.layers.{i}", plans) for i in range(config.num_hidden_layers)]
        )
        self.norm = JRTRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # One kernel choice for the model (`modeling_jrt.kernel_choice`), shared by its mixers and norms.
        self.kernels = KernelChoice(config=config)
        self.kernels.install(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids).float()  # the residual stream stays fp32
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def _prefix_strategy(model_path: str, config: JRTRNNConfig) -> str:
    """`config.prefix_strategy`, or the `prefix_strategy` of an older folder's generation_config.json (jrt-rnn 0.2
    saved it there; `JRTRNNForCausalLM` reads it the same way)."""
    from transformers import GenerationConfig

    try:
        legacy = getattr(GenerationConfig.from_pretrained(model_path), "prefix_strategy", None)
    except OSError:  # no generation_config.json
        legacy = None
    return check_prefix_strategy(config.prefix_strategy if legacy is None else legacy)


class JRTRNNForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    """vLLM model for the `JRTRNNForCausalLM` folders that `save_pretrained` and `jrt convert` write."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "jrt_vllm splits JRT-RNN / Based over devices by tensor parallelism only: pipeline parallelism is not "
                f"implemented (got pipeline_parallel_size={parallel.pipeline_parallel_size}); use "
                "tensor_parallel_size, or data parallelism (one engine per device)."
            )
        if vllm_config.speculative_config is not None:
            raise NotImplementedError("jrt_vllm does not support speculative decoding (the state cannot roll back).")
        self.config = config
        self.vllm_config = vllm_config
        self.is_prefix = config.is_prefix_model
        self.prefix_strategy = _prefix_strategy(vllm_config.model_config.model, config) if self.is_prefix else "none"
        if self.prefix_strategy == "pad" and config.prefix_pad_token_id is None:
            raise ValueError(
                "prefix_strategy='pad' needs `prefix_pad_token_id` in config.json (220 in the released models), or "
                "another `prefix_strategy` in config.json."
            )
        self.plans = ForwardPlan()
        self.model = JRTModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model", plans=self.plans)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.lm_head" if prefix else "lm_head"
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.suppressed_ids = never_generated_ids(config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _plan(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, BatchPlan] | None:
        """The expanded ids (fill included) and the plan of this forward, or None without metadata (profiling)."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict) or not metadata:
            return None
        first = next(iter(metadata.values()))
        num_decodes, num_prefills = first.num_decodes, first.num_prefills
        seq_lens = first.seq_lens[: num_decodes + num_prefills].tolist()
        bounds = list(range(num_decodes + 1))
        if num_prefills > 0:
            bounds += [num_decodes + int(x) for x in first.query_start_loc_p[1 : num_prefills + 1].tolist()]
        pieces, input_rows, decode_requests, decode_rows = [], [], [], []
        by_shape: dict[tuple, list[Segment]] = {}  # segments of one shape, read as one batch
        prompt_lengths = self._prompt_lengths()
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
            # A fresh forward of a preempted request holds its prompt and the tokens it generated: the encoder reads
            # the original prompt's prefix, the generated tokens are read causally (as generate() read them).
            prompt_length = None if prompt_lengths is None else prompt_lengths.get(request)
            filled, encoder_rows, key_mask = self._fill(tokens, prompt_length) if fresh else (tokens, 0, None)
            fill = filled.shape[0] - tokens.shape[0]
            pieces.append(filled)
            segment = Segment(request, row, row + filled.shape[0], fresh, encoder_rows, key_mask)
            by_shape.setdefault(segment.shape, []).append(segment)
            input_rows.extend(range(row + fill, row + filled.shape[0]))
            row += filled.shape[0]
        plan = BatchPlan(
            decode_requests=decode_requests,
            decode_index=_positions(decode_requests, input_ids.device),
            decode_rows=_positions(decode_rows, input_ids.device),
            groups=[SegmentGroup.of(segments, input_ids.device) for segments in by_shape.values()],
            input_rows=torch.tensor(input_rows, dtype=torch.long, device=input_ids.device),
        )
        return torch.cat(pieces), plan

    def _prompt_lengths(self) -> dict[int, int] | None:
        """Each request's original prompt length by its place in this forward (`jrt_vllm.prompt_lengths`), or None
        for a causal model (its recompute is exact without it) or when the tracker is not loaded (warned once)."""
        if not self.is_prefix:
            return None
        tracker = tracker_for(self.vllm_config)
        if tracker is None:
            if not getattr(self, "_warned_no_tracker", False):
                self._warned_no_tracker = True
                logger.warning(
                    "jrt_vllm: the prompt-length tracker (%s) is not among this engine's logits processors, so a "
                    "preempted request whose prompt is shorter than prefix_length=%d would be recomputed with its "
                    "generated tokens inside its prefix. Keep jrt_vllm's engine settings (do not replace "
                    "`logits_processors` after the engine is configured).",
                    "jrt_vllm.prompt_lengths:PromptLengths",
                    self.config.prefix_length,
                )
            return None
        return tracker.lengths

    def _fill(self, tokens: torch.Tensor, prompt_length: int | None = None
              ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """The tokens `(T,)` of a request's first forward in the model's layout, with the JRT prefix fill in front,
        the rows its encoder reads and the keys its linear attention reads (`(F + T,)` bool, False at the `"pad"`
        fill; None when it reads every key): the transformers model's own prefix rule (`plan_prefix`, `fill_prefix`),
        on a batch of one. `prompt_length`: where its prompt ends (None: all T tokens are prompt); the tokens after it
        (a preempted request's generated tokens) are read causally."""
        if not self.is_prefix:
            return tokens, 0, None
        prompt_lengths = None if prompt_length is None or prompt_length >= tokens.shape[0] else prompt_length
        plan = plan_prefix(None, 1, tokens.shape[0], tokens.device, prefix_length=self.config.prefix_length,
                           prompt_lengths=prompt_lengths, strategy=self.prefix_strategy)
        filled = fill_prefix(tokens[None], None, None, plan, pad_token_id=self.config.prefix_pad_token_id,
                             embed=None, vocab_size=self.config.vocab_size)
        masked = filled.linear_attention_mask is not None and filled.fill_columns > 0
        key_mask = filled.linear_attention_mask[0].bool() if masked else None
        return filled.input_ids[0], int(plan.fill[0] + plan.encoder_tokens[0]), key_mask

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if input_ids is None:
            raise NotImplementedError("jrt_vllm reads token ids (the JRT fill is made of tokens), not embeddings.")
        planned = self._plan(input_ids)
        if planned is None:  # no metadata (vLLM's profiling run): the mixers read the plan None
            return self.model(input_ids)
        expanded_ids, plan = planned
        self.plans.plan = plan  # what every mixer of this forward reads (`JRTStateLayer.mix`)
        try:
            hidden_states = self.model(expanded_ids)
        finally:
            self.plans.plan = None
        output = hidden_states.new_zeros(input_ids.shape[0], hidden_states.shape[-1])
        output[: plan.input_rows.shape[0]] = hidden_states[plan.input_rows]
        return output

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states.to(self.lm_head.weight.dtype))
        # Padded vocabulary rows and [MASK] are never generated (`generate()`'s suppress_tokens).
        if logits is not None and self.suppressed_ids:
            logits[:, self.suppressed_ids] = float("-inf")
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The safetensors of a `save_pretrained` / `jrt convert` folder, by their own names: each projection that
        vLLM's layers merge (`stacked_params` of the mixers and the MLP) goes to its shard of the merged parameter,
        and each tensor-parallel rank takes its part."""
        parameters = dict(self.named_parameters())
        loaded = set()
        unexpected = []
        for name, weight in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied to the embedding
            target, shard = self._parameter_of(name)
            if target not in parameters:
                unexpected.append(name)
                continue
            parameter = parameters[target]
            loader = getattr(parameter, "weight_loader", default_weight_loader)
            if loader is default_weight_loader and parameter.shape != weight.shape:  # a tensor no rank splits
                raise ValueError(f"{name}: checkpoint shape {tuple(weight.shape)}, model {tuple(parameter.shape)}.")
            if shard is None:
                loader(parameter, weight)
            else:
                loader(parameter, weight, shard)
            loaded.add(target)
        if unexpected:
            raise ValueError(f"The checkpoint has weights this model does not: {sorted(unexpected)}.")
        return loaded

    def _parameter_of(self, name: str) -> tuple[str, int | str | None]:
        """The parameter that holds checkpoint tensor `name`, and its shard there (None: the whole parameter)."""
        parts = name.split(".")
        if len(parts) >= 6 and parts[:2] == ["model", "layers"] and parts[3] in ("mixer", "mlp"):
            layer = self.model.layers[int(parts[2])]
            module = layer.mixer if parts[3] == "mixer" else layer.mlp
            stacked = getattr(module, "stacked_params", {}).get(parts[4])
            if stacked is not None:
                merged, shard = stacked
                return ".".join([*parts[:4], merged, *parts[5:]]), shard
        return name, None


__all__ = ["JRTRNNForCausalLM"]
