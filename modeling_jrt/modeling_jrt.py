"""JRT-RNN / Based for HuggingFace Transformers: layers, `JRTRNNModel` and `JRTRNNForCausalLM`.

The stack (REFERENCE.md §3): token embedding -> N pre-norm blocks -> RMSNorm -> tied LM head. Each block is
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
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
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import logging

from .configuration_jrt import JRTRNNConfig
from .generation import align_linear_attention_mask, generate_with_prefix
from .linear_attention import linear_attention_step, prefix_linear_attention, taylor_feature_map
from .sliding_window import BLOCKED_IMPLEMENTATIONS, blocked_sliding_window_attention
from .training import jrt_loss

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.get_logger(__name__)


class JRTRNNRMSNorm(nn.Module):
    """RMSNorm with weight only: y = x / sqrt(mean(x**2) + eps) * w, computed in fp32, returned in w's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
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
    """Gated short convolution (Based `BaseConv`, REFERENCE.md §3.2).

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
        seq_len = hidden_states.shape[1]
        # 1. Input projection into the convolution branch and the gate.
        conv_input, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, T, D) each
        # 2. Padded positions enter the convolution as zeros, so pads never reach the window of a real token.
        if attention_mask is not None:
            conv_input = conv_input * attention_mask[:, -seq_len:, None].to(conv_input.dtype)
        conv_input = conv_input.transpose(1, 2)  # (B, D, T)
        # 3. Causal depthwise convolution over [cached inputs, new inputs]; the cache keeps the last K inputs.
        if cache is not None:
            conv_input = cache.update_conv_state(conv_input, self.layer_idx, conv_kernel_size=self.kernel_size)
        conv_output = F.conv1d(
            F.pad(conv_input, (self.kernel_size - 1, 0)), self.conv.weight, groups=self.inner_size
        )[..., -seq_len:]  # (B, D, T)
        # 4. SiLU, multiplicative gate, output projection.
        return self.out_proj(F.silu(conv_output).transpose(1, 2) * gate)


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
    ) -> torch.Tensor:
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
        else:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                implementation, eager_attention_forward
            )
            output, _ = attention_interface(
                self, query, key, value, attention_mask,
                dropout=0.0, scaling=self.scaling, sliding_window=self.sliding_window,
            )  # (B, T, H, D)
        return self.o_proj(output.reshape(batch_size, seq_len, -1))


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
    would silently restart every decode step from an empty state (HF_INTEGRATION.md §1.4).
    """
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    return layer.recurrent_states[0] if layer.has_previous_state[0] else None


def write_linear_attention_state(cache: Cache, layer_idx: int, state: torch.Tensor) -> None:
    cache.update_recurrent_state(state, layer_idx)
    cache.layers[layer_idx].has_previous_state[0] = True


