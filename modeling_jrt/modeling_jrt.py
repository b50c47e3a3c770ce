"""JRT-RNN / Based for HuggingFace Transformers: layers, `JRTRNNModel` and `JRTRNNForCausalLM`.

The stack (docs/reference_architecture.md §1; a token's path: docs/architecture.md §2): token embedding -> N pre-norm
blocks on an fp32 residual stream (`JRTRNNDecoderLayer`: the mixer `config.mixer_types[i]` of `MIXER_CLASSES`, then
a SwiGLU MLP) -> RMSNorm -> tied LM head.

State lives in a `JRTRNNCache` (`cache.py`). Around the layers: input checks (`inputs.py`), the prefix layout
(`prefix_fill.py`), the labels rule (`labels.py`), the generation hook (`generation.py`). Relative imports, torch
and transformers only: this folder ships as Hub remote code.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .transformers_range import importing_transformers

with importing_transformers():  # one line instead of a traceback where transformers' own imports cannot work
    from transformers.cache_utils import Cache
    from transformers.generation import GenerationConfig, GenerationMixin
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
    from transformers.utils import logging
    from transformers.utils.generic import can_return_tuple
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .cache import JRTRNNCache, JRTRNNConvState, JRTRNNSlidingWindowState

# transformers 5.5 (the oldest release declared) copies into its remote-code module cache only the files the model
# file imports itself: this file names every module of the package once (these ten only the linear attention uses).
from .chunked_scan import scan_in_place  # noqa: F401
from .chunked_scan_autograd import scan  # noqa: F401
from .compact_taylor import CompactTaylor  # noqa: F401
from .feature_map import taylor_feature_map  # noqa: F401
from .huge_pages import advise_huge_pages  # noqa: F401
from .linear_attention_chunk import chunked_prefill  # noqa: F401
from .linear_attention_fused import fused_prefill  # noqa: F401
from .linear_attention_inputs import LinearAttentionInputs  # noqa: F401
from .linear_attention_naive import quadratic_prefill  # noqa: F401
from .linear_attention_recurrent import linear_attention_step_at_slots  # noqa: F401
from .compat import CACHE_FIELD, keep_last_logits, model_output
from .configuration_jrt import JRTRNNConfig
from .fused_norm import fused_rms_norm
from .generation import JRTRNNGenerationMixin
from .inference_chunking import inference_chunk_rows, map_position_chunks
from .inputs import check_attention_mask, check_inputs, check_labels, check_one_sequence_per_row, resolve_cache
from .labels import LOSS_KWARGS, apply_labels_rule, check_jrt_objective_prefix, labels_rule_applies, leak_free_labels
from .legacy_folders import migrate_legacy_generation_settings
from .kernel_choice import KernelChoice
from .linear_attention import fixed_log_decay, linear_attention_step, prefix_linear_attention
from .loss import IGNORE_INDEX, jrt_loss
from .outputs import JRTRNNCausalLMOutput, JRTRNNModelOutput
from .prefix_fill import PrefixPlan, check_prefix_strategy, fill_prefix, never_generated_ids, plan_prefix
from .rotary import JRTRNNRotaryEmbedding, apply_rotary_pos_emb
from .short_conv import causal_depthwise_conv
from .sliding_window import (
    BLOCKED_IMPLEMENTATIONS, blocked_sliding_window_attention, default_block_size, eager_attention_forward,
    sliding_window_additive_mask,
)

logger = logging.get_logger(__name__)


class JRTRNNRMSNorm(nn.Module):
    """RMSNorm with weight only: y = x / sqrt(mean(x**2) + eps) * w, computed in fp32, returned in w's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.kernels = KernelChoice()  # a model's own choice replaces it (`KernelChoice.install`)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., hidden), in token chunks during inference (`inference_chunk_rows`)."""
        width = hidden_states.shape[-1]
        rows = hidden_states.numel() // max(width, 1)
        chunk = inference_chunk_rows(rows, width, hidden_states.device)
        if chunk is None:
            return self.normalize(hidden_states)
        out = hidden_states.new_empty(hidden_states.shape, dtype=self.weight.dtype)
        flat, output = hidden_states.reshape(rows, width), out.view(rows, width)
        for start in range(0, rows, chunk):
            self.normalize(flat[start : start + chunk], out=output[start : start + chunk])
        return out

    def normalize(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of hidden_states (rows, hidden) in one pass (no size-dependent chunk loop: for graphs that serve
        every batch size), into `out` (rows, hidden) in w's dtype when given."""
        fused = fused_rms_norm(hidden_states, self.weight, self.variance_epsilon, self.kernels, out=out)
        if fused is not None:  # a GPU without autograd: one launch
            return fused
        hidden_states = hidden_states.float()
        if not torch.is_grad_enabled():
            # Without autograd: mean(x**2) from one reduction (sqrt(sum x**2)), scaled in place (2 passes fewer).
            scale = torch.linalg.vector_norm(hidden_states, dim=-1, keepdim=True)
            scale.square_().div_(hidden_states.shape[-1]).add_(self.variance_epsilon).rsqrt_()
            if out is not None and out.dtype == torch.float32 and self.weight.dtype == torch.float32:
                return torch.mul(hidden_states, scale, out=out).mul_(self.weight)
            normalized = (hidden_states * scale).mul_(self.weight.float()).to(self.weight.dtype)
        else:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            normalized = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
            normalized = (normalized * self.weight.float()).to(self.weight.dtype)
        return normalized if out is None else out.copy_(normalized)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class JRTRNNShortConv(nn.Module):
    """Gated short convolution (Based `BaseConv`, docs/reference_architecture.md §1.1).

        u, g = in_proj(x).chunk(2)              u, g: (B, T, D) with D = conv_expansion * hidden_size
        c = causal depthwise conv_K(u)          tap K-1 multiplies u_t, tap 0 multiplies u_{t-K+1}
        y = out_proj(SiLU(c) * g)

    Cache: the last K - 1 inputs u of the convolution (`JRTRNNConvState`).
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
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
        layer_state: JRTRNNConvState | None = None, **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, T, hidden), attention_mask (B, >= T) -> (B, T, hidden). The state (the cache's, or
        `layer_state` from `JRTRNNDecoderLayer._forward_in_chunks`) is updated with the last K - 1 inputs."""
        seq_len = hidden_states.shape[1]
        mask = None if attention_mask is None else attention_mask[:, -seq_len:]  # (B, T)
        state = layer_state if layer_state is not None or cache is None else cache.layers[self.layer_idx]
        # 1. Input projection into the convolution branch and the gate.
        conv_input, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, T, D) each
        # 2. Padded positions enter the convolution as zeros, so pads never reach the window of a real token.
        if mask is not None:
            conv_input = conv_input * mask[:, :, None].to(conv_input.dtype)
        # 3. Causal depthwise convolution over [earlier inputs, new inputs]; then the state keeps the last K - 1.
        history = None if state is None or state.inputs is None else state.inputs.to(conv_input.dtype)  # (B, D, K - 1)
        if seq_len == 1 and history is not None:
            # A decode step: one window [history, x] per channel, one multiply-add (no shifted taps).
            window = torch.cat([history, conv_input.transpose(1, 2)], dim=-1)  # (B, D, K)
            conv_output = (window * self.conv.weight[:, 0].to(window.dtype)).sum(-1)[:, None]  # (B, 1, D)
            state.write(None, window[..., 1:])  # K - 1 columns: the whole buffer, in place
        else:
            past = None if history is None else history.transpose(1, 2)  # (B, K - 1, D)
            conv_output = causal_depthwise_conv(conv_input, past, self.conv.weight)  # (B, T, D)
            if state is not None:
                state.write(history, conv_input.transpose(1, 2))
        # 4. SiLU, multiplicative gate, output projection (in place when no autograd graph records them).
        if torch.is_grad_enabled():
            mixed = F.silu(conv_output) * gate
        else:
            mixed = F.silu(conv_output, inplace=True).mul_(gate)
        return self.out_proj(mixed)

    def inference_width(self, batch_size: int) -> int:
        """Elements per token of the widest intermediate (the input projection), for `inference_chunk_rows`."""
        return batch_size * 2 * self.inner_size


