"""`JRTRNNCache`: the constant-size inference state of a JRT-RNN / Based model, on transformers' public `Cache` API
(docs/generate.md, "The cache"; docs/architecture.md, "A cache that answers for itself").

One slot per layer, picked by `config.mixer_types`, each a fixed-shape buffer allocated for the batch by the first
forward and updated in place from then on (`is_compileable`; nothing is sized by `max_cache_len`):

    "conv"               JRTRNNConvState            last `K - 1` conv inputs (zeros before the first)  (B, D, K - 1)
    "sliding_attention"  JRTRNNSlidingWindowState   a ring of the last `W - 1` keys and values         (B, H, W - 1, Dh)
                                                    and which rows hold a real key (not padding/empty) (B, W - 1)
    "linear_attention"   JRTRNNLinearAttentionState the fp32 recurrent state                           (B, H, F, V + 1)

plus one counter tensor, `positions` `()` int64: the model positions read so far (the JRT fill included), from
which a decode step takes its RoPE position and each ring its row. With the padding flags and the prefix plan
(`PrefixPlan`) kept too, the caller passes nothing but the new tokens and their padding mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from .configuration_jrt import JRTRNNConfig

if TYPE_CHECKING:
    from .prefix_fill import PrefixPlan


def _static_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, marked as static for compiled functions (CUDA graphs read it in place), as transformers' static
    caches do. Not a CPU tensor: no CUDA graph reads it, and marking imports torch's compiler (seconds)."""
    if tensor.device.type != "cpu" and not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