class JRTRNNLinearAttention(nn.Module):
    """Taylor-feature linear attention: prefix (JRT-RNN, REFERENCE.md §3.5) or causal (Based, §3.4).

    Prefix form: the first `min(prefix_length, T)` tokens of the first forward are also read non-causally through
    `k_enc_proj` / `v_enc_proj`; every query sees that encoder sum plus the causal sum over the decoder keys, under
    one shared denominator. Decoding continues from the state of both sums with one O(1) step per token.

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

    def encoder_projections(
        self, prefix: torch.Tensor, zeroed_keys: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder keys `(B, M, H, K)` and values `(B, M, H, V)` of the prefix `(B, M, hidden)`; the keys of
        `zeroed_keys` `(B, >= M)` are zeroed ("reference" pad masking)."""
        batch_size, length, _ = prefix.shape
        k_enc = self.k_enc_proj(prefix).view(batch_size, length, self.num_heads, self.feature_dim)  # (B, M, H, K)
        v_enc = self.v_enc_proj(prefix).view(batch_size, length, self.num_heads, self.head_dim)  # (B, M, H, V)
        if zeroed_keys is not None:
            k_enc = k_enc.masked_fill(zeroed_keys[:, :length, None, None], 0.0)
        return k_enc, v_enc

    def encoder_state(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        key_mask: torch.Tensor | None,
        encoder_length: int,
        zeroed_keys: torch.Tensor | None,
    ) -> torch.Tensor:
        """fp32 state `(B, H, F, V + 1)` = sum of phi(k_enc) [v_enc, 1] over each row's first `encoder_length`
        non-padding tokens (`attention_mask` `(B, T)` bool, left padding); `key_mask` `(B, T)` removes keys."""
        in_encoder = attention_mask & (attention_mask.cumsum(-1) <= encoder_length)  # (B, T)
        if key_mask is not None:
            in_encoder = in_encoder & key_mask
        length = int(in_encoder.any(0).nonzero().max()) + 1 if bool(in_encoder.any()) else 0
        k_enc, v_enc = self.encoder_projections(hidden_states[:, :length], zeroed_keys)
        # phi(0) = [1, 0, ...] is not 0: keys outside the encoder are removed after the feature map.
        features = taylor_feature_map(k_enc.float()) * in_encoder[:, :length, None, None]  # (B, M, H, F)
        values = torch.cat([v_enc.float(), torch.ones_like(v_enc[..., :1], dtype=torch.float32)], dim=-1)
        return torch.einsum("bmhf,bmhv->bhfv", features, values)  # (B, H, F, V + 1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        prefix_length: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
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
            # 2b. Prefill (parallel form). Batch padding (`attention_mask`) is always removed entirely; the JRT prefix
            # pads (`linear_attention_mask`) follow `prefix_pad_masking`: "reference" zeroes their raw keys, so they
            # keep weight 1 through phi(0) = [1, 0, ...] as in the original code.
            real = None if attention_mask is None else attention_mask[:, -seq_len:].bool()  # (B, T)
            prefix_pads = None if linear_attention_mask is None else ~linear_attention_mask[:, -seq_len:].bool()
            zeroed_keys = None  # (B, T) keys zeroed before the feature map ("reference" masking)
            if prefix_pads is not None and self.config.prefix_pad_masking == "reference":
                zeroed_keys = prefix_pads
                key = key.masked_fill(prefix_pads[:, :, None, None], 0.0)
            elif prefix_pads is not None:
                real = ~prefix_pads if real is None else real & ~prefix_pads
            k_enc = v_enc = None
            if self.is_prefix and state is None:
                # The encoder reads the prefix only in the first forward of a sequence.
                encoder_length = self.config.prefix_length if prefix_length is None else prefix_length
                if attention_mask is None or bool(attention_mask[:, -seq_len:].all()):
                    prefix = hidden_states[:, : min(encoder_length, seq_len)]
                    k_enc, v_enc = self.encoder_projections(prefix, zeroed_keys)
                else:
                    # Left-padded batch: each row's encoder is its own first `encoder_length` tokens, so the row gives
                    # the same result as alone. Its sum enters the scan as the initial state.
                    state = self.encoder_state(
                        hidden_states, attention_mask[:, -seq_len:].bool(), real, encoder_length, zeroed_keys
                    )
            output, state = prefix_linear_attention(
                query, key, value, k_enc, v_enc,
                key_mask=real,
                initial_state=state,
                log_decay=log_decay,
                gate=gate,
                eps=self.config.linear_attention_eps,
                chunk_size=self.config.linear_attention_chunk_size,
                implementation=self.config.linear_attention_implementation,
            )
        if cache is not None:
            write_linear_attention_state(cache, self.layer_idx, state)
        # 3. Merge heads, output projection.
        return self.o_proj(output.reshape(batch_size, seq_len, -1).to(hidden_states.dtype))


