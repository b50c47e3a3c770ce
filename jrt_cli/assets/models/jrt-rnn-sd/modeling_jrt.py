"""JRT-RNN / Based for HuggingFace Transformers: layers, `JRTRNNModel` and `JRTRNNForCausalLM`.

The stack (docs/reference_architecture.md §1): token embedding -> N pre-norm blocks -> RMSNorm -> tied LM head.
Each block is
    residual += mixer(RMSNorm(residual));  residual += SwiGLU(RMSNorm(residual))
with an fp32 residual stream, where the mixer is picked by `config.layer_types[i]`:
    "conv"               gated short convolution (depthwise causal conv, SiLU, multiplicative gate)
    "sliding_attention"  softmax attention over the last `sliding_window` tokens, RoPE on q and k
    "linear_attention"   Taylor-feature linear attention, prefix (JRT-RNN) or causal (Based, optional decay)

All state lives in transformers' own `Cache` built from `config.layer_types`: the last inputs of each convolution,
the last `sliding_window - 1` keys/values of each sliding layer and the fp32 linear-attention state. The first forward
with an empty cache runs the parallel prefill (chunked PyTorch or the Triton kernel); later single-token forwards
are O(1) recurrent steps.

This folder is self-contained (relative imports, torch and transformers only) so it can ship as Hub remote code.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)
from transformers.generation import (
    BaseStreamer,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessorList,
)
from transformers.generation.utils import GenerateOutput
from transformers.masking_utils import create_recurrent_attention_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_jrt import JRTRNNConfig
from .generation import (
    CallerView,
    CallerViewLogitsProcessor,
    align_linear_attention_mask,
    cache_has_state,
    DEFAULT_PREFIX_STRATEGY,
    cached_prompt,
    chunked_prefill,
    generate_with_prefix,
    never_generated_ids,
)
from .linear_attention import linear_attention_step, prefix_linear_attention
from .sliding_window import BLOCKED_IMPLEMENTATIONS, blocked_sliding_window_attention
from .loss import ignore_prefix_targets, jrt_loss

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.get_logger(__name__)

# Inference-time token chunking of the position-wise parts (RMSNorm, SwiGLU MLP, the short-conv block). A long prefill
# would otherwise build `(B, T, width)` intermediates that grow with T: at 16k tokens the conv and MLP ones pass glibc's
# largest mmap threshold (32 MiB), so each is a fresh mmap that is page-faulted in, and the peak memory grows with them.
# Chunking keeps every such intermediate below INFERENCE_CHUNK_ELEMENTS elements (8 MiB in fp32), never shorter than
# MIN_INFERENCE_CHUNK rows. It runs only when autograd is off (`torch.no_grad` / `torch.inference_mode`, as in
# `generate()`) and outside `torch.compile` tracing, so training and compiled graphs see the unchunked ops.
INFERENCE_CHUNK_ELEMENTS = 1 << 21
MIN_INFERENCE_CHUNK = 64


def inference_chunk_rows(rows: int, width: int) -> int | None:
    """Rows per chunk for `rows` positions whose widest intermediate has `width` elements per row, or None when the
    op should run unchunked (autograd on, `torch.compile` tracing, or `rows` already fits one chunk)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    chunk = max(MIN_INFERENCE_CHUNK, INFERENCE_CHUNK_ELEMENTS // max(width, 1))
    return chunk if rows > chunk else None


def map_position_chunks(
    fn: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor, width: int
) -> torch.Tensor:
    """`fn(hidden_states)` for a position-wise `fn` (each output row depends on its own input row only), computed over
    row chunks of `hidden_states` `(..., C)` viewed as `(rows, C)` when `inference_chunk_rows` says so; the rows land
    in one preallocated output `(..., C_out)`. `width`: the widest intermediate of `fn` per row, in elements."""
    rows = hidden_states.numel() // max(hidden_states.shape[-1], 1)
    chunk = inference_chunk_rows(rows, width)
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


class JRTRNNRMSNorm(nn.Module):
    """RMSNorm with weight only: y = x / sqrt(mean(x**2) + eps) * w, computed in fp32, returned in w's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., hidden); in token chunks during inference (`map_position_chunks`)."""
        return map_position_chunks(self._normalize, hidden_states, hidden_states.shape[-1])

    def _normalize(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (hidden_states * self.weight.float()).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class JRTRNNRotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE over the full head dim, as flash-attn's RotaryEmbedding in the reference."""

    def __init__(self, config: JRTRNNConfig):
        super().__init__()
        self.config = config
        self.inv_freq = nn.Buffer(self.compute_inv_freq(config), persistent=False)

    @staticmethod
    def compute_inv_freq(config: JRTRNNConfig) -> torch.Tensor:
        dim = config.head_dim
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, T) -> cos, sin (B, T, head_dim) in x's dtype, computed in fp32."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, H, T, D); cos, sin (B, T, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with an additive (B, 1, T, S) mask. q (B, H, T, D), k/v (B, H, S, D) -> (B, T, H, D)."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (B, T, H, D)
    return output, weights


class JRTRNNShortConv(nn.Module):
    """Gated short convolution (Based `BaseConv`, docs/reference_architecture.md §1.1).

        u, g = in_proj(x).chunk(2)              u, g: (B, T, D) with D = conv_expansion * hidden_size
        c = causal depthwise conv_K(u)          tap K-1 multiplies u_t, tap 0 multiplies u_{t-K+1}
        y = out_proj(SiLU(c) * g)

    Cache: the last K inputs u of the convolution (a `"conv"` layer of transformers' cache).
    """

    def __init__(self, config: JRTRNNConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel_size = config.conv_kernel_size
        self.inner_size = config.conv_expansion * config.hidden_size
        self.in_proj = nn.Linear(config.hidden_size, 2 * self.inner_size, bias=config.conv_bias)
        self.conv = nn.Conv1d(
            self.inner_size, self.inner_size, kernel_size=self.kernel_size, groups=self.inner_size, bias=False
        )
        self.out_proj = nn.Linear(self.inner_size, config.hidden_size, bias=config.conv_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, T, hidden), attention_mask (B, >= T) -> (B, T, hidden).

        During inference a long input goes through in token chunks (`inference_chunk_rows`), each chunk's convolution
        reading the last K - 1 inputs before it (through the cache, or carried here without one), so that no
        `(B, T, 2 * D)` intermediate is built; the result equals the one-pass forward. A cache that records its whole
        past (`record_past`) keeps the one-pass forward, as chunking it would copy the growing past per chunk."""
        batch_size, seq_len = hidden_states.shape[:2]
        mask = None if attention_mask is None else attention_mask[:, -seq_len:]  # (B, T)
        chunk = inference_chunk_rows(seq_len, batch_size * 2 * self.inner_size)
        if chunk is not None and cache is not None and getattr(cache.layers[self.layer_idx], "record_past", False):
            chunk = None
        if chunk is None:
            return self._mix(hidden_states, mask, cache, None)[0]
        output = None
        past_inputs = None  # (B, D, K - 1) the convolution inputs before the chunk, without a cache
        for start in range(0, seq_len, chunk):
            end = min(start + chunk, seq_len)
            part, past_inputs = self._mix(
                hidden_states[:, start:end], None if mask is None else mask[:, start:end], cache, past_inputs
            )
            if output is None:
                output = part.new_empty(batch_size, seq_len, part.shape[-1])
            output[:, start:end] = part
        return output

    def _mix(
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Cache | None,
        past_inputs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over hidden_states (B, t, hidden) with its mask (B, t); past_inputs (B, D, K - 1): the convolution
        inputs before these tokens when no cache holds them. Returns the output (B, t, hidden) and the last K - 1
        convolution inputs (B, D, <= K - 1) for the next chunk."""
        seq_len = hidden_states.shape[1]
        # 1. Input projection into the convolution branch and the gate.
        conv_input, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, t, D) each
        # 2. Padded positions enter the convolution as zeros, so pads never reach the window of a real token.
        if mask is not None:
            conv_input = conv_input * mask[:, :, None].to(conv_input.dtype)
        conv_input = conv_input.transpose(1, 2)  # (B, D, t)
        # 3. Causal depthwise convolution over [earlier inputs, new inputs]; the cache keeps the last K inputs.
        if cache is not None:
            conv_input = cache.update_conv_state(conv_input, self.layer_idx, conv_kernel_size=self.kernel_size)
        elif past_inputs is not None:
            conv_input = torch.cat([past_inputs, conv_input], dim=-1)
        conv_output = F.conv1d(
            F.pad(conv_input, (self.kernel_size - 1, 0)), self.conv.weight, groups=self.inner_size
        )[..., -seq_len:]  # (B, D, t)
        tail = conv_input[..., max(conv_input.shape[-1] - (self.kernel_size - 1), 0) :]
        # 4. SiLU, multiplicative gate, output projection.
        return self.out_proj(F.silu(conv_output).transpose(1, 2) * gate), tail


class JRTRNNSlidingWindowAttention(nn.Module):
    """Causal softmax attention over the last `sliding_window` tokens (itself included), RoPE on q and k.

    The reference's fused `Wqkv` is split into `q_proj`, `k_proj`, `v_proj` (rows q | k | v) by the converter.

    Two paths, picked by the mask `JRTRNNModel.forward` hands over:
    - a 2D key padding mask `(B, T_total)` or None, with the `"eager"` or `"sdpa"` implementation: the blocked
      O(T * W) attention of `sliding_window.py` (prefill, chunked prefill, training);
    - anything else (the small 4D mask of a decode step, a static cache's prepared mask, a flash-attention padding
      mask, a flex `BlockMask`): the implementation transformers registers under `config._attn_implementation`.
    """

    def __init__(self, config: JRTRNNConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.sliding_window = config.sliding_window
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch_size, seq_len, _ = hidden_states.shape
        hidden_shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        # 1. Projections and RoPE.
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        # 2. The cached window goes in front of the new keys.
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)  # (B, H, S, D): cached window + new tokens
        # 3. Attention: blocked for a padding mask, the registered implementation otherwise.
        implementation = self.config._attn_implementation
        if implementation in BLOCKED_IMPLEMENTATIONS and (attention_mask is None or attention_mask.dim() == 2):
            output = blocked_sliding_window_attention(
                query, key, value, _key_padding_mask(attention_mask, key.shape[2]),
                sliding_window=self.sliding_window, scaling=self.scaling, implementation=implementation,
            )  # (B, T, H, D)
            return self.o_proj(output.reshape(batch_size, seq_len, -1)), None
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        output, weights = attention_interface(
            self, query, key, value, attention_mask,
            dropout=0.0, scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )  # (B, T, H, D); weights (B, H, T, S) with eager attention, else None
        return self.o_proj(output.reshape(batch_size, seq_len, -1)), weights


class JRTRNNSlidingWindowCacheLayer(DynamicSlidingWindowLayer):
    """transformers' dynamic sliding-window cache layer, made correct for `sliding_window = 1`.

    The parent keeps the last `sliding_window - 1` keys with `keys[:, :, -sliding_window + 1:]`, and for a window
    of 1 that slice is `[-0:]`, i.e. every key: the cache grows without bound while its mask sizes
    (`get_mask_sizes`) still assume an empty window, so a decode step attended to every past token and cached decode
    differed from the parallel forward. This layer keeps exactly `max(sliding_window - 1, 0)` keys for every window.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value states `(B, H, T, D)` -> the cached window plus the new states `(B, H, S, D)`."""
        if self.record_past:  # assisted decoding keeps everything until `crop` (never used by JRT-RNN)
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        full_keys = torch.cat([self.keys, key_states], dim=-2) if self.keys.numel() else key_states
        full_values = torch.cat([self.values, value_states], dim=-2) if self.values.numel() else value_states
        start = max(full_keys.shape[-2] - (self.sliding_window - 1), 0)
        self.keys, self.values = full_keys[:, :, start:], full_values[:, :, start:]
        return full_keys, full_values


def use_exact_sliding_window_layers(cache: Cache) -> None:
    """Make every dynamic sliding-window layer of `cache` a `JRTRNNSlidingWindowCacheLayer` (in place).

    Caches are built by transformers (`generate()`, `DynamicCache(config=...)`) from `config.layer_types`, so the
    layer class cannot be chosen at construction; the class is switched on the model's first use of the cache. The
    subclass adds no state, so the switch keeps whatever the layer holds.
    """
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            layer.__class__ = JRTRNNSlidingWindowCacheLayer


def _key_padding_mask(attention_mask: torch.Tensor | None, num_keys: int) -> torch.Tensor | None:
    """The `(B, S)` bool padding mask of the S keys a sliding layer attends to (the last S tokens of the sequence),
    from the `(B, T_total)` mask of the whole sequence."""
    if attention_mask is None:
        return None
    if attention_mask.shape[1] < num_keys:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} tokens but the sliding-window layer attends to "
            f"{num_keys} (cached window + new tokens): pass the mask of the whole sequence, past tokens included."
        )
    return attention_mask[:, -num_keys:].bool()


