"""`JRTRNNCache`: the constant-size inference state of a JRT-RNN / Based model, on transformers' public `Cache` API.

One slot per layer, picked by `config.mixer_types`:

    "conv"               JRTRNNConvState           the last `K - 1` convolution inputs        (B, D, <= K - 1)
    "sliding_attention"  JRTRNNSlidingWindowState  the last `W - 1` keys and values, and       (B, H, <= W - 1, Dh)
                                                   which of them are padding                  (B, <= W - 1)
    "linear_attention"   JRTRNNLinearAttentionState the fp32 recurrent state                   (B, H, F, V + 1)

So the cache never grows with the sequence. Everything the model needs to continue a sequence lives here, nothing
in the caller's inputs but the new tokens and the padding mask: the sliding window keeps the padding flags of its own
keys, the convolution keeps its inputs with padding already zeroed, and the cache records how the first forward laid
out the JRT prefix (`JRTRNNPrefixRecord`: each row's fill and encoder range). A `copy.deepcopy` or a pickle of the
cache therefore continues exactly like the original.

Sequence length: `get_seq_length()` counts the caller's columns this cache has read (batch padding included, the
JRT prefix fill excluded), which is what `GenerationMixin.generate` uses to skip the tokens a cache already holds when
it continues from one, for every layer mix (also a model without any attention layer).

The cache is `Cache`'s public subclass API only (`layers`, `get_seq_length`, `reorder_cache`,
`batch_repeat_interleave`, `batch_select_indices`, `crop`, `reset`, `is_compileable`): it is the same object on every
transformers release this package supports. transformers reads more of a cache, and of its layers, from release to
release (5.25 asks every layer `is_croppable` before assisted decoding; its tests read `keys` / `values`). The cache
answers those questions itself (`is_croppable`, `is_compileable`, `is_initialized`, `get_max_length`, ...), and every
layer state derives from `JRTRNNLayerState`, which answers them for one layer the way transformers' own recurrent
layers do: not croppable, not compileable, `keys` / `values` None where the layer holds no attention keys. Nothing
here subclasses transformers' layer classes, whose abstract methods change between releases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .configuration_jrt import JRTRNNConfig


def _rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor.index_select(0, index.to(tensor.device))


class JRTRNNLayerState:
    """What transformers (any release of the range) may read of one cache layer, answered for a layer of this model.

    A recurrent state cannot be rolled back (`is_croppable` False: assisted decoding is refused with transformers' own
    `ValueError`), has no fixed-address buffers (`is_compileable` False) and, outside a sliding-attention layer, holds
    no attention keys or values (`keys` / `values` None). Subclasses list their tensors in `tensors()`.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def select_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def is_initialized(self) -> bool:
        """Whether a forward has written this layer's state."""
        return any(tensor is not None for tensor in self.tensors())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def crop(self, max_length: int) -> None:
        raise ValueError(CROP_REFUSED)


CROP_REFUSED = (
    "A JRT-RNN / Based cache holds a recurrent state, which cannot be rolled back to an earlier length: recompute from "
    "the shorter prompt instead."
)


class JRTRNNConvState(JRTRNNLayerState):
    """The last `kernel_size - 1` inputs `(B, D, <= K - 1)` of a short convolution (padding entered as zeros)."""

    def __init__(self, kernel_size: int):
        self.kernel_size = kernel_size
        self.inputs: torch.Tensor | None = None

    def update(self, new_inputs: torch.Tensor) -> torch.Tensor:
        """new_inputs `(B, D, T)` -> the earlier inputs followed by the new ones `(B, D, <= K - 1 + T)`; keeps the
        last `K - 1` of them."""
        full = new_inputs if self.inputs is None else torch.cat([self.inputs.to(new_inputs.dtype), new_inputs], dim=-1)
        self.inputs = full[..., max(full.shape[-1] - (self.kernel_size - 1), 0) :]
        return full

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.inputs]

    def select_rows(self, index: torch.Tensor) -> None:
        self.inputs = _rows(self.inputs, index)