class JRTRNNMLP(nn.Module):
    """SwiGLU: down_proj(up_proj(x) * SiLU(gate_proj(x))). The reference's fc1 rows are [up; gate]."""

    def __init__(self, config: JRTRNNConfig, layer_idx: int | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        prefix_length: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states: (B, T, hidden) fp32 residual stream; returns the updated fp32 residual."""
        mixed = self.mixer(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            cache=cache,
            position_embeddings=position_embeddings,
            linear_attention_mask=linear_attention_mask,
            prefix_length=prefix_length,
        )
        hidden_states = hidden_states + mixed.float()
        if self.mlp is None:
            return hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)).float()


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
    ) -> torch.Tensor | BlockMask | None:
        """The mask of the `sliding_attention` layers for this forward.

        A multi-token forward with eager or SDPA attention and a dynamic (or no) cache gets the 2D padding mask
        `(B, T_total)` itself (or None): the layers run the blocked O(T * W) attention and build only
        `(block, block + W - 1)` masks. Everything else gets transformers' `create_sliding_window_causal_mask`: a
        decode step (a `(B, 1, 1, <= W)` mask), a static cache (fixed-size buffers whose slots the mask tracks),
        a custom 4D mask, flash attention (a 2D mask or None) and flex attention (a `BlockMask`).
        """
        blocked = (
            self.config._attn_implementation in BLOCKED_IMPLEMENTATIONS
            and inputs_embeds.shape[1] > 1
            and (attention_mask is None or attention_mask.dim() == 2)
            and (cache is None or not cache.is_compileable)
        )
        if blocked:
            return attention_mask
        return create_sliding_window_causal_mask(self.config, inputs_embeds, attention_mask, cache, position_ids)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        prefix_length: int | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """
        Args:
            input_ids: `(B, T)` token ids (or `inputs_embeds` `(B, T, hidden)`).
            attention_mask: `(B, T_total)` 1 for real tokens, 0 for padding (left padding), covering the cached tokens
                too; or the per-layer-type dict of prepared masks that `generate()` passes with a static cache.
            position_ids: `(B, T)` RoPE positions; default: counting on from the cached length.
            cache: a transformers `Cache` built from `config.layer_types` (`past_key_values` is accepted as an alias).
            use_cache: create a `DynamicCache` when none is given (default `config.use_cache`).
            linear_attention_mask: `(B, T)` extra mask for the linear-attention layers only (0 = ignore the token as
                a key, e.g. the pads of the JRT prefix that the other layers read as ordinary tokens).
            prefix_length: overrides `config.prefix_length` for this forward (the encoder reads the first
                `min(prefix_length, T)` tokens of the first forward of a sequence).
        """
        if cache is None:
            cache = past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        has_sliding = "sliding_attention" in self.config.layer_types

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
                    inputs_embeds, attention_mask, cache, position_ids
                )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if has_sliding else None

        hidden_states = inputs_embeds.float()  # the residual stream stays fp32
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=mask_mapping.get(layer.layer_type),
                position_embeddings=position_embeddings,
                cache=cache,
                linear_attention_mask=linear_attention_mask,
                prefix_length=prefix_length,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


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
        prefix_length: int | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> JRTRNNCausalLMOutput:
        """
        Args:
            labels: `(B, T)` token ids; the loss is the mean next-token cross-entropy (labels are shifted inside,
                -100 is ignored), through `self.loss_function` so that `Trainer`'s `num_items_in_batch` applies.
            mlm_labels: (keyword, through `**kwargs`) `(B, T)` masked-LM targets of the JRT objective, predicted at
                their own position (-100 elsewhere), as `JRTDataCollator` builds them. With them the loss is
                `NTP + config.mlm_weight * MLM` (see `modeling_jrt.training`). They travel in `**kwargs`, like
                `shift_labels`, so that `Trainer` keeps `label_names == ["labels"]` and still reports the loss of
                plain causal-LM evaluation batches.
            logits_to_keep: compute logits for the last `logits_to_keep` positions only (0 = all).
            Other arguments: see `JRTRNNModel.forward`.

        Returns:
            `JRTRNNCausalLMOutput` with `loss`, `logits` `(B, T, vocab_size)`, `cache`, and `ntp_loss` / `mlm_loss`
            when `mlm_labels` are given.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            linear_attention_mask=linear_attention_mask,
            prefix_length=prefix_length,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)

        loss = ntp_loss = mlm_loss = None
        mlm_labels = kwargs.pop("mlm_labels", None)
        if mlm_labels is not None:
            if labels is None:
                raise ValueError("`mlm_labels` need `labels` (the next-token targets) as well: see JRTDataCollator.")
            loss, ntp_loss, mlm_loss = jrt_loss(
                logits, labels, mlm_labels,
                mlm_weight=self.config.mlm_weight, num_items_in_batch=kwargs.get("num_items_in_batch"),
            )
        elif labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return JRTRNNCausalLMOutput(
            loss=loss, logits=logits, cache=outputs.cache, ntp_loss=ntp_loss, mlm_loss=mlm_loss
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
        """`GenerationMixin.generate` with the JRT prefix handling of `generation.py` (REFERENCE.md §4.3).

        The prompt is read in parallel (prefix linear attention prefill), then tokens are decoded one by one from the
        constant-size recurrent state. Prompts shorter than `prefix_length` are filled as `prefix_strategy` says; the
        fill never appears in the returned sequences, the streamer or the scores. Every other argument is the
        standard one. Ids `>= config.generation_vocab_size` and `config.mask_token_id` are never generated.
        Assisted decoding raises `ValueError` (the recurrent state cannot be rolled back).

        Args:
            prefix_strategy: `"pad"`, `"repeat"` or `"none"`; default `config.prefix_strategy`.
            prefix_pad_token_id: Fill token of `"pad"`; default `config.prefix_pad_token_id`.

        Example:
            >>> out = model.generate(**tokenizer(["Hello"], return_tensors="pt"), max_new_tokens=8,
            ...                      prefix_strategy="repeat")
        """
        return generate_with_prefix(
            self, super().generate, inputs, generation_config, logits_processor, streamer,
            prefix_strategy, prefix_pad_token_id, kwargs,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        linear_attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """The standard inputs, plus the columns of the prompt's `linear_attention_mask` for the tokens of this
        forward (the whole sequence without a cache, nothing for a decode step)."""
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


__all__ = [
    "JRTRNNCausalLMOutput",
    "JRTRNNDecoderLayer",
    "JRTRNNForCausalLM",
    "JRTRNNLinearAttention",
    "JRTRNNMLP",
    "JRTRNNModel",
    "JRTRNNPreTrainedModel",
    "JRTRNNRMSNorm",
    "JRTRNNShortConv",
    "JRTRNNSlidingWindowAttention",
    "read_linear_attention_state",
    "write_linear_attention_state",
]
