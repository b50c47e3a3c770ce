"""Rotary position embedding (RoPE) of the sliding-window attention: non-interleaved (rotate-half) over the full
head dim, as flash-attn's `RotaryEmbedding` in the reference."""

from __future__ import annotations

import torch
from torch import nn

from .configuration_jrt import JRTRNNConfig


class JRTRNNRotaryEmbedding(nn.Module):
    """The RoPE tables (module docstring)."""

    def __init__(self, config: JRTRNNConfig):
        super().__init__()
        self.config = config

    @staticmethod
    def compute_inv_freq(config: JRTRNNConfig) -> torch.Tensor:
        dim = config.head_dim
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (B, T) -> cos, sin (B, T, head_dim) in x's dtype, computed in fp32."""
        # Computed per call (a few dozen floats): no buffer to restore after meta-device loading.
        inv_freq = self.compute_inv_freq(self.config).to(x.device)
        freqs = position_ids[..., None].float() * inv_freq
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
    if not torch.is_grad_enabled():
        return rotary_without_autograd(q, cos, sin), rotary_without_autograd(k, cos, sin)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_without_autograd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` without autograd: one product and two multiply-adds on the halves."""
    half = x.shape[-1] // 2
    output = x * cos
    output[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    output[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return output


__all__ = ["JRTRNNRotaryEmbedding", "apply_rotary_pos_emb", "rotate_half", "rotary_without_autograd"]