class JRTRNNSlidingWindowState(JRTRNNLayerState):
    """The last `sliding_window - 1` keys and values `(B, H, <= W - 1, Dh)` of a sliding-attention layer, with their
    padding flags `(B, <= W - 1)` (None while no key was padding). Exactly `W - 1` keys from the first use, for every
    window (a window of 1 keeps none)."""

    is_sliding = True

    def __init__(self, sliding_window: int):
        self.sliding_window = sliding_window
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.key_mask: torch.Tensor | None = None

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """New keys/values `(B, H, T, Dh)` and their padding mask `(B, T)` bool (None: no padding) -> the cached
        window followed by the new states `(B, H, S, Dh)` and the mask of those S keys (None: no padding)."""
        past = 0 if self.keys is None else self.keys.shape[2]
        if self.keys is not None:
            keys = torch.cat([self.keys, keys], dim=2)
            values = torch.cat([self.values, values], dim=2)
        if key_mask is not None or self.key_mask is not None:
            batch_size, new = keys.shape[0], keys.shape[2] - past
            old = self.key_mask
            if old is None:
                old = torch.ones(batch_size, past, dtype=torch.bool, device=keys.device)
            if key_mask is None:
                key_mask = torch.ones(batch_size, new, dtype=torch.bool, device=keys.device)
            key_mask = torch.cat([old, key_mask.bool()], dim=1)
        start = max(keys.shape[2] - (self.sliding_window - 1), 0)
        self.keys, self.values = keys[:, :, start:], values[:, :, start:]
        self.key_mask = None if key_mask is None else key_mask[:, start:]
        return keys, values, key_mask

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.keys, self.values, self.key_mask]

    def select_rows(self, index: torch.Tensor) -> None:
        self.keys, self.values, self.key_mask = (_rows(t, index) for t in self.tensors())


class JRTRNNLinearAttentionState(JRTRNNLayerState):
    """The fp32 recurrent state `(B, H, F, V + 1)` of a linear-attention layer (numerator | denominator), or None
    before the layer's first forward."""

    def __init__(self):
        self.state: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.state]

    def select_rows(self, index: torch.Tensor) -> None:
        self.state = _rows(self.state, index)


@dataclass
class JRTRNNPrefixRecord:
    """How the first forward of the cached sequence laid out the JRT prefix (`modeling_jrt.prefix_fill`).

    Attributes:
        fill_columns: columns the model put in front of the caller's first column (the widest fill of the batch);
            the model's own position of caller column `j` is `fill_columns + j`.
        prompt_lengths: `(B,)` caller tokens of each row that formed its prompt (the encoder read
            `min(prefix_length, prompt)` of them, after the fill).
        prefix_lengths: `(B,)` tokens the encoder read per row, the fill included (0 for a causal model).
        strategy: the prefix strategy of the first forward (`"pad"`, `"repeat"` or `"none"`).
        pad_token_id: the fill token of `"pad"`.
    """

    fill_columns: int
    prompt_lengths: torch.Tensor
    prefix_lengths: torch.Tensor
    strategy: str
    pad_token_id: int | None

    def select_rows(self, index: torch.Tensor) -> None:
        self.prompt_lengths = _rows(self.prompt_lengths, index)
        self.prefix_lengths = _rows(self.prefix_lengths, index)


# The config fields that fix the shapes a cache holds: a cache is continued only by a model that agrees on each.
CACHE_LAYOUT_FIELDS = (
    "mixer_types", "hidden_size", "num_attention_heads", "sliding_window", "conv_kernel_size", "conv_expansion",
    "feature_dim", "linear_attention_type",
)


def cache_layout(config: JRTRNNConfig) -> dict[str, object]:
    """The values of `CACHE_LAYOUT_FIELDS` in `config`."""
    return {field: getattr(config, field) for field in CACHE_LAYOUT_FIELDS}


LAYER_STATES = {
    "conv": lambda config: JRTRNNConvState(config.conv_kernel_size),
    "sliding_attention": lambda config: JRTRNNSlidingWindowState(config.sliding_window),
    "linear_attention": lambda config: JRTRNNLinearAttentionState(),
}


