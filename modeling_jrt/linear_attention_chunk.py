"""The chunked prefill in PyTorch: O(T) time, the scan of `chunked_scan.py` (in place without autograd) or its
differentiable custom op (`chunked_scan_autograd.py`); `prefix_linear_attention(..., implementation="chunked")`."""

from __future__ import annotations

import torch

from .chunked_scan import full_state, scan_in_place
from .chunked_scan_autograd import scan
from .compact_taylor import CompactTaylor
from .feature_map import num_taylor_features
from .linear_attention_inputs import LinearAttentionInputs, compute_dtype, records_gradients


def empty_prefill(inputs: LinearAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The result for no rows (B = 0) or no tokens (T = 0, hence M = 0): an empty output and the state unchanged
    (the initial state, or zeros), as the oracle gives; both stay connected to the inputs for autograd."""
    q, v, initial_state = inputs.q, inputs.v, inputs.initial_state
    batch_size, _, num_heads, feature_dim = q.shape
    if initial_state is not None:
        state = initial_state.to(compute_dtype(q)) * 1
    else:
        state = q.new_zeros(batch_size, num_heads, num_taylor_features(feature_dim), v.shape[-1] + 1,
                            dtype=compute_dtype(q))
    return v * 0, state


def chunked_prefill(inputs: LinearAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan (`prefix_linear_attention_chunked`) on validated inputs with rows and tokens: without
    autograd `scan_in_place` (the gate inside), with autograd or under torch.compile the op `scan` (the gate outside).
    """
    q, k, v, k_enc, v_enc, initial_state, gate = inputs.differentiable
    log_decay, eps, chunk_size = inputs.log_decay, inputs.eps, inputs.chunk_size
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim, dtype = v.shape[-1], compute_dtype(q)
    raw, decoder_keys, encoder_keys = inputs.key_masks()
    taylor = CompactTaylor(feature_dim, q.device)
    residual = None  # the antisymmetric part of the initial state, which the compact state cannot hold
    if initial_state is None:
        state = q.new_zeros(batch_size, num_heads, taylor.num_features, value_dim + 1, dtype=dtype)
    else:
        state = taylor.compress(initial_state.to(dtype))  # (B, H, F', V + 1)
        residual = initial_state.to(dtype) - taylor.expand(state)  # (B, H, F, V + 1)
    decay = None if log_decay is None else log_decay.to(dtype)
    if torch.compiler.is_compiling() or records_gradients(*inputs.differentiable):
        output, state, _ = scan(q, k, v, k_enc, v_enc, state, raw, decoder_keys, encoder_keys, decay, chunk_size, eps)
        if gate is not None:
            output = output * gate[..., None].to(dtype)
    else:
        output, state = scan_in_place(
            state, q, k, v, k_enc, v_enc, raw=raw, decoder_keys=decoder_keys, encoder_keys=encoder_keys, gate=gate,
            decay=decay, taylor=taylor, chunk_size=chunk_size, eps=eps,
        )
    return output.to(v.dtype), full_state(state, residual, taylor, decay, seq_len)


__all__ = ["chunked_prefill", "empty_prefill"]
