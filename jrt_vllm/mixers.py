"""The three mixers of JRT-RNN / Based as vLLM layers, each keeping a constant-size per-request state that vLLM pages.

vLLM sees an attention-free model (`IsAttentionFree`, like Mamba2): each mixer is a `MambaBase` layer that declares
its state, and vLLM allocates one slot per request, binds it and hands the slot indices to every forward (the
metadata of its short-conv backend). The states hold what transformers' cache in `modeling_jrt` holds:

    "conv"               the last K - 1 inputs of the depthwise convolution             (K - 1, D)      model dtype
    "sliding_attention"  the last W - 1 rotated keys and values (a ring), tokens read  (H, W - 1, d) x 2, (1,) fp32
    "linear_attention"   the Taylor-feature state, encoder sum included                (H, F, V + 1)   fp32

The sliding window is a state as well (not vLLM's paged `Attention`): the JRT prefix fill adds tokens that vLLM never
schedules, and a fixed window of W - 1 keys is what an O(1) model keeps anyway. The math is `modeling_jrt`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
)
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.utils import set_weight_attrs
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from modeling_jrt.configuration_jrt import JRTRNNConfig
from modeling_jrt.kernel_choice import KernelChoice
from modeling_jrt.linear_attention import (
    fixed_log_decay, linear_attention_step_at_slots, num_taylor_features, prefix_linear_attention,
)
from modeling_jrt.rotary import JRTRNNRotaryEmbedding, apply_rotary_pos_emb
from modeling_jrt.short_conv import causal_depthwise_conv
from modeling_jrt.sliding_window import blocked_sliding_window_attention

from .batch_plan import DECODE_STEP, ForwardPlan, SegmentGroup, decode_slots, forward_metadata, slot_table
from .weights import StackedWeights, shard_rows

# The op's name, as vLLM's `splitting_ops` list it (`jrt_vllm.config`).
MIX_OP = "jrt_vllm::mix"


@torch.library.custom_op(MIX_OP, mutates_args=("output",))
def mix(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    """The mixer `layer_name` (a `JRTStateLayer`, found in vLLM's forward context) on hidden_states `(N, hidden)`,
    written into output `(N, hidden)`.

    One opaque op per mixer, the boundary vLLM's own recurrent layers have (`splitting_ops`: `jrt_vllm.config`): a
    compiled model traces the dense parts around it, because in a forward with prefills the mixer maps the batch onto
    requests in Python (`BatchPlan`), which no graph may bake in."""
    get_forward_context().no_compile_layers[layer_name].mix(hidden_states, output)


@mix.register_fake
def _(hidden_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


class JRTStateLayer(StackedWeights, MambaBase, nn.Module):
    """A mixer whose per-request state vLLM allocates (`get_state_shape` / `get_state_dtype`) and binds to
    `self.kv_cache`. All three mixers use the metadata of vLLM's short-conv backend (slots, query ranges).

    Tensor parallel: split by heads (attention) or channels (convolution), with vLLM's column-parallel input
    projections and a row-parallel output projection (which sums the ranks' parts); each rank keeps its share of
    every request's state."""

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
            raise ValueError(f"tensor_parallel_size={self.tp_size} must divide the {what} of {self.prefix} ({total}): "
                             "choose a tensor_parallel_size that divides num_attention_heads and the convolution "
                             "width.")
        return total // self.tp_size

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `(N, hidden)`: the expanded batch -> `(N, hidden)` in the model dtype, through the opaque op
        `jrt_vllm::mix` (`mix`)."""
        output = torch.empty(hidden_states.shape[0], self.config.hidden_size, dtype=self.model_dtype,
                             device=hidden_states.device)
        torch.ops.jrt_vllm.mix(hidden_states, output, self.prefix)
        return output

    @property
    def mixed_width(self) -> int:
        """Columns of this rank's mixer output (the input of `output_projection`)."""
        return self.num_heads * self.head_dim

    def split_heads(self, projected: torch.Tensor, *dims: int) -> list[torch.Tensor]:
        """(..., H (d_1 + d_2 + ...)) side by side -> [(..., H, d_i)]: the parts of this rank's heads."""
        parts = projected.split([self.num_heads * dim for dim in dims], -1)
        return [part.unflatten(-1, (self.num_heads, dim)) for part, dim in zip(parts, dims)]

    def output_projection(self, mixed: torch.Tensor) -> torch.Tensor:
        return self.o_proj(mixed)

    def mix(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        """The mixer on the forward's plan (`self.plans`), into output `(N, hidden)`.

        The projections (`project`, `output_projection`) run once over all N rows; only the mixing that reads and
        writes the states runs per group of requests (`read`) or for all decoding requests at once (`step`; a
        decode-only forward is the step on all N rows)."""
        plan = self.plans.plan
        projected = self.project(hidden_states)  # (N, width) each: this rank's share
        metadata = None if plan is None else forward_metadata(self.prefix)
        if metadata is None:  # profiling: one stateless pass, the output does not matter
            whole = SegmentGroup([], slice(None), slice(None), None, hidden_states.shape[0], True)
            mixed = self.read([p[None] for p in projected], hidden_states[None], None, whole)[0]
        elif plan is DECODE_STEP:
            mixed = self.step(projected, decode_slots(metadata, hidden_states.shape[0]))
        else:
            slots = slot_table(metadata)  # (requests,) on the device
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
        set_weight_attrs(self.conv.weight, {"weight_loader": shard_rows})
        self.out_proj = RowParallelLinear(inner, config.hidden_size, bias=config.conv_bias, prefix=f"{prefix}.out_proj",
                                          return_bias=False)

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
        return self.out_proj(mixed)  # the transformers model's name

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
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads, bias=False,
                                          prefix=f"{prefix}.qkv_proj", return_bias=False)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=False, prefix=f"{prefix}.o_proj", return_bias=False)
        self.rotary_emb = JRTRNNRotaryEmbedding(config)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        ring = (self.num_heads, self.rows, self.head_dim)
        return (ring, ring, (1,))

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (self.model_dtype, self.model_dtype, torch.float32)

    def project(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """(N, hidden) -> [q, k, v side by side (N, 3 H d)] (this rank's heads)."""
        return [self.qkv_proj(hidden_states)]

    def _rotated(self, projected: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """projected `(B, T, 3 H d)`, positions `(B, T)` -> q, k, v `(B, H, T, d)`, q and k rotated."""
        parts = self.split_heads(projected, self.head_dim, self.head_dim, self.head_dim)  # (B, T, H, d) each
        query, key, value = (part.transpose(1, 2) for part in parts)
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
        held = torch.arange(self.rows, device=device)[None, :] >= (self.rows - self._held(seen))[:, None]
        # (G, W - 1 + T): the state rows that hold keys, then the new keys
        key_mask = torch.cat([held, held.new_ones(batch_size, seq_len)], dim=1)
        output = blocked_sliding_window_attention(query, keys, values, key_mask, sliding_window=self.window,
                                                  scaling=self.scaling, implementation="sdpa")  # (G, T, H, d)
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

    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "k_enc_proj": ("kv_enc_proj", 0), "v_enc_proj": ("kv_enc_proj", 1)}

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
        self.qkv_proj = MergedColumnParallelLinear(hidden, [features, features, hidden], bias=False,
                                                   prefix=f"{prefix}.qkv_proj", return_bias=False)
        if self.is_prefix:
            self.kv_enc_proj = MergedColumnParallelLinear(hidden, [features, hidden], bias=False,
                                                          prefix=f"{prefix}.kv_enc_proj", return_bias=False)
        if config.use_decay_proj:
            self.decay_proj = ColumnParallelLinear(hidden, heads, bias=False, prefix=f"{prefix}.decay_proj",
                                                   return_bias=False)
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

    def project(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """(N, hidden) -> [q, k, v side by side (N, H (2 K + V))] and, for the decay variant, [the gate (N, H)]."""
        projected = [self.qkv_proj(hidden_states)]
        if self.config.use_decay_proj:
            projected.append(self.decay_proj(hidden_states))
        return projected

    def _split(self, projected: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """[(..., H (2 K + V)), gate] -> q, k (..., H, K), v (..., H, V), gate (..., H) or None."""
        query, key, value = self.split_heads(projected[0], self.feature_dim, self.feature_dim, self.head_dim)
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
                encoder = self.kv_enc_proj(hidden_states[:, :length])
                k_enc, v_enc = self.split_heads(encoder, self.feature_dim, self.head_dim)  # (G, M, H, K), (G, M, H, V)
        initial_state = None if (group.fresh or slots is None) else self.kv_cache[0].index_select(0, slots)
        # key_mask: the "pad" fill of each row, removed as `prefix_pad_masking` says
        output, state = prefix_linear_attention(
            query, key, value, k_enc, v_enc, key_mask=group.key_mask, pad_masking=self.config.prefix_pad_masking,
            initial_state=initial_state, log_decay=self.log_decay(hidden_states.device), gate=gate,
            eps=self.config.linear_attention_eps, chunk_size=self.config.linear_attention_chunk_size,
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


MIXER_CLASSES = {"conv": JRTShortConv, "sliding_attention": JRTSlidingWindowAttention,
                 "linear_attention": JRTLinearAttention}


__all__ = [
    "MIXER_CLASSES", "MIX_OP", "JRTLinearAttention", "JRTShortConv", "JRTSlidingWindowAttention", "JRTStateLayer",
]