class JRTRNNSlidingWindowAttention(nn.Module):
    """Causal softmax attention over the last `sliding_window` tokens (itself included), RoPE on q and k.

    The cache (`JRTRNNSlidingWindowState`) keeps the last `W - 1` keys with their padding flags. `"eager"` and
    `"sdpa"` run the blocked O(T * W) form of `sliding_window.py`; any other `config._attn_implementation` (e.g.
    flash attention) gets the `(B, S)` key padding mask and the window through `ALL_ATTENTION_FUNCTIONS`.
    `output_attentions` runs the eager form with a full `(B, 1, T, S)` mask.
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

    def inference_width(self, batch_size: int) -> int:
        """Elements per query of the widest prefill intermediate (the key and value slabs): `inference_chunk_rows`."""
        block = default_block_size(self.sliding_window)
        return batch_size * self.num_heads * self.head_dim * -(-(block + self.sliding_window - 1) // block)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
        cache: JRTRNNCache | None = None, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False, layer_state: JRTRNNSlidingWindowState | None = None, **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, T, hidden); attention_mask (B, T) padding of these tokens (0) or None -> (B, T, hidden)
        and the attention weights (B, H, T, S) when `output_attentions`, else None. `layer_state`: as for the conv."""
        state = layer_state if layer_state is not None or cache is None else cache.layers[self.layer_idx]
        batch_size, seq_len, _ = hidden_states.shape
        hidden_shape = (batch_size, seq_len, self.num_heads, self.head_dim)
        # 1. Projections (B, H, T, D) and RoPE.
        query, key, value = [
            proj(hidden_states).view(hidden_shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        ]
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        # 2. The cached window (and its padding flags) goes in front of the new keys: (B, H, S, D), mask (B, S).
        key_mask = None if attention_mask is None else attention_mask.bool()  # (B, T)
        if state is not None:
            key, value, key_mask = state.update(key, value, key_mask, in_order=output_attentions)
        # 3. Attention.
        implementation, weights = self.config._attn_implementation, None
        if output_attentions:
            mask = sliding_window_additive_mask(key_mask, seq_len, key.shape[2], self.sliding_window, query.dtype)
            output, weights = eager_attention_forward(self, query, key, value, mask, scaling=self.scaling)
        elif implementation in BLOCKED_IMPLEMENTATIONS:
            output = blocked_sliding_window_attention(
                query, key, value, key_mask,
                sliding_window=self.sliding_window, scaling=self.scaling, implementation=implementation,
            )  # (B, T, H, D)
        else:
            attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            output, _ = attention(
                self, query, key, value, None if key_mask is None else key_mask.long(),
                dropout=0.0, scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
            )  # (B, T, H, D)
        return self.o_proj(output.reshape(batch_size, seq_len, -1)), weights


class JRTRNNLinearAttention(nn.Module):
    """Taylor-feature linear attention: prefix (JRT-RNN, docs/reference_architecture.md §1.5) or causal (Based,
    §1.4).

    In the first forward of a sequence each row's prefix (its `PrefixPlan` read range) is also read non-causally
    through `k_enc_proj` / `v_enc_proj`. The layer computes projections only: the math is `linear_attention.py`'s.
    Based decay variant: a fixed per-head decay of the numerator state and a numerator gate `decay_proj(x)`.
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
        self.kernels = KernelChoice(config=config)  # the model's own choice replaces it (`KernelChoice.install`)

    def log_decay(self, device: torch.device) -> torch.Tensor | None:
        """(H,) log gamma_h of the fixed decay, computed on the fly (no buffer to restore after meta init)."""
        if not self.config.linear_attention_decay:
            return None
        return fixed_log_decay(self.config.decay_const, range(self.num_heads), device)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
        cache: JRTRNNCache | None = None, linear_attention_mask: torch.Tensor | None = None,
        prefix: PrefixPlan | None = None, **kwargs,
    ) -> torch.Tensor:
        """hidden_states `(B, T, hidden)` (normalized); attention_mask `(B, T)` batch padding (0); linear_attention_mask
        `(B, >= T)` the JRT prefix fill (0); prefix: the plan of a first forward. Returns `(B, T, hidden)`."""
        batch_size, seq_len, _ = hidden_states.shape
        heads = self.num_heads
        state = None if cache is None else cache.layers[self.layer_idx].state
        reads_prefix = self.is_prefix and state is None and prefix is not None and prefix.read_width > 0
        # 1. Decoder projections (and the Based gate).
        query = self.q_proj(hidden_states).view(batch_size, seq_len, heads, self.feature_dim)  # (B, T, H, K)
        key = self.k_proj(hidden_states).view(batch_size, seq_len, heads, self.feature_dim)  # (B, T, H, K)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, heads, self.head_dim)  # (B, T, H, V)
        gate = self.decay_proj(hidden_states) if self.config.use_decay_proj else None  # (B, T, H)
        log_decay = self.log_decay(hidden_states.device)

        if state is not None and seq_len == 1:
            # 2a. Decode: one recurrent step.
            output, state = linear_attention_step(
                query[:, 0], key[:, 0], value[:, 0], state,
                log_decay=log_decay, gate=None if gate is None else gate[:, 0],
                eps=self.config.linear_attention_eps, in_place=True,  # the cache owns the state (no autograd)
                implementation=self.kernels,  # a CUDA state: one fused launch
            )
            output = output[:, None]  # (B, 1, H, V)
        else:
            # 2b. Prefill (parallel form). Masked keys: batch padding and the JRT prefix fill (`linear_attention.py`).
            key_mask = None if attention_mask is None else attention_mask[:, -seq_len:].bool()  # (B, T)
            if linear_attention_mask is not None:
                fill = linear_attention_mask[:, -seq_len:].bool()
                key_mask = fill if key_mask is None else key_mask & fill
            k_enc = v_enc = start = end = None
            if reads_prefix:
                # 3. Encoder projections of the positions the encoder ranges cover (the first forward only).
                read = hidden_states[:, : prefix.read_width]
                k_enc = self.k_enc_proj(read).view(batch_size, -1, heads, self.feature_dim)  # (B, M, H, K)
                v_enc = self.v_enc_proj(read).view(batch_size, -1, heads, self.head_dim)  # (B, M, H, V)
                start, end = prefix.read_start, prefix.read_end
            output, state = prefix_linear_attention(
                query, key, value, k_enc, v_enc, encoder_start=start, encoder_end=end, key_mask=key_mask,
                pad_masking=self.config.prefix_pad_masking, initial_state=state, log_decay=log_decay, gate=gate,
                eps=self.config.linear_attention_eps, chunk_size=self.config.linear_attention_chunk_size,
                implementation=self.kernels,
            )
        if cache is not None:
            cache.layers[self.layer_idx].write(state)
        # 4. Merge heads, output projection.
        return self.o_proj(output.reshape(batch_size, seq_len, -1).to(value.dtype))


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
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))  # no autograd: in place


MIXER_CLASSES = {"conv": JRTRNNShortConv, "sliding_attention": JRTRNNSlidingWindowAttention,
                 "linear_attention": JRTRNNLinearAttention}


class JRTRNNDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block on an fp32 residual stream: r += mixer(norm(r)); r += mlp(norm(r))."""

    def __init__(self, config: JRTRNNConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.mixer_types[layer_idx]
        if self.layer_type not in MIXER_CLASSES:
            raise ValueError(f"Invalid layer type {self.layer_type!r} at layer {layer_idx}; allowed: "
                             f"{list(MIXER_CLASSES)}.")
        self.input_layernorm = JRTRNNRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.layer_type](config, layer_idx)
        # intermediate_size = 0: no MLP (the zoology synthetic-task models have none).
        has_mlp = config.intermediate_size > 0
        self.post_attention_layernorm = JRTRNNRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if has_mlp else None
        self.mlp = JRTRNNMLP(config, layer_idx) if has_mlp else None

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Cache | None = None,
        linear_attention_mask: torch.Tensor | None = None, prefix: PrefixPlan | None = None, **kwargs,
    ) -> torch.Tensor:
        """hidden_states: (B, T, hidden) fp32 residual stream -> the updated residual, a new tensor. `kwargs` (e.g.
        `output_attentions`) reach the mixer and, for sliding attention, transformers' attention function."""
        chunk = self.layer_chunk_rows(hidden_states, kwargs)
        if chunk is not None:
            return self._forward_in_chunks(hidden_states, attention_mask, position_embeddings, cache, chunk)
        mixed = self.mixer(
            self.input_layernorm(hidden_states), attention_mask=attention_mask, cache=cache,
            position_embeddings=position_embeddings, linear_attention_mask=linear_attention_mask, prefix=prefix,
            **kwargs,
        )
        if self.layer_type == "sliding_attention":  # (output, weights): output capturing records the weights
            mixed = mixed[0]
        hidden_states = hidden_states + mixed.float()  # a new tensor, owned by this layer
        if self.mlp is None:
            return hidden_states
        # Position-wise: during inference one pass per token chunk, added in place into this layer's new residual.
        rows = hidden_states.numel() // hidden_states.shape[-1]
        chunk = inference_chunk_rows(rows, self.mlp.gate_proj.out_features, hidden_states.device)
        if chunk is None:
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)).float()
        flat = hidden_states.view(rows, hidden_states.shape[-1])
        for start in range(0, rows, chunk):
            part = flat[start : start + chunk]
            part += self.mlp(self.post_attention_layernorm(part)).float()
        return hidden_states

    def layer_chunk_rows(self, hidden_states: torch.Tensor, kwargs: dict) -> int | None:
        """Tokens per chunk when the whole block runs in token chunks during inference (`_forward_in_chunks`), else
        None. Conv and sliding-window layers only: their bounded past is carried by a layer state; not linear
        attention (the prefix encoder reads ahead), `output_attentions` or non-blocked attention implementations."""
        if self.layer_type == "linear_attention":
            return None
        if self.layer_type == "sliding_attention" and (
            kwargs.get("output_attentions") or self.mixer.config._attn_implementation not in BLOCKED_IMPLEMENTATIONS
        ):
            return None
        batch_size, seq_len = hidden_states.shape[:2]
        width = self.mixer.inference_width(batch_size)
        if self.mlp is not None:
            width = max(width, batch_size * self.mlp.gate_proj.out_features)
        chunk = inference_chunk_rows(seq_len, width, hidden_states.device)
        block = default_block_size(self.mixer.sliding_window) if self.layer_type == "sliding_attention" else 1
        if chunk is not None and chunk > block:
            chunk -= chunk % block  # whole query blocks per chunk
        return chunk

    def _forward_in_chunks(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None, cache: Cache | None, chunk: int,
    ) -> torch.Tensor:
        """`forward` of a conv or sliding-window layer, `chunk` tokens at a time, the past carried by the layer's state
        (the cache's, or a fresh one for this forward), into a new (B, T, hidden) fp32 tensor."""
        seq_len = hidden_states.shape[1]
        output = torch.empty_like(hidden_states, dtype=torch.float32)
        mask = None if attention_mask is None else attention_mask[:, -seq_len:]  # (B, T)
        if cache is not None:
            state = cache.layers[self.mixer.layer_idx]
        elif self.layer_type == "conv":
            state = JRTRNNConvState(self.mixer.kernel_size)
        else:
            state = JRTRNNSlidingWindowState(self.mixer.sliding_window)
        for start in range(0, seq_len, chunk):
            end = min(start + chunk, seq_len)
            part = hidden_states[:, start:end]
            rope = None if position_embeddings is None else tuple(table[:, start:end] for table in position_embeddings)
            mixed = self.mixer(
                self.input_layernorm(part), attention_mask=None if mask is None else mask[:, start:end],
                position_embeddings=rope, layer_state=state,
            )
            if self.layer_type == "sliding_attention":
                mixed = mixed[0]
            residual = output[:, start:end]
            torch.add(part, mixed.float(), out=residual)
            if self.mlp is not None:
                residual += self.mlp(self.post_attention_layernorm(residual)).float()
        return output


