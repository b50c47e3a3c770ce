"""The chunked scan as one differentiable custom op: `scan`, with an explicit backward in O(block x state) memory.

The chunked path wherever it is differentiated or traced by torch.compile. Forward: `scan_in_place`, which also
keeps each query's denominator; the op saves its inputs, output and denominators (O(T (K + V))) instead of every
block's features, weights and chunk states. Backward: two sweeps over the chunks, the features rebuilt block by
block; the formulas are docs/prefill.md §4.4 (`G_i`, the forward sweep, the backward sweep `R`, the encoder).

`d phi -> d x` is `CompactTaylor.features_backward`. The gate, the compact/full state maps and the key masks stay
outside the op (autograd traces them). Forward and gradients are custom ops (`_OP_PREFIX`), so a compiled graph
holds two opaque nodes whatever T is.
"""

from __future__ import annotations

import re

import torch

from .chunked_scan import (
    Workspace, add_encoder_in_place, block_sizes, chunk_decays, copy_chunk_major, decay_factors, encoder_blocks,
    encoder_scratch_numel, scan_in_place, without_autocast,
)
from .compact_taylor import CompactTaylor


def _rows(x: torch.Tensor, seq_len: int, *, position_last: bool) -> torch.Tensor:
    """(N, B, H, D, C) (`position_last`) or (N, B, H, C, D) chunk-major -> (B, T, H, D), `copy_chunk_major`'s
    inverse."""
    chunks = x.permute(1, 0, 4, 2, 3) if position_last else x.permute(1, 0, 3, 2, 4)  # (B, N, C, H, D)
    return chunks.reshape(chunks.shape[0], -1, *chunks.shape[3:])[:, :seq_len]