def _in_place(buffer: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `values` may be written into `buffer` in place: not when either is part of an autograd graph, where
    the write is functional so that a backward through earlier steps still finds what it saved."""
    return not (torch.is_grad_enabled() and (values.requires_grad or buffer.requires_grad))


def _write(buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`buffer` holding `values` (same shape): in place where `_in_place` allows, else a new tensor."""
    if _in_place(buffer, values):
        return buffer.copy_(values)
    return values.to(buffer.dtype).clone(memory_format=torch.contiguous_format)


def _select_buffer_rows(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows `index` `(B',)` of a `(B, ...)` buffer: written into it in place when the batch keeps its size (beam
    search reorders every step; a compiled step keeps reading the same buffer), else a new (static) buffer."""
    rows = buffer.index_select(0, index.to(buffer.device))
    return _write(buffer, rows) if rows.shape == buffer.shape else _static_buffer(rows)


def _write_rows(buffer: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`buffer` with `values` at `index` along `dim` (`index_copy`): in place where `_in_place` allows."""
    values = values.to(buffer.dtype)
    if _in_place(buffer, values):
        return buffer.index_copy_(dim, index, values)
    return buffer.index_copy(dim, index, values)


class JRTRNNLayerState:
    """What transformers may read of one cache layer: not croppable (a recurrent state cannot be rolled back),
    compileable, `keys` / `values` None outside sliding attention. Subclasses name their per-row buffers `(B, ...)` in
    `BUFFERS` (None before the first forward)."""

    BUFFERS: tuple[str, ...] = ()
    is_compileable = True
    is_croppable = False
    is_sliding = False
    supports_early_init = False
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, name) for name in self.BUFFERS]

    @property
    def is_initialized(self) -> bool:
        """Whether a forward has allocated (and written) this layer's buffers."""
        return any(tensor is not None for tensor in self.tensors())

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (reorder, repeat) the rows `index` `(B',)` (`_select_buffer_rows`)."""
        for name in self.BUFFERS:
            if getattr(self, name) is not None:
                setattr(self, name, _select_buffer_rows(getattr(self, name), index))

    reorder_cache = select_rows

    def reset(self) -> None:
        for name in self.BUFFERS:
            setattr(self, name, None)

    def crop(self, max_length: int) -> None:
        raise ValueError("A JRT-RNN / Based cache holds a recurrent state, which cannot be rolled back to an earlier "
                         "length: recompute from the shorter prompt instead.")


class JRTRNNConvState(JRTRNNLayerState):
    """The last `kernel_size - 1` inputs `(B, D, K - 1)` of a short convolution (padding entered as zeros; zeros before
    the sequence's first input, which is what the causal convolution reads there)."""

    BUFFERS = ("inputs",)

    def __init__(self, kernel_size: int):
        self.kernel_size = kernel_size
        self.inputs: torch.Tensor | None = None

    def write(self, history: torch.Tensor | None, new_inputs: torch.Tensor) -> None:
        """Keep the last `K - 1` of the inputs `[history, new_inputs]` (`(B, D, K - 1)` or None for zeros, then
        `(B, D, t)`). The first call allocates the buffer; later calls write into it."""
        width, seq_len = self.kernel_size - 1, new_inputs.shape[-1]
        if seq_len >= width:
            newest = new_inputs[..., seq_len - width :]
        else:
            if history is None:
                history = new_inputs.new_zeros(new_inputs.shape[0], new_inputs.shape[1], width)
            newest = torch.cat([history[..., seq_len:].to(new_inputs.dtype), new_inputs], dim=-1)
        self.inputs = _static_buffer(newest.contiguous()) if self.inputs is None else _write(self.inputs, newest)


class JRTRNNSlidingWindowState(JRTRNNLayerState):
    """The last `sliding_window - 1` keys and values of a sliding-attention layer, as a ring `(B, H, W - 1, Dh)`: the
    key at model position p sits in row `p mod (W - 1)`. `key_mask` `(B, W - 1)` bool marks the rows that hold a real
    key. `written` `()` int64 counts the positions written (the ring's own clock, also without a cache around it)."""

    BUFFERS = ("keys", "values", "key_mask")
    is_sliding = True

    def __init__(self, sliding_window: int):
        self.sliding_window = sliding_window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.key_mask: torch.Tensor | None = None
        self.written: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.written = None

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor | None, in_order: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """New keys/values `(B, H, T, Dh)` and their padding mask `(B, T)` bool (None: no padding) -> the keys a query
        of them may see `(B, H, S, Dh)` with their mask `(B, S)` (None: a first forward without padding); the new keys
        are written into the ring. After the first forward the W - 1 ring rows come first: in token order for several
        queries or when `in_order`, else in ring order (one query: key order does not matter, RoPE is in the keys)."""
        rows, seq_len = self.sliding_window - 1, keys.shape[2]
        first = self.keys is None
        if first:
            batch_size, heads, _, head_dim = keys.shape
            self.keys = _static_buffer(keys.new_zeros(batch_size, heads, rows, head_dim))
            self.values = _static_buffer(values.new_zeros(batch_size, heads, rows, values.shape[-1]))
            self.key_mask = _static_buffer(torch.zeros(batch_size, rows, dtype=torch.bool, device=keys.device))
            self.written = _static_buffer(torch.zeros((), dtype=torch.long, device=keys.device))
        if rows == 0:
            return keys, values, key_mask
        given = key_mask  # a first forward without padding passes on None: the attention needs no mask then
        if key_mask is None:
            key_mask = torch.ones(keys.shape[0], seq_len, dtype=torch.bool, device=keys.device)
        if first:
            all_keys, all_values, all_mask = keys, values, given
        else:
            if seq_len == 1 and not in_order:  # ring order
                past_keys, past_values, past_mask = self.keys, self.values, self.key_mask
            else:  # token order: oldest first
                order = (self.written + torch.arange(rows, device=keys.device)) % rows
                past_keys, past_values = self.keys.index_select(2, order), self.values.index_select(2, order)
                past_mask = self.key_mask.index_select(1, order)
            all_keys = torch.cat([past_keys.to(keys.dtype), keys], dim=2)
            all_values = torch.cat([past_values.to(values.dtype), values], dim=2)
            all_mask = torch.cat([past_mask, key_mask], dim=1)
        # Write the newest min(T, W - 1) keys at their rows (key at position p -> row p mod (W - 1)).
        kept = min(seq_len, rows)
        first_slot = self.written if seq_len == kept else self.written + (seq_len - kept)
        if kept == 1:  # a decode step: one row (no index ramp)
            slots = torch.remainder(first_slot, rows).view(1)
        else:
            slots = (first_slot + torch.arange(kept, device=keys.device)) % rows
        self.keys = _write_rows(self.keys, 2, slots, keys[:, :, seq_len - kept :])
        self.values = _write_rows(self.values, 2, slots, values[:, :, seq_len - kept :])
        self.key_mask = _write_rows(self.key_mask, 1, slots, key_mask[:, seq_len - kept :])
        self.written.add_(seq_len)
        return all_keys, all_values, all_mask


class JRTRNNLinearAttentionState(JRTRNNLayerState):
    """The fp32 recurrent state `(B, H, F, V + 1)` of a linear-attention layer, or None before its first forward."""

    BUFFERS = ("state",)

    def __init__(self):
        self.state: torch.Tensor | None = None

    def write(self, state: torch.Tensor) -> None:
        """Keep `state`: the prefill's new tensor becomes the buffer; later states are copied into it."""
        if self.state is None:
            self.state = _static_buffer(state)
        elif state is not self.state:
            self.state = _write(self.state, state)


# The config fields that fix a cache's shapes and contents: only a model that agrees on each continues it.
CACHE_LAYOUT_FIELDS = (
    "mixer_types", "hidden_size", "num_attention_heads", "sliding_window", "conv_kernel_size", "conv_expansion",
    "feature_dim", "linear_attention_type", "rope_theta", "linear_attention_decay", "decay_const",
    "prefix_pad_masking",
)


CACHE_FORMAT = 2
"""The layout of a cache's states: 2 = fixed-shape buffers written in place (1, unnumbered: growing tensors)."""

LAYER_STATES = {
    "conv": lambda config: JRTRNNConvState(config.conv_kernel_size),
    "sliding_attention": lambda config: JRTRNNSlidingWindowState(config.sliding_window),
    "linear_attention": lambda config: JRTRNNLinearAttentionState(),
}


class JRTRNNCache(Cache):
    """The inference cache of `JRTRNNForCausalLM` (module docstring). `model(..., use_cache=True)` and `generate()`
    create one; pass it back as `cache=` (or `past_key_values=`) to continue. `JRTRNNCache(model.config)` passed to
    `generate()` (like `cache_implementation="static"`) runs the decode step compiled.

    Example:
        >>> out = model(input_ids, use_cache=True)
        >>> out.cache.get_seq_length()           # the caller's tokens read so far
        >>> step = model(next_ids, cache=out.cache)
    """

    is_compileable = True  # fixed-shape buffers updated in place: generate() compiles the decode step on it
    is_croppable = False  # a recurrent state cannot be rolled back: assisted decoding is refused

    def __init__(self, config: JRTRNNConfig):
        super().__init__(layers=[LAYER_STATES[kind](config) for kind in config.mixer_types])
        self.format = CACHE_FORMAT
        self.mixer_types = list(config.mixer_types)
        self.layout = {field: getattr(config, field) for field in CACHE_LAYOUT_FIELDS}
        self.positions: torch.Tensor | None = None  # `()` int64 once a forward ran (module docstring)
        # `(B,)` int64: the caller's real tokens read per row (a continuation's mask is checked against them).
        self.real_tokens: torch.Tensor | None = None
        self.prefix: PrefixPlan | None = None  # the plan of the first forward (`plan_prefix`)
        self.num_rows: int | None = None
        # (inputs, mask) of a first prefill chunk without every row's whole prefix, read again with the next chunk:
        # the JRT encoder reads a prompt in one forward (`prepare_inputs_for_generation`).
        self.pending_prefill: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # Set by beam search (`reorder_cache`): the rows hold beams, not the sequences generate() returned.
        self.holds_beams = False

    @property
    def has_state(self) -> bool:
        """Whether a forward has read tokens into the cache (no device synchronisation)."""
        return getattr(self, "positions", None) is not None

    @property
    def fill_columns(self) -> int:
        return 0 if self.prefix is None else self.prefix.fill_columns

    @property
    def num_read(self) -> int:
        """The caller's columns read (batch padding included, the prefix fill excluded); reads the counter tensor."""
        return int(self.positions) - self.fill_columns if self.has_state else 0

    def advance(
        self, num_positions: int, real_tokens: torch.Tensor | int, batch_size: int, device: torch.device
    ) -> None:
        """Count `num_positions` more model positions read, of which `real_tokens` (`(B,)`, or one count for every
        row) are the caller's real tokens (the last step of every forward, compiled or not)."""
        if self.positions is None:
            self.positions = _static_buffer(torch.zeros((), dtype=torch.long, device=device))
            self.real_tokens = _static_buffer(torch.zeros(batch_size, dtype=torch.long, device=device))
        self.positions.add_(num_positions)
        self.real_tokens.add_(real_tokens)
        self.num_rows = batch_size

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The caller's columns this cache has read (what `generate()` skips when it continues from the cache)."""
        return self.num_read

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """No maximum length: the state has a constant size (-1, as transformers' recurrent layers answer)."""
        return -1

    get_max_length = get_max_cache_shape  # its other name
    max_cache_len = property(get_max_cache_shape)

    def check_layout(self, config: JRTRNNConfig) -> None:
        """Refuse a cache unpickled from a release of another layout (`CACHE_FORMAT`), and, naming the field, a model
        whose config disagrees on a `CACHE_LAYOUT_FIELDS` field."""
        if getattr(self, "format", None) != CACHE_FORMAT:
            raise ValueError("This cache was made by an earlier jrt-rnn release (another layout of its states): it "
                             "cannot be continued here; generate again from the sequence with a fresh cache.")
        for field in CACHE_LAYOUT_FIELDS:
            value = getattr(config, field)
            if self.layout.get(field) != value:
                raise ValueError(f"The cache was built for {field}={self.layout.get(field)!r}, but this model has "
                                 f"{field}={value!r}: pass `JRTRNNCache(model.config)`, or the cache this model "
                                 "returned.")

    @property
    def is_sliding(self) -> list[bool]:
        return [kind == "sliding_attention" for kind in self.mixer_types]

    @property
    def is_linear(self) -> list[bool]:
        # Never skip `get_seq_length()`: unlike transformers' own recurrent layers, this cache counts what it read.
        return [False] * len(self.layers)

    is_initialized = has_state

    @property
    def max_batch_size(self) -> int | None:
        return self.num_rows

    def take_pending_prefill(
        self, inputs: torch.Tensor, attention_mask: torch.Tensor | None, config: JRTRNNConfig
    ) -> tuple[torch.Tensor, torch.Tensor | None, JRTRNNCache]:
        """The kept chunk followed by the new one `inputs`, with the mask of both, and a fresh cache for them: the
        next forward reads them as one first forward (the one-shot prefix)."""
        kept, kept_mask = self.pending_prefill
        self.pending_prefill = None
        combined = torch.cat([kept, inputs.to(kept.device)], dim=1)
        if attention_mask is None and kept_mask is not None:
            attention_mask = torch.cat([kept_mask, kept_mask.new_ones(kept_mask.shape[0], inputs.shape[1])], dim=1)
        return combined, attention_mask, JRTRNNCache(config)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (reorder, repeat) the rows `index` `(B',)` of every state (in place when B' = B); rows outside
        `[0, B)` are refused (outside torch.compile tracing)."""
        index = torch.as_tensor(index)
        if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"The rows to keep must be a 1D tensor of integer row indices, got {index.dtype} "
                             f"of shape {tuple(index.shape)}.")
        if self.num_rows is not None and index.numel() and not torch.compiler.is_compiling():
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= self.num_rows:
                raise ValueError(
                    f"The cache holds rows 0 ... {self.num_rows - 1}; row {low if low < 0 else high} does not exist."
                )
        for layer in self.layers:
            layer.select_rows(index)
        if self.real_tokens is not None:
            self.real_tokens = _select_buffer_rows(self.real_tokens, index)
        if self.prefix is not None:
            self.prefix = self.prefix.select_rows(index)
        if self.num_rows is not None:
            self.num_rows = int(index.shape[0])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` of the new cache is row `beam_idx[i]` of this one."""
        self.select_rows(beam_idx)
        self.holds_beams = True

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (row b becomes rows b * repeats ... b * repeats + repeats - 1)."""
        if self.num_rows is not None:
            self.select_rows(torch.arange(self.num_rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # transformers' name and parameter
        self.select_rows(indices)

    crop = JRTRNNLayerState.crop  # the same refusal

    def reset(self) -> None:
        """Forget the sequence: every state empty, as a new cache."""
        for layer in self.layers:
            layer.reset()
        self.positions = self.real_tokens = self.prefix = self.num_rows = self.pending_prefill = None
        self.holds_beams = False

    def __repr__(self) -> str:
        return f"JRTRNNCache(layers={self.mixer_types}, rows={self.num_rows}, tokens_read={self.num_read})"


__all__ = [
    "CACHE_LAYOUT_FIELDS", "JRTRNNCache", "JRTRNNConvState", "JRTRNNLayerState", "JRTRNNLinearAttentionState",
    "JRTRNNSlidingWindowState",
]