class JRTRNNPreTrainedModel(PreTrainedModel):
    config: JRTRNNConfig
    config_class = JRTRNNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["JRTRNNDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True  # the sliding layers pass `sliding_window` and a (B, S) key padding mask
    _can_compile_fullgraph = True  # prefill (padding, JRT fill) and decode steps
    _is_stateful = True  # the recurrent state cannot be rolled back: no assisted decoding
    # `output_hidden_states`: the first block's input, then every block's output (the last after the final norm);
    # `output_attentions`: the weights of each sliding-window layer.
    _can_record_outputs = {
        "hidden_states": JRTRNNDecoderLayer,
        "attentions": OutputRecorder(JRTRNNSlidingWindowAttention, index=1),
    }

    def __init__(self, config: JRTRNNConfig, *inputs, **kwargs):
        # A `from_pretrained(..., field=value)` override or a field changed after construction was never checked.
        config.validate_architecture()
        super().__init__(config, *inputs, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """`PreTrainedModel.save_pretrained`, whose folder always loads with `trust_remote_code=True` alone: the classes
        are registered for their auto classes (end of this file and of `configuration_jrt.py`), so transformers copies
        the code into the folder however the model was loaded, and `auto_map` names both auto classes."""
        module = type(self).__module__.rsplit(".", 1)[-1]  # "modeling_jrt", also for a remote-code copy of it
        self.config.auto_map = {
            **(getattr(self.config, "auto_map", None) or {}),
            **{auto_class: f"{module}.{cls.__name__}" for cls, auto_class in _AUTO_CLASSES.items()},
        }
        return super().save_pretrained(save_directory, *args, **kwargs)


class JRTRNNModel(JRTRNNPreTrainedModel):
    """The backbone: embeddings, blocks and final norm. Returns the last hidden state and the cache."""

    def __init__(self, config: JRTRNNConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([JRTRNNDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = JRTRNNRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = JRTRNNRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.kernels = KernelChoice(config=config)
        self.kernels.install(self)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: JRTRNNCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        linear_attention_mask: torch.Tensor | None = None,
        prefix_length: int | torch.LongTensor | None = None,
        prompt_lengths: torch.LongTensor | None = None,
        prefix_strategy: str | None = None,
        prefix_pad_token_id: int | None = None,
        prefix_plan: PrefixPlan | None = None,
        past_key_values: JRTRNNCache | None = None,
        **kwargs,
    ) -> JRTRNNModelOutput | tuple:
        """
        Args:
            input_ids: `(B, T)` token ids (or `inputs_embeds` `(B, T, hidden)`).
            attention_mask: `(B, past + T)` 1 for real tokens, 0 for padding (left or right), the cached tokens too.
            position_ids: `(B, T)` RoPE positions; default: counting on from the positions the cache has read.
            cache: a `JRTRNNCache` to continue (`past_key_values=` is its pre-5.24 name).
            use_cache: create a `JRTRNNCache` when none is given (default `config.use_cache` in eval mode).
            linear_attention_mask: `(B, T)` extra key mask (0) of the linear-attention layers only
                (`config.prefix_pad_masking` inside a row's encoder range).
            prefix_length: P, the JRT prefix: an int or a `(B,)` LongTensor; default `config.prefix_length`.
            prompt_lengths: the tokens of each row (from its first real token) that form its prompt, as
                `prefix_length`; default: all of them. A first forward's encoder reads `min(P, prompt)` of them,
                filled to P as `prefix_strategy` says (`prefix_fill.plan_prefix`).
            prefix_strategy: `"pad"`, `"repeat"` or `"none"`; default `config.prefix_strategy`.
            prefix_pad_token_id: the fill token of `"pad"`; default `config.prefix_pad_token_id`.
            prefix_plan: each row's prefix when the caller planned it already (`plan_prefix`; the labels rule passes
                its own); default: planned here from the three arguments above.
            output_hidden_states, output_attentions, return_dict: (keywords) transformers' output capturing and
                `can_return_tuple`. Every output covers the caller's positions only.
        """
        config = self.config
        batch_size, seq_len = check_inputs(config, input_ids, inputs_embeds)
        cache = resolve_cache(cache, past_key_values, config, batch_size)
        if use_cache is None:  # config.use_cache is the inference default: training builds no cache unless asked
            use_cache = config.use_cache and not self.training
        if use_cache and cache is None and not (self.gradient_checkpointing and self.training):
            cache = JRTRNNCache(config)
        continuing = cache is not None and cache.has_state
        if continuing and prefix_strategy is not None:
            check_prefix_strategy(prefix_strategy)  # a first forward's plan checks it (`plan_prefix`)
        real_tokens = seq_len  # the caller's real tokens per row in this forward (the cache counts them)
        if attention_mask is not None:
            check_attention_mask(attention_mask, batch_size, seq_len, cache)
            attention_mask = attention_mask[:, -seq_len:]  # this forward's tokens (the cache keeps its own flags)
            if cache is not None:
                real_tokens = attention_mask.sum(-1, dtype=torch.long)
        if linear_attention_mask is not None:
            linear_attention_mask = linear_attention_mask[:, -seq_len:]
        if position_ids is not None and seq_len > 1 and not torch.compiler.is_compiling():
            check_one_sequence_per_row(position_ids, attention_mask)

        # 1. The first forward of a JRT sequence plans each row's prefix (fill and encoder read) and fills it.
        plan = None
        caller_mask = attention_mask  # (B, T) the caller's padding, before the fill joins the layout
        if config.is_prefix_model and not continuing:
            plan = prefix_plan
            if plan is None:
                device = (input_ids if input_ids is not None else inputs_embeds).device
                plan = plan_prefix(
                    config, attention_mask, batch_size, seq_len, device, prefix_length=prefix_length,
                    prompt_lengths=prompt_lengths, strategy=prefix_strategy, pad_token_id=prefix_pad_token_id,
                )
            else:
                plan.check_rows(batch_size)
            input_ids, inputs_embeds, attention_mask, linear_attention_mask = fill_prefix(
                plan, input_ids, inputs_embeds, attention_mask, linear_attention_mask, embed=self.embed_tokens
            )
        fill_columns = 0 if plan is None else plan.fill_columns
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        # 2. RoPE positions: counting on from what the cache has read; given ones are the caller's (`plan.positions`).
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None]
            if continuing:
                position_ids = position_ids + cache.positions  # a tensor: a compiled step serves every position
        elif fill_columns:
            position_ids = plan.positions(position_ids.to(inputs_embeds.device))
        has_sliding = "sliding_attention" in config.mixer_types
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if has_sliding else None

        # 3. The blocks, with output capturing (hidden states, attention weights), in the model's layout.
        outputs = self.run_layers(
            inputs_embeds, attention_mask=attention_mask, position_embeddings=position_embeddings, cache=cache,
            linear_attention_mask=linear_attention_mask, prefix=plan, return_dict=True, **kwargs,
        )
        if cache is not None:
            cache.advance(inputs_embeds.shape[1], real_tokens, batch_size, inputs_embeds.device)
            if plan is not None:
                cache.prefix = plan

        # 4. The caller's positions only: the fill columns never leave the model.
        if fill_columns:
            outputs.last_hidden_state = outputs.last_hidden_state[:, fill_columns:]
            if outputs.hidden_states is not None:
                outputs.hidden_states = tuple(h[:, fill_columns:] for h in outputs.hidden_states)
            if outputs.attentions is not None:
                # (B, H, queries, keys): the fill is neither a query nor a key of the caller's
                outputs.attentions = tuple(a[:, :, fill_columns:, fill_columns:] for a in outputs.attentions)
        if outputs.attentions is not None and not continuing and caller_mask is not None:
            # 0 on the caller's padding columns, as a row shows alone (its fill may sit in its batch padding).
            keys = caller_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
            outputs.attentions = tuple(a.masked_fill(~keys, 0.0) for a in outputs.attentions)
        return model_output(
            JRTRNNModelOutput, cache, last_hidden_state=outputs.last_hidden_state,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    @capture_outputs
    def run_layers(
        self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None, cache: JRTRNNCache | None,
        linear_attention_mask: torch.Tensor | None, prefix: PrefixPlan | None, **kwargs,
    ) -> BaseModelOutputWithPast:
        """The blocks and the final norm over `inputs_embeds` `(B, T', hidden)` in the model's layout (after the
        fill); attention_mask `(B, T')` the padding of these tokens, or None."""
        output_attentions = bool(kwargs.pop("output_attentions", None) or self.config.output_attentions)
        hidden_states = inputs_embeds.float()  # the residual stream stays fp32
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings, cache=cache,
                linear_attention_mask=linear_attention_mask, prefix=prefix, output_attentions=output_attentions,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states)


class JRTRNNForCausalLM(JRTRNNPreTrainedModel, JRTRNNGenerationMixin, GenerationMixin):
    """JRT-RNN / Based language model: `JRTRNNModel` plus a (tied) LM head.

    `generate()` is transformers' own: the model fills the JRT prefix itself and keeps its state in a `JRTRNNCache`,
    so every decoding strategy, streamer and processor sees the caller's tokens only.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> import modeling_jrt  # registers model_type "jrt_rnn"
        >>> config = modeling_jrt.JRTRNNConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4,
        ...                                    num_attention_heads=4, intermediate_size=128,
        ...                                    mixer_types=["conv", "linear_attention", "sliding_attention", "conv"],
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
        # The labels rule (`labels.py`) before any forward sees the labels, also one a trainer put in place of this
        # one (TRL's fused LM head). `.remove()` restores the leak outside the forward (benchmarks/sft_leak.py).
        self.leak_free_labels_hook = self.register_forward_pre_hook(leak_free_labels, with_kwargs=True)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, then earlier releases' saved settings moved (`legacy_folders.py`)."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        migrate_legacy_generation_settings(model, pretrained_model_name_or_path, kwargs)
        return loaded

    @property
    def generation_config(self) -> GenerationConfig | None:
        """The generation defaults (`generation_config.json`)."""
        return self.__dict__.get("jrt_generation_config")

    @generation_config.setter
    def generation_config(self, value: GenerationConfig | None) -> None:
        """Ids the model must never generate (padded vocabulary rows, [MASK]: `never_generated_ids`) join the
        `suppress_tokens` of every generation config the model is given: at construction, on load, on assignment."""
        missing = set(never_generated_ids(self.config)) - set(value.suppress_tokens or []) if value is not None else ()
        if missing:
            value.suppress_tokens = sorted(set(value.suppress_tokens or []) | missing)
        self.__dict__["jrt_generation_config"] = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: JRTRNNCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        linear_attention_mask: torch.Tensor | None = None,
        prefix_length: int | torch.LongTensor | None = None,
        prompt_lengths: torch.LongTensor | None = None,
        prefix_strategy: str | None = None,
        prefix_pad_token_id: int | None = None,
        prefix_plan: PrefixPlan | None = None,
        past_key_values: JRTRNNCache | None = None,
        **kwargs,
    ) -> JRTRNNCausalLMOutput | tuple:
        """
        Args:
            labels: `(B, T)` token ids (shifted inside, -100 ignored): the mean next-token cross-entropy through
                `self.loss_function`. Targets the encoder read are never scored (the labels rule, `labels.py`).
            mlm_labels: (keyword) `(B, T)` masked-LM targets of the JRT objective (`JRTDataCollator`): the loss is then
                `NTP + config.mlm_weight * MLM` (`loss.jrt_loss`), with the labels as given.
            logits_to_keep: logits for the last `logits_to_keep` positions only (0 = all), or those a tensor selects.
            prefix_plan: each row's prefix, planned already (`plan_prefix`; the labels hook `labels.leak_free_labels`
                passes its own, with the labels checked): the targets its encoder reads are never scored.
            Other arguments: see `JRTRNNModel.forward`.

        Returns:
            `JRTRNNCausalLMOutput` with `loss`, `logits` `(B, T, vocab_size)`, the cache, and `ntp_loss` / `mlm_loss`
            when `mlm_labels` are given.
        """
        if prefix_plan is None:  # (a plan comes from the labels hook, which checked the labels; a caller's is trusted)
            labels = check_labels(labels, input_ids, inputs_embeds, kwargs, self.config.vocab_size)
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("`logits_to_keep` "
                             f"({'a tensor' if isinstance(logits_to_keep, torch.Tensor) else logits_to_keep}) with "
                             "`labels`: the loss needs the logits of every position; pass `logits_to_keep=0` (the "
                             "default) when training, and keep logits only when generating.")
        mlm_labels = kwargs.pop("mlm_labels", None)
        if mlm_labels is not None:
            check_jrt_objective_prefix(self.config, prefix_length)
        if labels is not None and labels_rule_applies(self.config, mlm_labels, cache, past_key_values):
            # Without its hooks (`model.forward(...)`) the rule plans here; a given plan (the hook's, whose labels are
            # masked already, or a caller's) rules the mask.
            labels, prompt_lengths, prefix_plan, kwargs = apply_labels_rule(
                self.config, labels, attention_mask, kwargs, prompt_lengths=prompt_lengths,
                prefix_length=prefix_length, prefix_strategy=prefix_strategy, prefix_pad_token_id=prefix_pad_token_id,
                plan=prefix_plan,
            )
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            linear_attention_mask=linear_attention_mask, prefix_length=prefix_length, prompt_lengths=prompt_lengths,
            prefix_strategy=prefix_strategy, prefix_pad_token_id=prefix_pad_token_id, prefix_plan=prefix_plan,
            return_dict=True, **{k: v for k, v in kwargs.items() if k not in LOSS_KWARGS},
        )
        model_cache = getattr(outputs, CACHE_FIELD)
        logits = self.lm_head(keep_last_logits(outputs.last_hidden_state, logits_to_keep))

        loss = ntp_loss = mlm_loss = None
        if mlm_labels is not None:
            if labels is None:
                raise ValueError("`mlm_labels` need `labels` (the next-token targets) as well: see JRTDataCollator.")
            loss, ntp_loss, mlm_loss = jrt_loss(
                logits, labels, mlm_labels,
                mlm_weight=self.config.mlm_weight, num_items_in_batch=kwargs.get("num_items_in_batch"),
            )
        elif labels is not None:
            loss_kwargs = {k: v for k, v in kwargs.items() if k in LOSS_KWARGS}
            targets = loss_kwargs.get("shift_labels")
            targets = labels[:, 1:] if targets is None else targets
            if not torch.compiler.is_compiling() and not bool((targets != IGNORE_INDEX).any()):
                logger.warning_once(
                    "This batch has no scored target: every label is -100 or inside its row's JRT prefix (which the "
                    "encoder reads, so it is never scored). The loss is 0 (no gradient) instead of NaN. Use rows "
                    "longer than `prefix_length`, completion-only labels (-100 over the prompt: the prompt becomes "
                    "the prefix), or the JRT objective (`jrt_train.JRTDataCollator`)."
                )
                loss = logits.sum() * 0.0
            else:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                          **loss_kwargs)
        return model_output(
            JRTRNNCausalLMOutput, model_cache, loss=loss, logits=logits, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions, ntp_loss=ntp_loss, mlm_loss=mlm_loss,
        )

# The auto classes each model class is saved under (`auto_map`), so that `save_pretrained` ships the code.
_AUTO_CLASSES = {JRTRNNModel: "AutoModel", JRTRNNForCausalLM: "AutoModelForCausalLM"}
for _cls, _auto_class in _AUTO_CLASSES.items():
    _cls.register_for_auto_class(_auto_class)

__all__ = [
    "JRTRNNDecoderLayer", "JRTRNNForCausalLM", "JRTRNNLinearAttention", "JRTRNNMLP", "JRTRNNModel",
    "JRTRNNPreTrainedModel", "JRTRNNRMSNorm", "JRTRNNShortConv", "JRTRNNSlidingWindowAttention",
]
