"""The O(T^2) oracle of prefix / causal linear attention: the full feature map and the (T, T) weights,
materialised. The tests' reference (pass fp64); `prefix_linear_attention(..., implementation="quadratic")`."""

from __future__ import annotations

import torch

from .feature_map import taylor_feature_map
from .linear_attention_inputs import LinearAttentionInputs, compute_dtype


def quadratic_prefill(inputs: LinearAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle (`prefix_linear_attention_quadratic`) on validated inputs."""
    k_enc, v_enc, initial_state = inputs.k_enc, inputs.v_enc, inputs.initial_state
    log_decay, gate, eps = inputs.log_decay, inputs.gate, inputs.eps
    dtype = compute_dtype(inputs.q)
    seq_len, value_dim = inputs.q.shape[1], inputs.v.shape[-1]
    encoder_length = 0 if k_enc is None else k_enc.shape[1]
    raw, decoder_keys, encoder_keys = inputs.key_masks()
    q, k, v = inputs.q.to(dtype), inputs.k.to(dtype), inputs.v.to(dtype)

    phi_q = taylor_feature_map(q)  # (B, T, H, F)
    phi_k = _features_of_keys(k, raw, decoder_keys)  # (B, T, H, F)
    weights = torch.einsum("bihf,bjhf->bhij", phi_q, phi_k)  # (B, H, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    weights = weights.masked_fill(~causal, 0.0)

    positions = torch.arange(seq_len, device=q.device, dtype=dtype)
    numerator_weights = weights
    if log_decay is not None:
        distance = (positions[:, None] - positions[None, :]).clamp(min=0)  # (T, T)
        numerator_weights = weights * torch.exp(log_decay.to(dtype)[:, None, None] * distance)  # (B, H, T, T)
    numerator = torch.einsum("bhij,bjhv->bihv", numerator_weights, v)  # (B, T, H, V)
    denominator = weights.sum(-1).transpose(1, 2)  # (B, T, H)

    if initial_state is not None:
        previous = initial_state.to(dtype)
        previous_numerator = torch.einsum("bihf,bhfv->bihv", phi_q, previous[..., :value_dim])  # (B, T, H, V)
        if log_decay is not None:
            # The previous state is decayed once more for every token read since: gamma^(i + 1).
            previous_numerator = previous_numerator * torch.exp(
                log_decay.to(dtype)[None, None, :, None] * (positions[None, :, None, None] + 1)
            )
        numerator = numerator + previous_numerator
        denominator = denominator + torch.einsum("bihf,bhf->bih", phi_q, previous[..., value_dim])

    if k_enc is not None:
        raw_enc = None if raw is None else raw[:, :encoder_length]
        phi_k_enc = _features_of_keys(k_enc.to(dtype), raw_enc, encoder_keys)  # (B, M, H, F)
        encoder_weights = torch.einsum("bihf,bmhf->bhim", phi_q, phi_k_enc)  # (B, H, T, M)
        numerator = numerator + torch.einsum("bhim,bmhv->bihv", encoder_weights, v_enc.to(dtype))
        denominator = denominator + encoder_weights.sum(-1).transpose(1, 2)

    if gate is not None:
        numerator = numerator * gate.to(dtype)[..., None]
    output = numerator / (denominator[..., None] + eps)

    # Final state: sum over all keys, the decoder part decayed to the last position.
    if log_decay is not None:
        age = (seq_len - 1 - positions)[None, :, None, None]
        decayed = phi_k * torch.exp(log_decay.to(dtype)[None, None, :, None] * age)
        state = torch.cat([torch.einsum("bthf,bthv->bhfv", decayed, v), phi_k.sum(1)[..., None]], dim=-1)
    else:
        value_and_one = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, T, H, V + 1)
        state = torch.einsum("bthf,bthv->bhfv", phi_k, value_and_one)  # (B, H, F, V + 1)
    if initial_state is not None:
        if log_decay is not None:
            decay_all = torch.exp(log_decay.to(dtype) * seq_len)[None, :, None, None]
            previous = torch.cat([previous[..., :value_dim] * decay_all, previous[..., value_dim:]], dim=-1)
        state = state + previous
    if k_enc is not None:
        v_enc_and_one = torch.cat([v_enc.to(dtype), torch.ones_like(v_enc[..., :1], dtype=dtype)], dim=-1)
        state = state + torch.einsum("bmhf,bmhv->bhfv", phi_k_enc, v_enc_and_one)
    return output.to(inputs.v.dtype), state


def _features_of_keys(keys: torch.Tensor, raw: torch.Tensor | None, counted: torch.Tensor | None) -> torch.Tensor:
    """phi of keys `(B, T, H, K)` -> `(B, T, H, F)`: raw keys zeroed where `raw` is False (the reference's masking,
    before the feature map), features zeroed where `counted` is False (after it: phi(0) = [1, 0, ...] is not 0)."""
    if raw is not None:
        keys = keys * raw[:, :, None, None].to(keys.dtype)
    features = taylor_feature_map(keys)
    if counted is not None:
        features = features * counted[:, :, None, None].to(features.dtype)
    return features


__all__ = ["quadratic_prefill"]