@without_autocast
def scan_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_enc: torch.Tensor | None, v_enc: torch.Tensor | None,
    state: torch.Tensor, output: torch.Tensor, denominators: torch.Tensor, raw: torch.Tensor | None,
    decoder_keys: torch.Tensor | None, encoder_keys: torch.Tensor | None, decay: torch.Tensor | None,
    taylor: CompactTaylor, chunk_size: int, d_output: torch.Tensor | None, d_state: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `scan` (module docstring): `(dq, dk, dv, dk_enc, dv_enc, d state)`, each in its input's dtype
    (None for an absent encoder). Besides the forward's inputs: its (ungated) output y `(B, T, H, V)`, `denominators`
    `(N, B, H, C, 1)` its `den + eps`, and the gradients of the output and compact final state (None: zero)."""
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim, dtype = v.shape[-1], state.dtype
    width, num_features, token_heads = value_dim + 1, taylor.num_features, batch_size * num_heads
    num_chunks = -(-seq_len // chunk_size)
    block, encoder_block = block_sizes(num_chunks, chunk_size, 0 if k_enc is None else k_enc.shape[1], token_heads)
    blocks = [(first, min(first + block, num_chunks)) for first in range(0, num_chunks, block)]
    raw, decoder_keys, encoder_keys = (None if m is None else m.to(dtype) for m in (raw, decoder_keys, encoder_keys))

    # Chunk-major operands, O(T (K + V)): raw q and k (masked raw keys 0), [v, 1] of the keys that count, and G.
    shape = (num_chunks, batch_size, num_heads)
    queries = q.new_empty(*shape, feature_dim, chunk_size, dtype=dtype)  # (N, B, H, K, C), zeros past T
    copy_chunk_major(queries, q, position_last=True)
    keys = q.new_empty(*shape, feature_dim, chunk_size, dtype=dtype)
    copy_chunk_major(keys, k if raw is None else k * raw[:, :seq_len, None, None].to(k.dtype), position_last=True)
    counted = q.new_ones(batch_size, seq_len, num_heads, 1, dtype=dtype) if decoder_keys is None \
        else decoder_keys[:, :, None, None].expand(-1, -1, num_heads, 1)
    values = q.new_empty(*shape, chunk_size, width, dtype=dtype)  # (N, B, H, C, W): [v, 1] of the keys that count
    copy_chunk_major(values[..., value_dim:], counted, position_last=False)  # zero rows past T
    copy_chunk_major(values[..., :value_dim], v, position_last=False)
    if decoder_keys is not None:
        values[..., :value_dim].mul_(values[..., value_dim:])
    gradient = q.new_zeros(*shape, chunk_size, width, dtype=dtype)  # (N, B, H, C, W)
    if d_output is not None:
        copy_chunk_major(gradient[..., :value_dim], d_output, position_last=False)
        y = q.new_empty(*shape, chunk_size, value_dim, dtype=dtype)
        copy_chunk_major(y, output, position_last=False)
        gradient[..., value_dim:] = (gradient[..., :value_dim] * y).sum(-1, keepdim=True).neg_()
        gradient.div_(denominators)
    running = state.reshape(token_heads, num_features, width).clone()  # (B H, F', W)
    reverse = running.new_zeros(running.shape) if d_state is None else \
        d_state.to(dtype).reshape(running.shape).clone()  # R, the gradient of the state after the last chunk

    causal = torch.ones(chunk_size, chunk_size, dtype=dtype, device=q.device).tril_()  # (C, C)
    if decay is not None:
        log_gamma, position, intra_decay, read_decay = decay_factors(decay, chunk_size)
    # The gradient of the inter-chunk read: the numerator columns read the state decayed by gamma**(i + 1).
    read_gradient = gradient if decay is None else \
        torch.cat([gradient[..., :value_dim] * read_decay, gradient[..., value_dim:]], dim=-1)

    def chunk_length(chunk: int) -> int:
        return min(chunk_size, seq_len - chunk * chunk_size)

    def aged(values_c: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """[v, 1] of one chunk `(B, H, C, W)` with the numerator decayed to the chunk's end, each key's decay
        gamma**(L - 1 - j) `(H, C, 1)` and the state's gamma**L (None, None without a decay)."""
        if decay is None:
            return values_c, None, None
        value_decay, state_decay = chunk_decays(log_gamma, position, length)
        update = torch.cat([values_c[..., :value_dim] * value_decay, values_c[..., value_dim:]], dim=-1)
        return update, value_decay, state_decay

    d_queries, d_keys, d_values = torch.zeros_like(queries), torch.zeros_like(keys), torch.zeros_like(values)
    features_shape = (block, batch_size, num_heads, num_features, chunk_size)
    phi_q, phi_k = queries.new_empty(features_shape), queries.new_empty(features_shape)  # a block's, written in place
    d_phi = queries.new_empty(features_shape)

    # Forward sweep: the state before each chunk, d phi(Q), and the intra-chunk block.
    if k_enc is not None:
        encoder_workspace = Workspace(encoder_scratch_numel(encoder_block, token_heads, taylor), q, dtype)
        encoder_form = running.new_zeros(batch_size, num_heads, feature_dim + 1, feature_dim + 1)
        add_encoder_in_place(running.view(state.shape)[..., :value_dim], encoder_form, k_enc, v_enc, raw,
                             encoder_keys, taylor, encoder_workspace, encoder_block)
        running.view(state.shape)[..., value_dim] += taylor.form_to_compact(encoder_form)
    for first, last in blocks:
        n = last - first
        q_n, k_n, values_n, gradient_n = queries[first:last], keys[first:last], values[first:last], gradient[first:last]
        taylor.features(k_n, key=True, out=phi_k[:n])  # (n, B, H, F', C)
        d_q_intra, d_k_intra, d_v_intra = _intra_chunk_gradients(
            q_n, k_n, values_n, gradient_n, causal if decay is None else intra_decay, causal
        )
        d_queries[first:last] += d_q_intra
        d_keys[first:last] += d_k_intra
        d_values[first:last, ..., :value_dim] += d_v_intra
        # Inter-chunk: d phi(Q_c) = S_c G_c^T, then the state update of the forward.
        for c in range(n):
            torch.bmm(running, read_gradient[first + c].flatten(0, 1).transpose(1, 2), out=d_phi[c].flatten(0, 1))
            update, _, state_decay = aged(values_n[c], chunk_length(first + c))
            if state_decay is not None:
                running.view(batch_size, num_heads, num_features, width)[..., :value_dim].mul_(state_decay)
            running.baddbmm_(phi_k[c].flatten(0, 1), update.flatten(0, 1))
        d_queries[first:last] += taylor.features_backward(q_n, d_phi[:n], key=False)

    # Backward sweep: R from the final state's gradient back to the state after the encoder.
    reverse_numerator = reverse.view(batch_size, num_heads, num_features, width)[..., :value_dim]
    for first, last in reversed(blocks):
        n = last - first
        q_n, k_n, values_n = queries[first:last], keys[first:last], values[first:last]
        taylor.features(q_n, key=False, out=phi_q[:n])
        taylor.features(k_n, key=True, out=phi_k[:n])
        for c in reversed(range(n)):
            update, value_decay, state_decay = aged(values_n[c], chunk_length(first + c))
            torch.bmm(reverse, update.flatten(0, 1).transpose(1, 2), out=d_phi[c].flatten(0, 1))
            d_update = (phi_k[c].flatten(0, 1).transpose(1, 2) @ reverse).view(update.shape)  # (B, H, C, W)
            if state_decay is not None:
                d_update = d_update[..., :value_dim] * value_decay
                reverse_numerator.mul_(state_decay)
            d_values[first + c, ..., :value_dim] += d_update[..., :value_dim]
            reverse.baddbmm_(phi_q[c].flatten(0, 1), read_gradient[first + c].flatten(0, 1))
        d_keys[first:last] += taylor.features_backward(k_n, d_phi[:n], key=True)

    d_k_enc = d_v_enc = None
    if k_enc is not None:  # every query reads every encoder key: R after the whole sweep
        encoder_workspace.reset()
        d_k_enc, d_v_enc = _encoder_gradients(
            k_enc, v_enc, raw, encoder_keys, reverse.view(batch_size, num_heads, num_features, width), taylor,
            encoder_workspace, encoder_block,
        )

    d_q = _rows(d_queries, seq_len, position_last=True)
    d_k = _rows(d_keys, seq_len, position_last=True)
    if raw is not None:
        d_k = d_k * raw[:, :seq_len, None, None]
    d_v = _rows(d_values[..., :value_dim], seq_len, position_last=False) * counted
    return (d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), d_k_enc, d_v_enc,
            reverse.view(state.shape).to(state.dtype))