def read_linear_attention_state(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The (B, H, F, V + 1) fp32 state of a linear-attention layer, or None before its first forward.

    Read the slot directly: `Cache.get_recurrent_state()` returns None for a layer without a conv state, which
    would silently restart every decode step from an empty state.
    """
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    return layer.recurrent_states[0] if layer.has_previous_state[0] else None


def write_linear_attention_state(cache: Cache, layer_idx: int, state: torch.Tensor) -> None:
    cache.update_recurrent_state(state, layer_idx)
    cache.layers[layer_idx].has_previous_state[0] = True


@dataclass
class JRTRNNEncoderRange:
    """Where the JRT encoder reads in one forward: row b reads positions `start[b] <= m < end[b]`.

    Attributes:
        start: `(B,)` int64, each row's first real token (after its left padding; 0 with right padding).
        end: `(B,)` int64, `start + min(prefix_length_b, real tokens of row b)`: padding never enters the encoder.
        length: `M = max(end)`, the leading positions the encoder projections are computed for.
    """

    start: torch.Tensor
    end: torch.Tensor
    length: int

    @property
    def prefix_lengths(self) -> torch.Tensor:
        """`(B,)` tokens each row's encoder reads (its prefix, counted from its first real token)."""
        return self.end - self.start


def prefix_encoder_range(
    prefix_length: int | torch.Tensor,
    attention_mask: torch.Tensor | None,
    batch_size: int,
    seq_len: int,
    device: torch.device,
) -> JRTRNNEncoderRange:
    """The per-row encoder range of a first forward (the prefix is an explicit, per-row quantity).

    Args:
        prefix_length: an int for every row, or a `(B,)` integer tensor of per-row prefix lengths, counted from each
            row's first real token.
        attention_mask: `(B, T)` 1 for real tokens, 0 for padding (left or right), or None (no padding).
        batch_size, seq_len: B and T of the forward.
        device: where the range lives (the device of the hidden states).
    """
    if isinstance(prefix_length, torch.Tensor):
        dtype = prefix_length.dtype
        if prefix_length.shape != (batch_size,) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(
                f"prefix_length must be an int or a (B,) = ({batch_size},) integer tensor of per-row prefix lengths; "
                f"got a {prefix_length.dtype} tensor of shape {tuple(prefix_length.shape)}."
            )
        lengths = prefix_length.to(device=device, dtype=torch.long)
        if bool((lengths < 0).any()):
            raise ValueError(f"prefix_length must be >= 0 in every row; got {lengths.tolist()}.")
    elif isinstance(prefix_length, int) and not isinstance(prefix_length, bool):
        if prefix_length < 0:
            raise ValueError(f"prefix_length must be >= 0; got {prefix_length}.")
        if attention_mask is None:  # the common case: no padding, no host sync
            length = min(prefix_length, seq_len)
            start = torch.zeros(batch_size, dtype=torch.long, device=device)
            return JRTRNNEncoderRange(start=start, end=start + length, length=length)
        lengths = torch.full((batch_size,), prefix_length, dtype=torch.long, device=device)
    else:
        raise TypeError(f"prefix_length must be an int or a (B,) LongTensor; got {type(prefix_length).__name__}.")
    if attention_mask is None:
        start = torch.zeros(batch_size, dtype=torch.long, device=device)
        real = torch.full((batch_size,), seq_len, dtype=torch.long, device=device)
    else:
        mask = attention_mask[:, -seq_len:].to(device=device).bool()  # (B, T)
        start = mask.long().argmax(-1)  # first real token; 0 for a row without any
        real = mask.sum(-1)
    end = start + torch.minimum(lengths, real)
    return JRTRNNEncoderRange(start=start, end=end, length=int(end.max()) if batch_size > 0 else 0)


class JRTRNNLinearAttention(nn.Module):
    """Taylor-feature linear attention: prefix (JRT-RNN, docs/reference_architecture.md §1.5) or causal (Based,
    §1.4).

    Prefix form: in the first forward of a sequence, each row's prefix (its `JRTRNNEncoderRange`) is also read
    non-causally through `k_enc_proj` / `v_enc_proj`; every query sees that encoder sum plus the causal sum over the
    decoder keys, under one shared denominator. Decoding continues from the state of both sums with one O(1) step
    per token. The layer computes projections only: the attention math is `linear_attention.py`'s.

    Based decay variant: a fixed per-head decay gamma_h = 1 - 2**(decay_const - h) on the numerator state and an
    input-dependent numerator gate `decay_proj(x)` (one unbounded value per head).
    """

    def __init__(self, config: JRTRNNConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.feature_dim = config.feature_dim
        self.head_dim = config.head_dim
        self.is_prefix = config.linear_attention_type == "prefix"
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.feature_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_heads * self.feature_dim, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        if self.is_prefix:
            self.k_enc_proj = nn.Linear(hidden, self.num_heads * self.feature_dim, bias=False)
            self.v_enc_proj = nn.Linear(hidden, hidden, bias=False)
        if config.use_decay_proj:
            self.decay_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def log_decay(self, device: torch.device) -> torch.Tensor | None:
        """(H,) log gamma_h of the fixed decay, computed on the fly (no buffer to restore after meta init)."""
        if not self.config.linear_attention_decay:
            return None
        heads = torch.arange(self.num_heads, device=device, dtype=torch.float64)
        return torch.log1p(-torch.pow(2.0, self.config.decay_const - heads)).float()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        encoder_range: JRTRNNEncoderRange | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(B, T, hidden)`; attention_mask `(B, T)` batch padding (0) of this forward's tokens;
        linear_attention_mask `(B, >= T)` the JRT prefix fill (0); encoder_range: the prefix of a first forward."""
        batch_size, seq_len, _ = hidden_states.shape
        heads = self.num_heads
        # 1. Decoder projections (and the Based gate).
        query = self.q_proj(hidden_states).view(batch_size, seq_len, heads, self.feature_dim)  # (B, T, H, K)
        key = self.k_proj(hidden_states).view(batch_size, seq_len, heads, self.feature_dim)  # (B, T, H, K)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, heads, self.head_dim)  # (B, T, H, V)
        gate = self.decay_proj(hidden_states) if self.config.use_decay_proj else None  # (B, T, H)
        log_decay = self.log_decay(hidden_states.device)
        state = read_linear_attention_state(cache, self.layer_idx)

        if state is not None and seq_len == 1:
            # 2a. Decode: one recurrent step.
            output, state = linear_attention_step(
                query[:, 0], key[:, 0], value[:, 0], state,
                log_decay=log_decay, gate=None if gate is None else gate[:, 0],
                eps=self.config.linear_attention_eps,
            )
            output = output[:, None]  # (B, 1, H, V)
        else:
            # 2b. Prefill (parallel form). Masked keys: batch padding (outside every encoder range, always removed)
            # and the JRT prefix fill (inside the range, removed as `prefix_pad_masking` says).
            key_mask = None if attention_mask is None else attention_mask[:, -seq_len:].bool()  # (B, T)
            if linear_attention_mask is not None:
                fill = linear_attention_mask[:, -seq_len:].bool()
                key_mask = fill if key_mask is None else key_mask & fill
            k_enc = v_enc = start = end = None
            if self.is_prefix and state is None and encoder_range is not None and encoder_range.length > 0:
                # 3. Encoder projections of the positions the encoder ranges cover (the first forward only).
                prefix = hidden_states[:, : encoder_range.length]
                k_enc = self.k_enc_proj(prefix).view(batch_size, -1, heads, self.feature_dim)  # (B, M, H, K)
                v_enc = self.v_enc_proj(prefix).view(batch_size, -1, heads, self.head_dim)  # (B, M, H, V)
                start, end = encoder_range.start, encoder_range.end
            output, state = prefix_linear_attention(
                query, key, value, k_enc, v_enc,
                encoder_start=start,
                encoder_end=end,
                key_mask=key_mask,
                pad_masking=self.config.prefix_pad_masking,
                initial_state=state,
                log_decay=log_decay,
                gate=gate,
                eps=self.config.linear_attention_eps,
                chunk_size=self.config.linear_attention_chunk_size,
                implementation=self.config.linear_attention_implementation,
            )
        if cache is not None:
            write_linear_attention_state(cache, self.layer_idx, state)
        # 4. Merge heads, output projection.
        return self.o_proj(output.reshape(batch_size, seq_len, -1).to(hidden_states.dtype))


class JRTRNNMLP(nn.Module):
    """SwiGLU: down_proj(up_proj(x) * SiLU(gate_proj(x))). The reference's fc1 rows are [up; gate]."""

    def __init__(self, config: JRTRNNConfig, layer_idx: int | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., hidden); in token chunks during inference (`map_position_chunks`)."""
        return map_position_chunks(self._swiglu, x, self.gate_proj.out_features)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


MIXER_CLASSES = {
    "conv": JRTRNNShortConv,
    "sliding_attention": JRTRNNSlidingWindowAttention,
    "linear_attention": JRTRNNLinearAttention,
}


class JRTRNNDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block on an fp32 residual stream: r += mixer(norm(r)); r += mlp(norm(r))."""

    def __init__(self, config: JRTRNNConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type not in MIXER_CLASSES:
            raise ValueError(f"Invalid layer type {self.layer_type!r} at layer {layer_idx}; allowed: {list(MIXER_CLASSES)}.")
        self.input_layernorm = JRTRNNRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.layer_type](config, layer_idx)
        # intermediate_size = 0: no MLP (the zoology synthetic-task models have none).
        has_mlp = config.intermediate_size > 0
        self.post_attention_layernorm = JRTRNNRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if has_mlp else None
        self.mlp = JRTRNNMLP(config, layer_idx) if has_mlp else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        encoder_range: JRTRNNEncoderRange | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states: (B, T, hidden) fp32 residual stream; returns the updated fp32 residual. `kwargs` (e.g.
        `output_attentions`) reach the mixer and, for sliding attention, transformers' attention function."""
        mixed = self.mixer(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            cache=cache,
            position_embeddings=position_embeddings,
            linear_attention_mask=linear_attention_mask,
            encoder_range=encoder_range,
            **kwargs,
        )
        if self.layer_type == "sliding_attention":  # (output, weights): output capturing records the weights
            mixed = mixed[0]
        hidden_states = hidden_states + mixed.float()  # a new tensor, owned here
        if self.mlp is None:
            return hidden_states
        # Norm, MLP and residual add are position-wise: during inference one pass per token chunk, added in place
        # into the residual this layer just made (no second (B, T, hidden) tensor).
        rows = hidden_states.numel() // hidden_states.shape[-1]
        chunk = inference_chunk_rows(rows, self.mlp.gate_proj.out_features)
        if chunk is None:
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)).float()
        flat = hidden_states.view(rows, hidden_states.shape[-1])
        for start in range(0, rows, chunk):
            part = flat[start : start + chunk]
            part += self.mlp(self.post_attention_layernorm(part)).float()
        return hidden_states


class JRTRNNPreTrainedModel(PreTrainedModel):
    config: JRTRNNConfig
    config_class = JRTRNNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["JRTRNNDecoderLayer"]
    _supports_sdpa = True
    # Windowed kernels: the sliding layers pass `sliding_window` to transformers' flash-attention and flex-attention
    # functions (through `ALL_ATTENTION_FUNCTIONS`), which build their own window from it.
    _supports_flash_attn = True
    _supports_flex_attn = True
    # `torch.compile(model, fullgraph=True)` traces prefill without padding and every decode step (with or without
    # padding). A left-padded prefill still graph-breaks on data-dependent checks in the linear-attention layer.
    _can_compile_fullgraph = True
    _is_stateful = True  # the recurrent state cannot be rolled back: no assisted decoding
    # `output_hidden_states`: the input of the first block, then every block's output (the last one after the final
    # norm); `output_attentions`: the weights of each sliding-window layer (eager attention only; sdpa refuses).
    _can_record_outputs = {
        "hidden_states": JRTRNNDecoderLayer,
        "attentions": OutputRecorder(JRTRNNSlidingWindowAttention, index=1),
    }

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, whose folder always loads with `trust_remote_code=True` alone.

        Both model classes and the config are registered for their auto classes (`register_for_auto_class`, at the
        end of this file and of `configuration_jrt.py`), so transformers copies this file, its relative imports and
        the config's file into the folder and names the saved class in `auto_map`, however the model was loaded
        (package import, remote code, a converted folder, `Trainer`, a merged PEFT adapter). `auto_map` also names
        the sibling auto class, so both `AutoModel` and `AutoModelForCausalLM` load the folder.
        """
        module = type(self).__module__.rsplit(".", 1)[-1]  # "modeling_jrt", also for a remote-code copy of it
        self.config.auto_map = {
            **(getattr(self.config, "auto_map", None) or {}),
            **{auto_class: f"{module}.{cls.__name__}" for cls, auto_class in _AUTO_CLASSES.items()},
        }
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Every parameter and every derived buffer (from_pretrained builds on the meta device)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, JRTRNNRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, JRTRNNRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq(module.config))


def _check_cache_layout(cache: Cache | None, config: JRTRNNConfig) -> None:
    """Every "conv" / "linear_attention" layer needs a recurrent-state slot in the cache. A key/value cache (such as
    the one PEFT prefix tuning fills with virtual-token keys and values) has none: fail with the fix, not deep inside."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    for index, layer_type in enumerate(config.layer_types):
        layer = layers[index] if index < len(layers) else None
        if layer_type in ("conv", "linear_attention") and not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ValueError(
                f"The cache holds {type(layer).__name__} at layer {index}, a {layer_type!r} layer that keeps a "
                "recurrent state: pass a cache built from this model's config (`DynamicCache(config=model.config)`) "
                "or none. Methods that inject attention key/value prefixes, such as PEFT prefix tuning "
                "(`PrefixTuningConfig`), cannot work with JRT-RNN / Based models; use prompt tuning "
                "(`PromptTuningConfig`) or LoRA instead."
            )


def check_attention_mask(
    attention_mask: torch.Tensor, batch_size: int, seq_len: int, cache: Cache | None, has_sliding: bool
) -> None:
    """Refuse a `(B, T_total)` padding mask that does not describe this forward's tokens.

    Its width must be the cached length plus `seq_len` (the cached length is known exactly when the model has
    sliding-window layers; a purely recurrent cache only bounds it below), and its values 0 or 1 (checked outside
    decode steps): any other width or value used to change the logits silently (the layers read the trailing columns,
    or weight tokens by the value).
    """
    if attention_mask.ndim != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(
            f"`attention_mask` must be (batch_size, past + seq_len) = ({batch_size}, ...), got shape "
            f"{tuple(attention_mask.shape)}."
        )
    width = attention_mask.shape[1]
    has_state = cache is not None and cache_has_state(cache)
    if has_state and has_sliding:
        expected = cache.get_seq_length() + seq_len
        if width != expected:
            raise ValueError(
                f"`attention_mask` has {width} columns but the cache holds {expected - seq_len} tokens and the input "
                f"{seq_len}: pass a mask over all {expected} tokens (cached and new)."
            )
    elif (width < seq_len) if has_state else (width != seq_len):
        raise ValueError(
            f"`attention_mask` has {width} columns but the input has {seq_len} tokens"
            + (" (and the cache some more)" if has_state else "")
            + ": pass one mask column per token."
        )
    # The values are checked when new tokens arrive in bulk; a decode step (one token after a checked prefill) skips
    # the check, which would cost a device synchronisation per generated token.
    is_decode_step = has_state and seq_len == 1
    if is_decode_step or torch.compiler.is_compiling():
        return
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError(
            "`attention_mask` must hold only 0 (padding) and 1 (token); got other values. Pass a binary mask "
            "(`mask.ne(0).long()` if any nonzero value means a token)."
        )


class JRTRNNModel(JRTRNNPreTrainedModel):
    """The backbone: embeddings, blocks and final norm. Returns the last hidden state and the cache."""

    def __init__(self, config: JRTRNNConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([JRTRNNDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = JRTRNNRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = JRTRNNRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def sliding_window_mask(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        output_attentions: bool = False,
    ) -> torch.Tensor | BlockMask | None:
        """The mask of the `sliding_attention` layers for this forward.

        A multi-token forward with eager or SDPA attention and a dynamic (or no) cache gets the 2D padding mask
        `(B, T_total)` itself (or None): the layers run the blocked O(T * W) attention and build only
        `(block, block + W - 1)` masks. Everything else gets transformers' `create_sliding_window_causal_mask`: a
        decode step (a `(B, 1, 1, <= W)` mask), a static cache (fixed-size buffers whose slots the mask tracks),
        a custom 4D mask, flash attention (a 2D mask or None) and flex attention (a `BlockMask`), and a forward that
        returns the attention weights (`output_attentions`: eager `(B, H, T, S)` weights are quadratic by nature).
        """
        blocked = (
            self.config._attn_implementation in BLOCKED_IMPLEMENTATIONS
            and inputs_embeds.shape[1] > 1
            and (attention_mask is None or attention_mask.dim() == 2)
            and (cache is None or not cache.is_compileable)
            and not output_attentions
        )
        if blocked:
            return attention_mask
        return create_sliding_window_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        prefix_length: int | torch.LongTensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """
        Args:
            input_ids: `(B, T)` token ids (or `inputs_embeds` `(B, T, hidden)`).
            attention_mask: `(B, T_total)` 1 for real tokens, 0 for padding (left padding), covering the cached tokens
                too; or the per-layer-type dict of prepared masks that `generate()` passes with a static cache.
            position_ids: `(B, T)` RoPE positions; default: counting on from the cached length.
            cache: a transformers `Cache` built from `config.layer_types` (`past_key_values` is accepted as a
                deprecated alias, as in transformers' own models).
            use_cache: create a `DynamicCache` when none is given (default `config.use_cache` in eval mode, False in
                training mode, so `Trainer(args=TrainingArguments(use_cache=True))` keeps `use_cache: true` in the
                checkpoints it saves without building a cache per training step).
            linear_attention_mask: `(B, T)` extra mask for the linear-attention layers only (0 = ignore the token as
                a key, e.g. the pads of the JRT prefix that the other layers read as ordinary tokens). Inside a row's
                encoder range these keys are removed as `config.prefix_pad_masking` says, elsewhere always.
            prefix_length: the JRT prefix of this forward: an int, or a `(B,)` LongTensor of per-row prefix lengths,
                counted from each row's first real token (after its left padding; with right padding the first real
                token is position 0); default `config.prefix_length`. The encoder reads each row's first
                `min(prefix_length_b, real tokens)` tokens, never padding, in the first forward of a sequence (a cache
                without linear-attention state). So the outputs at positions `>= prefix_length_b - 1` of a row never
                depend on later tokens.
            output_hidden_states, output_attentions, return_dict: (keywords) transformers' output capturing
                (`_can_record_outputs`); `return_dict=False` returns a tuple.
        """
        _check_cache_layout(cache, self.config)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if inputs_embeds.shape[1] == 0:
            raise ValueError(
                f"The input has 0 tokens (shape {tuple(inputs_embeds.shape[:2])}): pass at least one token; "
                "`generate()` without a prompt starts from `bos_token_id`."
            )
        if use_cache is None:  # config.use_cache is the inference default: training builds no cache unless asked
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if cache is not None:
            use_exact_sliding_window_layers(cache)
        has_sliding = "sliding_attention" in self.config.layer_types
        if isinstance(attention_mask, torch.Tensor):
            check_attention_mask(attention_mask, inputs_embeds.shape[0], inputs_embeds.shape[1], cache, has_sliding)

        if position_ids is None:
            past_length = cache.get_seq_length() if (cache is not None and has_sliding) else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_length
            position_ids = position_ids.unsqueeze(0)

        if isinstance(attention_mask, dict):
            mask_mapping = attention_mask
        else:
            recurrent_mask = create_recurrent_attention_mask(self.config, inputs_embeds, attention_mask, cache)
            mask_mapping = {"conv": recurrent_mask, "linear_attention": recurrent_mask}
            if has_sliding:
                mask_mapping["sliding_attention"] = self.sliding_window_mask(
                    inputs_embeds, attention_mask, cache, position_ids,
                    output_attentions=bool(kwargs.get("output_attentions", self.config.output_attentions)),
                )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if has_sliding else None
        prefix_range = self.encoder_range(prefix_length, mask_mapping.get("linear_attention"), inputs_embeds, cache)

        hidden_states = inputs_embeds.float()  # the residual stream stays fp32
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=mask_mapping.get(layer.layer_type),
                position_embeddings=position_embeddings,
                cache=cache,
                linear_attention_mask=linear_attention_mask,
                encoder_range=prefix_range,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)

    def encoder_range(
        self,
        prefix_length: int | torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inputs: torch.Tensor,
        cache: Cache | None,
    ) -> JRTRNNEncoderRange | None:
        """The per-row encoder range of this forward, or None when the encoder reads nothing: a causal (Based)
        model, or a cache whose linear-attention layers already hold the state of earlier tokens.

        Args:
            prefix_length: as in `forward` (None = `config.prefix_length`).
            attention_mask: `(B, >= T)` padding mask whose last T columns cover this forward's tokens, or None.
            inputs: `(B, T)` input ids or `(B, T, hidden)` embeddings of this forward (for B, T and the device).
            cache: the cache this forward continues, or None.
        """
        config = self.config
        if config.linear_attention_type != "prefix" or "linear_attention" not in config.layer_types:
            return None
        first_linear = config.layer_types.index("linear_attention")
        if read_linear_attention_state(cache, first_linear) is not None:
            return None
        batch_size, seq_len = inputs.shape[:2]
        prefix_length = config.prefix_length if prefix_length is None else prefix_length
        return prefix_encoder_range(prefix_length, attention_mask, batch_size, seq_len, inputs.device)


@dataclass
class JRTRNNCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus the two parts of the JRT objective (set only when `mlm_labels` are given).

    Args:
        ntp_loss: detached mean next-token cross-entropy of the batch.
        mlm_loss: detached mean masked-LM cross-entropy of the batch.
    """

    ntp_loss: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None


class JRTRNNForCausalLM(JRTRNNPreTrainedModel, GenerationMixin):
    """JRT-RNN / Based language model: `JRTRNNModel` plus a (tied) LM head.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> import modeling_jrt  # registers model_type "jrt_rnn"
        >>> config = modeling_jrt.JRTRNNConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4,
        ...                                    num_attention_heads=4, intermediate_size=128,
        ...                                    layer_types=["conv", "linear_attention", "sliding_attention", "conv"],
        ...                                    prefix_length=16, sliding_window=9)
        >>> model = AutoModelForCausalLM.from_config(config)
        >>> out = model(torch.randint(0, 128, (2, 20)), labels=torch.randint(0, 128, (2, 20)))
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: JRTRNNConfig):
        super().__init__(config)
        self.model = JRTRNNModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        # Generation defaults, saved in generation_config.json: how short prompts fill the JRT prefix, and the ids
        # never generated (padded vocabulary rows, [MASK]). Not a mere copy of the model config any more: without
        # the flag, transformers would drop `prefix_strategy` when it loads the file.
        self.generation_config.prefix_strategy = DEFAULT_PREFIX_STRATEGY
        self.generation_config._from_model_config = False
        if never_generated_ids(config):
            self.generation_config.suppress_tokens = never_generated_ids(config)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        linear_attention_mask: torch.Tensor | None = None,
        prefix_length: int | torch.LongTensor | None = None,
        **kwargs,
    ) -> JRTRNNCausalLMOutput:
        """
        Args:
            labels: `(B, T)` token ids; the loss is the mean next-token cross-entropy (labels are shifted inside,
                -100 is ignored), through `self.loss_function` so that `Trainer`'s `num_items_in_batch` applies.
                Leak-free: a prefix (JRT) model ignores the targets its encoder read, i.e. the label at index j of a
                row is not scored when j < the row's prefix end (its first real token + its prefix length), so the
                loss is the cross-entropy over the targets after each row's prefix. (With `Trainer`, mask those labels
                in the collator, e.g. with `jrt_train.ignore_prefix_targets`, so that its `num_items_in_batch` counts
                only the scored targets.)
            mlm_labels: (keyword, through `**kwargs`) `(B, T)` masked-LM targets of the JRT objective, predicted at
                their own position (-100 elsewhere), as `JRTDataCollator` builds them. With them the loss is
                `NTP + config.mlm_weight * MLM` (see `modeling_jrt.loss`), with the labels as given. They travel in
                `**kwargs`, like `shift_labels`, so that `Trainer` keeps `label_names == ["labels"]` and still
                reports the loss of plain causal-LM evaluation batches. The collator's batches carry its
                `prefix_length`; one that differs from `config.prefix_length` raises `ValueError`.
            logits_to_keep: compute logits for the last `logits_to_keep` positions only (0 = all), or for the
                positions a tensor selects (`transformers.modeling_utils.slice_logits_to_keep`).
            Other arguments: see `JRTRNNModel.forward` (`output_hidden_states`, `output_attentions` and
                `return_dict=False` as in transformers' models).

        Returns:
            `JRTRNNCausalLMOutput` with `loss`, `logits` `(B, T, vocab_size)`, `cache`, and `ntp_loss` / `mlm_loss`
            when `mlm_labels` are given.
        """
        mlm_labels = kwargs.pop("mlm_labels", None)
        prefix_range = None  # the encoder range of this forward, for the loss
        if labels is not None:
            # The range reads the cache before `self.model` checks it: check it here (only then) for the same error.
            _check_cache_layout(cache, self.config)
            prefix_range = self.model.encoder_range(
                prefix_length,
                attention_mask if isinstance(attention_mask, torch.Tensor) else None,
                input_ids if input_ids is not None else inputs_embeds,
                cache,
            )
        if mlm_labels is not None:
            self._check_jrt_objective_prefix(prefix_length)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            linear_attention_mask=linear_attention_mask,
            prefix_length=prefix_length,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))

        loss = ntp_loss = mlm_loss = None
        if mlm_labels is not None:
            if labels is None:
                raise ValueError("`mlm_labels` need `labels` (the next-token targets) as well: see JRTDataCollator.")
            loss, ntp_loss, mlm_loss = jrt_loss(
                logits, labels, mlm_labels,
                mlm_weight=self.config.mlm_weight, num_items_in_batch=kwargs.get("num_items_in_batch"),
            )
        elif labels is not None:
            if prefix_range is not None:
                labels, kwargs = self._ignore_encoder_targets(labels, prefix_range.end, kwargs)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return JRTRNNCausalLMOutput(
            loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, ntp_loss=ntp_loss, mlm_loss=mlm_loss,
        )

    def _ignore_encoder_targets(
        self, labels: torch.LongTensor, prefix_end: torch.Tensor, kwargs: dict
    ) -> tuple[torch.LongTensor, dict]:
        """`labels` (and `shift_labels`, if given) without the targets the encoder read (index < `prefix_end`)."""
        masked = ignore_prefix_targets(labels, prefix_end)
        shift_labels = kwargs.get("shift_labels")
        if shift_labels is not None:  # pre-shifted: column t holds the target at index t + 1
            kwargs = {**kwargs, "shift_labels": ignore_prefix_targets(shift_labels, prefix_end - 1)}
        if kwargs.get("num_items_in_batch") is not None and bool(((labels != masked)[:, 1:]).any()):
            logger.warning_once(
                "The labels of this batch include targets that the JRT encoder reads (inside each row's prefix): the "
                "loss ignores them, but `num_items_in_batch` (from Trainer) still counts them, which scales the loss "
                "down. Set them to -100 in the data collator (`jrt_train.ignore_prefix_targets`, or "
                "`labels[:, :prefix_length] = -100` for unpadded blocks), or use `JRTDataCollator`."
            )
        return masked, kwargs

    def _check_jrt_objective_prefix(self, prefix_length: int | torch.Tensor | None) -> None:
        """The JRT objective's batch layout follows the collator's prefix length: it must be the model's."""
        if prefix_length is None:
            return
        values = prefix_length.unique().tolist() if isinstance(prefix_length, torch.Tensor) else [prefix_length]
        if values != [self.config.prefix_length]:
            raise ValueError(
                f"This JRT training batch was built for prefix_length {values}, but the model's "
                f"config.prefix_length is {self.config.prefix_length}: build the collator with "
                "`JRTDataCollator.from_config(model.config)` (or give it the model's prefix_length)."
            )

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        streamer: BaseStreamer | None = None,
        prefix_strategy: str | None = None,
        prefix_pad_token_id: int | None = None,
        **kwargs,
    ) -> GenerateOutput | torch.LongTensor:
        """`GenerationMixin.generate` with the JRT prefix handling of `generation.py`.

        The prompt is read in parallel (prefix linear attention prefill), then tokens are decoded one by one from the
        constant-size recurrent state. Prompts shorter than `prefix_length` are filled as `prefix_strategy` says; the
        fill never appears in the returned sequences, the streamer or the scores. Every other argument is the
        standard one. Ids `>= config.generation_vocab_size` and `config.mask_token_id` are never generated
        (`suppress_tokens` of the generation config). transformers refuses assisted decoding for this stateful model
        (`_is_stateful`: the recurrent state cannot be rolled back).

        Args:
            prefix_strategy: `"pad"` (left-pad with `prefix_pad_token_id` and mask the pads in the linear attention,
                the reference protocol), `"repeat"` (fill the prefix by repeating the prompt) or `"none"` (the prompt
                is the prefix); default: `generation_config.prefix_strategy` (saved in `generation_config.json`),
                else `"pad"`.
            prefix_pad_token_id: Fill token of `"pad"`; default `config.prefix_pad_token_id`.

        Example:
            >>> out = model.generate(**tokenizer(["Hello"], return_tensors="pt"), max_new_tokens=8,
            ...                      prefix_strategy="repeat")
        """
        return generate_with_prefix(
            self, super().generate, inputs, generation_config, logits_processor, streamer,
            prefix_strategy, prefix_pad_token_id, kwargs,
        )

    def _get_logits_processor(self, *args, **kwargs) -> LogitsProcessorList:
        """transformers' processors (built-in and the caller's), run on the caller's tokens when `generate()` filled
        the JRT prefix: `repetition_penalty`, `no_repeat_ngram_size` and the like never see the fill."""
        processors = super()._get_logits_processor(*args, **kwargs)
        view = (kwargs.get("model_kwargs") or {}).get("caller_view")
        if view is None or len(processors) == 0:
            return processors
        return LogitsProcessorList([CallerViewLogitsProcessor(processors, view)])

    def _prefill(
        self,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        model_kwargs: dict,
        is_first_iteration: bool = True,
    ):
        """transformers' prefill; with `prefill_chunk_size`, the first chunk spans the JRT encoder region of every
        row (left padding included), so that chunked and one-shot prefills read the same prefix (`chunked_prefill`)."""
        cache = model_kwargs.get("cache")
        if generation_config.prefill_chunk_size is None or cache is None:
            return super()._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=is_first_iteration)
        inputs_embeds = model_kwargs.get("inputs_embeds") if is_first_iteration else None
        inputs = inputs_embeds if inputs_embeds is not None else input_ids
        encoder_range = self.model.encoder_range(
            model_kwargs.get("prefix_length"), model_kwargs.get("attention_mask"), inputs, cache
        )
        encoder_end = 0 if encoder_range is None or encoder_range.length == 0 else int(encoder_range.end.max())
        return chunked_prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration, encoder_end)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        linear_attention_mask: torch.Tensor | None = None,
        caller_view: CallerView | None = None,
        **kwargs,
    ) -> dict:
        """The standard inputs, plus the columns of the prompt's `linear_attention_mask` for the tokens of this
        forward (the whole sequence without a cache, nothing for a decode step).

        `caller_view` (set by `generate()` when it fills the prefix) is for the logits processors only, never an
        input. A cache whose layers are all recurrent has no sequence length for `GenerationMixin` to skip the tokens
        it has read; `generate()` records them on the cache (`CachedPrompt`), and only the new ones are fed here.
        """
        record = cached_prompt(cache)
        if next_sequence_length is None and is_first_iteration and record is not None and cache_has_state(cache):
            next_sequence_length = (input_ids if inputs_embeds is None else inputs_embeds).shape[1] - record.num_read
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            next_sequence_length=next_sequence_length,
            cache=cache,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        if linear_attention_mask is not None:
            reads_embeds = model_inputs.get("inputs_embeds") is not None
            total_length = inputs_embeds.shape[1] if reads_embeds else input_ids.shape[1]
            input_length = model_inputs["inputs_embeds" if reads_embeds else "input_ids"].shape[1]
            aligned = align_linear_attention_mask(linear_attention_mask, total_length, input_length)
            if aligned is not None:
                model_inputs["linear_attention_mask"] = aligned
        return model_inputs


# The auto classes each model class is saved under (`auto_map`); registered so that `save_pretrained` ships the code.
_AUTO_CLASSES = {JRTRNNModel: "AutoModel", JRTRNNForCausalLM: "AutoModelForCausalLM"}
for _cls, _auto_class in _AUTO_CLASSES.items():
    _cls.register_for_auto_class(_auto_class)

__all__ = [
    "JRTRNNCausalLMOutput",
    "JRTRNNDecoderLayer",
    "JRTRNNEncoderRange",
    "JRTRNNForCausalLM",
    "JRTRNNLinearAttention",
    "JRTRNNMLP",
    "JRTRNNModel",
    "JRTRNNPreTrainedModel",
    "JRTRNNRMSNorm",
    "JRTRNNShortConv",
    "JRTRNNSlidingWindowAttention",
    "JRTRNNSlidingWindowCacheLayer",
    "prefix_encoder_range",
    "read_linear_attention_state",
    "write_linear_attention_state",
]