class JRTRNNCache(Cache):
    """The inference cache of `JRTRNNForCausalLM`: constant size, one state per layer (see the module docstring).

    `model(..., use_cache=True)` and `generate()` create one; pass it back as `cache=` (or `past_key_values=`) to
    continue the sequence. Build one yourself with `JRTRNNCache(model.config)`.

    Example:
        >>> out = model(input_ids, use_cache=True)
        >>> out.cache.get_seq_length()           # the caller's tokens read so far
        >>> step = model(next_ids, cache=out.cache)
    """

    is_compileable = False  # no fixed-shape buffers: generate() does not auto-compile on it
    is_croppable = False  # a recurrent state cannot be rolled back: assisted decoding is refused

    def __init__(self, config: JRTRNNConfig):
        super().__init__(layers=[LAYER_STATES[kind](config) for kind in config.mixer_types])
        self.mixer_types = list(config.mixer_types)
        self.layout = cache_layout(config)
        self.num_read = 0  # caller columns read (batch padding included, the prefix fill excluded)
        self.prefix: JRTRNNPrefixRecord | None = None
        self.num_rows: int | None = None
        # A prefill chunk of `generate(prefill_chunk_size=...)` whose rows may not hold their whole prompt yet
        # (`remember_prefill_chunk`): (tokens or embeddings, padding mask), read again with the next chunk.
        self.pending_prefill: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # Set by beam search (`reorder_cache`): the rows hold beams, not the sequences generate() returned.
        self.holds_beams = False

    # ------------------------------------------------------------------------------------------------ reading
    @property
    def has_state(self) -> bool:
        """Whether the cache holds a sequence (a forward has read tokens into it)."""
        return self.num_read > 0

    @property
    def fill_columns(self) -> int:
        return 0 if self.prefix is None else self.prefix.fill_columns

    @property
    def num_positions(self) -> int:
        """Positions the model has read: the caller's columns plus the fill in front of them (RoPE counts these)."""
        return self.num_read + self.fill_columns

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """The caller's columns this cache has read (what `generate()` skips when it continues from the cache)."""
        return self.num_read

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """No maximum length: the state has a constant size (-1, as transformers' recurrent layers answer)."""
        return -1

    def get_max_length(self, layer_idx: int = 0) -> int:
        """`get_max_cache_shape` under its newer name."""
        return -1

    @property
    def max_cache_len(self) -> int:
        return -1

    def check_layout(self, config: JRTRNNConfig) -> None:
        """Refuse, naming the field, to be continued by a model whose config fixes other shapes (`CACHE_LAYOUT_FIELDS`):
        a cache built for another `sliding_window` would otherwise run with a window the model was not trained for."""
        for field, value in cache_layout(config).items():
            if self.layout.get(field) != value:
                raise ValueError(
                    f"The cache was built for {field}={self.layout.get(field)!r}, but this model has {field}={value!r}: "
                    "pass `JRTRNNCache(model.config)`, or the cache this model returned."
                )

    @property
    def is_sliding(self) -> list[bool]:
        return [kind == "sliding_attention" for kind in self.mixer_types]

    @property
    def is_linear(self) -> list[bool]:
        # Never skip `get_seq_length()`: unlike transformers' own recurrent layers, this cache counts what it read.
        return [False] * len(self.layers)

    @property
    def is_initialized(self) -> bool:
        return self.has_state

    @property
    def max_batch_size(self) -> int | None:
        return self.num_rows

    def linear_attention_state(self, layer_idx: int) -> torch.Tensor | None:
        return self.layers[layer_idx].state

    # ------------------------------------------------------------------------------------------- chunked prefill
    def remember_prefill_chunk(
        self, inputs: torch.Tensor, attention_mask: torch.Tensor | None, holds_every_prefix: bool
    ) -> None:
        """Keep the first chunk of a chunked prefill (`(B, T)` ids or `(B, T, hidden)` embeddings and its mask) unless
        it holds every row's whole prefix (`generation.holds_every_prefix`): a row's prompt may go on in the next
        chunk, and the JRT encoder must read the prompt in one forward."""
        self.pending_prefill = None if holds_every_prefix else (inputs, attention_mask)

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

    # ------------------------------------------------------------------------------------------------ rows
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (and reorder, or repeat) the rows `index` `(B',)` of every state."""
        for layer in self.layers:
            layer.select_rows(index)
        if self.prefix is not None:
            self.prefix.select_rows(index)
        if self.num_rows is not None:
            self.num_rows = int(index.shape[0])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` of the new cache is row `beam_idx[i]` of this one."""
        self.select_rows(beam_idx)
        self.holds_beams = True

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times in place (row b becomes rows b * repeats ... b * repeats + repeats - 1)."""
        if self.num_rows is None:
            return
        self.select_rows(torch.arange(self.num_rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(torch.as_tensor(indices))

    def crop(self, max_length: int) -> None:
        raise ValueError(CROP_REFUSED)

    def reset(self) -> None:
        """Forget the sequence: every state empty, as a new cache."""
        for layer in self.layers:
            for name in vars(layer):
                if name not in ("kernel_size", "sliding_window"):
                    setattr(layer, name, None)
        self.num_read, self.prefix, self.num_rows, self.pending_prefill = 0, None, None, None
        self.holds_beams = False

    def __repr__(self) -> str:
        return f"JRTRNNCache(layers={self.mixer_types}, rows={self.num_rows}, tokens_read={self.num_read})"


__all__ = [
    "CACHE_LAYOUT_FIELDS",
    "JRTRNNCache",
    "JRTRNNConvState",
    "JRTRNNLayerState",
    "JRTRNNLinearAttentionState",
    "JRTRNNPrefixRecord",
    "JRTRNNSlidingWindowState",
]