def _intra_chunk_gradients(
    q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, gradient: torch.Tensor, numerator_mask: torch.Tensor,
    causal: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk `(n, B, H, K, C)` and dv `(n, B, H, C, V)` through the intra-chunk products of n chunks.

    Forward: numerator `(A * numerator_mask) V`, denominator `(A * causal) 1_counted`, A = 1 + s + s**2 / 2 with
    s = q.k / sqrt(K); `numerator_mask` is the causal mask (`(C, C)`) or the decayed one gamma**(i - j) (`(H, C, C)`).
    q, k `(n, B, H, K, C)`; values `(n, B, H, C, V + 1)` ([v, 1] of the keys that count); gradient like values.
    """
    value_dim, scale = values.shape[-1] - 1, q.shape[-2] ** -0.5
    s = torch.matmul(q.transpose(-1, -2), k).mul_(scale)  # (n, B, H, C, C)
    if numerator_mask is causal:  # no decay: one product over the numerator and the denominator columns
        d_weights = torch.matmul(gradient, values.transpose(-1, -2)).mul_(causal)
    else:
        d_weights = torch.matmul(gradient[..., :value_dim], values[..., :value_dim].transpose(-1, -2))
        d_weights.mul_(numerator_mask).addcmul_(gradient[..., value_dim:], values[..., value_dim:].transpose(-1, -2)
                                                * causal)
    d_scores = d_weights.addcmul_(d_weights, s).mul_(scale)  # dA/ds = 1 + s, and the 1 / sqrt(K) of s
    d_q, d_k = torch.matmul(k, d_scores.transpose(-1, -2)), torch.matmul(q, d_scores)
    weights = torch.addcmul(s.new_full((), 0.5), s.add_(1.0), s, value=0.5, out=s).mul_(numerator_mask)  # A, masked
    return d_q, d_k, torch.matmul(weights.transpose(-1, -2), gradient[..., :value_dim])


def _encoder_gradients(
    k_enc: torch.Tensor, v_enc: torch.Tensor, raw: torch.Tensor | None, encoder_keys: torch.Tensor | None,
    reverse: torch.Tensor, taylor: CompactTaylor, workspace: Workspace, block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dk_enc, dv_enc)` in the inputs' dtypes from `reverse` `(B, H, F', V + 1)`, the gradient R of the state after
    the encoder: d phi(K_enc) = [V_enc, 1] R^T and d[V_enc, 1] = phi(K_enc) R for the keys that count, over the
    blocks of `encoder_blocks`."""
    value_dim = v_enc.shape[-1]
    d_k_enc, d_v_enc = torch.empty_like(k_enc), torch.empty_like(v_enc)
    for start, end, scaled, phi in encoder_blocks(k_enc, raw, taylor, workspace, block):
        values = v_enc[:, start:end].transpose(1, 2).to(reverse.dtype)  # (B, H, m, V)
        d_phi = (reverse[..., :value_dim] @ values.transpose(-1, -2)).add_(reverse[..., value_dim:])  # (B, H, F', m)
        if encoder_keys is not None:  # outside the row's range: no encoder key
            d_phi.mul_(encoder_keys[:, None, None, start:end])
        d_keys = taylor.features_backward(scaled, d_phi, key=True, scaled=True)  # (B, H, K, m)
        if raw is not None:  # "reference": a masked raw key is 0
            d_keys = d_keys * raw[:, None, None, start:end]
        d_k_enc[:, start:end] = d_keys.permute(0, 3, 1, 2)
        d_values = (phi.transpose(-1, -2) @ reverse)[..., :value_dim]  # (B, H, m, V)
        if encoder_keys is not None:  # outside the row's range: no encoder key
            d_values = d_values * encoder_keys[:, None, start:end, None]
        d_v_enc[:, start:end] = d_values.transpose(1, 2)
    return d_k_enc, d_v_enc


# The ops' names carry this module's name: a converted checkpoint's copy of this file (remote code) registers its
# own ops next to the installed package's.
_OP_PREFIX = "jrt::" + re.sub(r"\W", "_", __name__)
_SCAN_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? k_enc, Tensor? v_enc, Tensor state, Tensor? raw, Tensor? decoder_keys, "
    "Tensor? encoder_keys, Tensor? log_decay, int chunk_size, float eps) -> (Tensor, Tensor, Tensor)"
)
_GRADIENTS_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? k_enc, Tensor? v_enc, Tensor state, Tensor output, Tensor denominators, "
    "Tensor? raw, Tensor? decoder_keys, Tensor? encoder_keys, Tensor? log_decay, int chunk_size, Tensor d_output, "
    "Tensor d_state) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _scan_forward(q, k, v, k_enc, v_enc, state, raw, decoder_keys, encoder_keys, log_decay, chunk_size, eps):
    """The op's implementation: `(ungated output (B, T, H, V), final compact state, denominators (N, B, H, C, 1))`
    in the compute dtype (the state's)."""
    batch_size, seq_len, num_heads, feature_dim = q.shape
    num_chunks = -(-seq_len // chunk_size)
    denominators = q.new_empty(num_chunks, batch_size, num_heads, chunk_size, 1, dtype=state.dtype)
    output, final = scan_in_place(
        state, q, k, v, k_enc, v_enc, raw=raw, decoder_keys=decoder_keys, encoder_keys=encoder_keys, gate=None,
        decay=log_decay, taylor=CompactTaylor(feature_dim, q.device), chunk_size=chunk_size, eps=eps,
        denominators=denominators,
    )
    return output, final, denominators


def _scan_forward_fake(q, k, v, k_enc, v_enc, state, raw, decoder_keys, encoder_keys, log_decay, chunk_size, eps):
    batch_size, seq_len, num_heads, _ = q.shape
    num_chunks = -(-seq_len // chunk_size)
    output = q.new_empty(batch_size, seq_len, num_heads, v.shape[-1], dtype=state.dtype)
    return output, state.new_empty(state.shape), q.new_empty(num_chunks, batch_size, num_heads, chunk_size, 1,
                                                             dtype=state.dtype)


def _scan_gradients(q, k, v, k_enc, v_enc, state, output, denominators, raw, decoder_keys, encoder_keys, log_decay,
                    chunk_size, d_output, d_state):
    """The gradient op's implementation: `scan_gradients`, contiguous (the layout the fake implementation promises
    a compiled graph), an absent encoder's gradients as empty tensors (an op returns tensors only)."""
    grads = scan_gradients(
        q, k, v, k_enc, v_enc, state, output, denominators, raw, decoder_keys, encoder_keys, log_decay,
        CompactTaylor(q.shape[-1], q.device), chunk_size, d_output, d_state,
    )
    return tuple(q.new_empty(0) if grad is None else grad.contiguous() for grad in grads)


def _scan_gradients_fake(q, k, v, k_enc, v_enc, state, output, denominators, raw, decoder_keys, encoder_keys,
                         log_decay, chunk_size, d_output, d_state):
    return tuple(q.new_empty(0) if t is None else t.new_empty(t.shape) for t in (q, k, v, k_enc, v_enc, state))


def _setup_context(ctx, inputs, output):
    q, k, v, k_enc, v_enc, state, raw, decoder_keys, encoder_keys, log_decay, chunk_size, _ = inputs
    ctx.save_for_backward(q, k, v, k_enc, v_enc, state, output[0], output[2], raw, decoder_keys, encoder_keys,
                          log_decay)
    ctx.chunk_size = chunk_size


def _backward(ctx, d_output, d_state, _d_denominators):
    q, k, v, k_enc, v_enc, state, output, denominators, raw, decoder_keys, encoder_keys, log_decay = ctx.saved_tensors
    d_output = torch.zeros_like(output) if d_output is None else d_output
    d_state = torch.zeros_like(state) if d_state is None else d_state
    d_q, d_k, d_v, d_k_enc, d_v_enc, d_initial = _gradients_op(
        q, k, v, k_enc, v_enc, state, output, denominators, raw, decoder_keys, encoder_keys, log_decay, ctx.chunk_size,
        d_output, d_state,
    )
    absent = k_enc is None
    return (d_q, d_k, d_v, None if absent else d_k_enc, None if absent else d_v_enc, d_initial,
            None, None, None, None, None, None)


try:
    _gradients_op = torch.library.custom_op(
        _OP_PREFIX + "_scan_gradients", _scan_gradients, mutates_args=(), schema=_GRADIENTS_SCHEMA
    )
    _gradients_op.register_fake(_scan_gradients_fake)
    scan = torch.library.custom_op(_OP_PREFIX + "_scan", _scan_forward, mutates_args=(), schema=_SCAN_SCHEMA)
    scan.register_fake(_scan_forward_fake)
    scan.register_autograd(_backward, setup_context=_setup_context)
except RuntimeError:  # this module was imported before under the same name (importlib.reload): reuse its ops
    _gradients_op = getattr(torch.ops.jrt, _OP_PREFIX.split("::")[1] + "_scan_gradients").default
    scan = getattr(torch.ops.jrt, _OP_PREFIX.split("::")[1] + "_scan").default
