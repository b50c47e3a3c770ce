"""The chunked scan of prefix linear attention in PyTorch: O(T) time, O(block x state) working memory.

What `prefix_linear_attention_chunked` (in `linear_attention.py`, with the validation, the dispatch and the custom op
around it) runs on inputs it has checked; the algorithm and its measurements are in docs/prefill.md §4.2.

    inter-chunk   o_c  = phi(Q_c) @ state                       everything before the chunk (and the encoder)
    intra-chunk   o_c += tril(1 + s + s**2 / 2) @ [V_c, 1]       s = Q_c K_c^T / sqrt(K): no (C, F) features
    update        state += phi(K_c)^T @ [V_c, 1]
    y_c = o_c[:, :V] / (o_c[:, V] + eps)

The features are the compact Taylor features of `_CompactTaylor` (153 instead of 273 rows for K = 16); the state
goes in and out in the full cache layout of `linear_attention.py` `(B, H, F, V + 1)`. Two executions of the same
arithmetic: `_scan_in_place` without autograd (every CPU prefill: blocks of chunks in one reused workspace, the
running state read and updated chunk by chunk) and `_scan_chunks` with autograd (one batched op per step for a
block of chunks, no loop over chunks; under torch.compile the whole sequence is one block).
"""

from __future__ import annotations

import math

import torch


# Token-heads per block of the eager scans: a block's features, chunk states (autograd) and weights stay within a few
# MiB, whatever T is. Under torch.compile the whole sequence is one block (see `prefix_linear_attention_chunked`).
BLOCK_TOKEN_HEADS = 8192
ENCODER_BLOCK_TOKEN_HEADS = 8192


class _CompactTaylor:
    """The 2nd-order Taylor features without duplicates, for the chunked scan (docs/prefill.md §4.2, "Symmetric
    second order").

    x_i x_j = x_j x_i, so the K**2 ordered pairs hold only K (K + 1) / 2 distinct products. With x' = x / K**(1/4),
    the chunked scan's features have F' = 1 + 2 K + K (K - 1) / 2 rows (153 instead of 273 for K = 16):

        [1, x'_1 .. x'_K, x'_1**2 .. x'_K**2, x'_i x'_j for i < j (row-major)]

    unweighted for queries; for keys the squares carry a weight 1/2, so that phi(q).phi(k) = 1 + s + s**2 / 2 exactly
    (sum_i 1/2 q'_i**2 k'_i**2 + sum_{i<j} q'_i q'_j k'_i k'_j = (q'.k')**2 / 2). The compact state sums the key
    features times [v, 1]. In the full layout (module docstring) the quadratic row (i, j) is x'_i x'_j / sqrt(2), so
    the full state is S_ii = sqrt(2) compact_ii and S_ij = S_ji = compact_ij / sqrt(2); `compress` maps a full state
    back ((S_ij + S_ji) / sqrt(2)): exact for the symmetric sums the scan adds. The antisymmetric part of an arbitrary
    initial state, which no query reads, is carried aside by the caller.
    """

    def __init__(self, feature_dim: int, device: torch.device):
        K = feature_dim
        self.feature_dim = K
        rows, cols = torch.triu_indices(K, K, offset=1, device=device)  # (K (K - 1) / 2,) each, i < j
        self.num_features = 1 + 2 * K + rows.numel()
        offset = 1 + K  # first quadratic row of the full layout
        diagonal = torch.arange(K, device=device)
        # Full-layout row of each compact quadratic row (diagonal first, then i < j) and of its mirror (j, i).
        self.upper = offset + torch.cat([diagonal * (K + 1), rows * K + cols])
        self.lower = offset + torch.cat([diagonal * (K + 1), cols * K + rows])
        self.is_diagonal = torch.arange(self.upper.numel(), device=device) < K
        # Full quadratic row f = i K + j -> its compact row (counted from the first quadratic one), and the factor.
        compact_row = torch.empty(K * K, dtype=torch.long, device=device)
        compact_row[self.upper - offset] = torch.arange(self.upper.numel(), device=device)
        compact_row[self.lower - offset] = torch.arange(self.upper.numel(), device=device)
        self.compact_of_full = offset + compact_row
        full = torch.arange(K * K, device=device)
        diagonal_row = (full // K == full % K).to(torch.float64)
        self.expand_factor = diagonal_row * math.sqrt(2.0) + (1 - diagonal_row) / math.sqrt(2.0)  # fp64, cast per use
        # Row f of the features is ext[left[f]] * ext[right[f]] with ext = [1, x'] (row 0 is the constant 1).
        ones = torch.zeros(1 + K, dtype=torch.long, device=device)
        linear = torch.arange(1, K + 1, device=device)
        self.left = torch.cat([ones, linear, rows + 1])
        self.right = torch.cat([ones[:1], linear, linear, cols + 1])
        self.key_weight = torch.ones(self.num_features, dtype=torch.float64, device=device)
        self.key_weight[1 + K : 1 + 2 * K] = 0.5  # the keys' squares: phi(q).phi(k) = 1 + s + s**2 / 2

    def features(self, x: torch.Tensor, *, key: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """(..., K, n) -> (..., F', n): the compact features of n tokens, token index last (the matmuls' layout).

        With `out` (a `(..., F', n)` tensor; no autograd) each block of rows is written in place by `out=` products,
        about 5x faster on a CPU than building the rows and concatenating them. Without it (autograd, torch.compile's
        tracing) two row gathers and one product: `phi = ext[left] * ext[right]` with `ext = [1, x']`.
        """
        K = self.feature_dim
        if out is None:
            extended = torch.cat([torch.ones_like(x[..., :1, :]), x * K**-0.25], dim=-2)  # (..., K + 1, n)
            phi = extended.index_select(-2, self.left) * extended.index_select(-2, self.right)
            return phi * self.key_weight.to(phi.dtype)[:, None] if key else phi
        out[..., 0, :] = 1.0
        scaled = torch.mul(x, K**-0.25, out=out[..., 1 : 1 + K, :])
        squares = torch.mul(scaled, scaled, out=out[..., 1 + K : 1 + 2 * K, :])
        if key:
            squares.mul_(0.5)
        row = 1 + 2 * K
        for i in range(K - 1):  # x'_i x'_j for j > i: K - 1 - i rows
            torch.mul(scaled[..., i : i + 1, :], scaled[..., i + 1 :, :], out=out[..., row : row + K - 1 - i, :])
            row += K - 1 - i
        return out

    def compress(self, state: torch.Tensor) -> torch.Tensor:
        """(..., F, W) full state -> (..., F', W) compact state."""
        quadratic = state[..., self.upper, :] + state[..., self.lower, :] * (~self.is_diagonal)[:, None].to(state.dtype)
        quadratic = quadratic / math.sqrt(2.0)
        return torch.cat([state[..., : 1 + self.feature_dim, :], quadratic], dim=-2)

    def expand(self, compact: torch.Tensor) -> torch.Tensor:
        """(..., F', W) compact state -> (..., F, W) symmetric full state."""
        quadratic = compact[..., self.compact_of_full, :] * self.expand_factor[:, None].to(compact.dtype)
        return torch.cat([compact[..., : 1 + self.feature_dim, :], quadratic], dim=-2)


def _decayed_prefix_weights(decay: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """(H, n + 1, n + 1) weights of the decayed chunk scan: states = weights @ [state_0, U_0, ..., U_{n-1}].

    Row c is the state before chunk c (row n: after the last chunk): the initial state (column 0) decayed C c times
    and the sum U_d of chunk d (column d + 1, d < c) decayed C (c - 1 - d) times, the end of chunk d being where its
    sum was taken (`_scan_chunks` step 1).
    """
    index = torch.arange(num_chunks + 1, device=decay.device, dtype=decay.dtype)
    # exponent[c, j]: chunk c reads the initial state (j = 0) decayed C c times, chunk sum j - 1 decayed C (c - j).
    exponent = index[:, None] - index[None, :]  # (n + 1, n + 1)
    exponent = torch.where(index[None, :] == 0, index[:, None], exponent)
    weights = torch.exp(decay[:, None, None] * chunk_size * exponent.clamp(min=0))  # (H, n + 1, n + 1)
    return weights * (index[None, :] <= index[:, None]).to(decay.dtype)


def _scan_chunks(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    values: torch.Tensor,
    taylor: _CompactTaylor,
    decay: torch.Tensor | None,
    padding: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """n chunks at once, without a loop over them: the causal part of the chunked scan.

    Letters: n chunks, b batch, h heads, c/j positions in a chunk (C), k feature dim, f compact features (F'),
    w = V + 1 value columns (the last one is the denominator's 1).

    Args:
        state: `(b, h, f, w)` compact state before the first chunk.
        q, k: `(n, b, h, k, c)` queries and keys, position last.
        values: `(n, b, h, c, w)` [v, 1]; all zero for a key that does not count (masked, or padding).
        decay: `(h,)` log gamma, or None.
        padding: positions at the end of the last chunk that are no tokens (its keys do not count; with a decay the
            returned state must not decay over them).

    Returns:
        `(state after the n chunks (b, h, f, w), (n, b, h, c, w) numerator (undecayed/decayed as the layer wants) and
        denominator columns of every query)`.

    Steps (one batched op each, whatever n is):
        1. chunk sums      U_d = phi(K_d)^T values_d                                  (n, b, h, f, w)
        2. chunk states    S_c = state + sum_{d < c} U_d: a cumulative sum over chunks (n + 1, b, h, f, w)
        3. inter-chunk     O_c = phi(Q_c) S_c
        4. intra-chunk     O_c += tril(1 + s + s**2 / 2) values_c,  s = Q_c K_c^T / sqrt(K)
    With a decay, the state's numerator columns decay by gamma per token: U_d sums gamma**(C - 1 - j) phi(k_j) v_j,
    step 2 weighs the chunks by `_decayed_prefix_weights`, step 3 reads S_c with gamma**(i + 1) and step 4 weighs
    the numerator by gamma**(i - j); the denominator column never decays.
    """
    num_chunks, chunk_size = q.shape[0], q.shape[-1]
    value_dim = values.shape[-1] - 1
    phi_q = taylor.features(q, key=False)  # (n, b, h, f, c)
    phi_k = taylor.features(k, key=True)  # (n, b, h, f, c)
    # 1 + s + s**2 / 2 = (1 + (1 + s)**2) / 2: one matmul and two passes over the (c, c) tiles.
    shifted = (q * taylor.feature_dim**-0.5).transpose(-1, -2) @ k + 1.0  # (n, b, h, c, c): 1 + s
    weights = torch.addcmul(shifted.new_full((), 0.5), shifted, shifted, value=0.5).tril_()  # (n, b, h, c, c)

    if decay is None:
        states = torch.cat([state[None], phi_k @ values], dim=0).cumsum(dim=0)  # (n + 1, b, h, f, w)
        inter = phi_q.transpose(-1, -2) @ states[:-1]  # (n, b, h, c, w)
        output = torch.baddbmm(inter.flatten(0, 2), weights.flatten(0, 2), values.flatten(0, 2))  # (n b h, c, w)
        return states[-1], output.view(inter.shape)

    position = torch.arange(chunk_size, device=q.device, dtype=q.dtype)
    decay = decay[:, None, None]  # (h, 1, 1)
    # 1. Chunk sums: the numerator columns of key j decay (C - 1 - j) times until the chunk's end.
    age, _ = _chunk_decays(decay, position, chunk_size)  # (h, c, 1)
    sums = phi_k @ torch.cat([values[..., :value_dim] * age, values[..., value_dim:]], dim=-1)  # (n, b, h, f, w)
    # 2. States: numerator columns through the decayed prefix weights, the denominator column by a plain cumsum.
    stacked = torch.cat([state[None], sums], dim=0)  # (n + 1, b, h, f, w)
    prefix = _decayed_prefix_weights(decay[:, 0, 0], num_chunks, chunk_size)  # (h, n + 1, n + 1)
    numerator_states = torch.einsum("hcd,dbhfv->cbhfv", prefix, stacked[..., :value_dim])  # (n + 1, b, h, f, V)
    states = torch.cat([numerator_states, torch.cumsum(stacked[..., value_dim:], dim=0)], dim=-1)
    final = states[-1]
    if padding:  # the last chunk's sum was decayed to its padded end; the state ends `padding` positions earlier
        final = torch.cat([final[..., :value_dim] * torch.exp(-decay * padding), final[..., value_dim:]], dim=-1)
    # 3. Inter-chunk read: numerator gamma**(i + 1) (positions in the chunk), denominator undecayed.
    inter = phi_q.transpose(-1, -2) @ states[:-1]  # (n, b, h, c, w)
    read_decay = torch.exp(decay * (position + 1)[:, None])  # (h, c, 1)
    # 4. Intra-chunk: numerator weights gamma**(i - j), denominator weights undecayed.
    distance = (position[:, None] - position[None, :]).clamp(min=0)  # (c, c)
    numerator = inter[..., :value_dim] * read_decay + (weights * torch.exp(decay * distance)) @ values[..., :value_dim]
    denominator = inter[..., value_dim:] + weights @ values[..., value_dim:]
    return final, torch.cat([numerator, denominator], dim=-1)


def _copy_chunk_major(destination: torch.Tensor, source: torch.Tensor, *, position_last: bool) -> None:
    """Copy `source` `(B, L, H, D)` into the chunk-major `destination` `(n, B, H, D, C)` (`position_last`) or
    `(n, B, H, C, D)`, for L <= n C tokens; the positions past L (a last chunk that is not whole) are set to 0."""
    num_chunks, chunk_size = destination.shape[0], destination.shape[-1 if position_last else -2]
    batch_size, length, num_heads, dim = source.shape
    whole = length // chunk_size
    order = (1, 0, 3, 4, 2) if position_last else (1, 0, 3, 2, 4)
    if whole:
        destination[:whole].copy_(source[:, : whole * chunk_size].view(
            batch_size, whole, chunk_size, num_heads, dim).permute(*order))
    if whole < num_chunks:
        destination[whole:].zero_()
        rest = length - whole * chunk_size
        if rest:
            last = destination[whole, ..., :rest] if position_last else destination[whole, ..., :rest, :]
            last.copy_(source[:, whole * chunk_size :].permute(0, 2, 3, 1) if position_last
                       else source[:, whole * chunk_size :].permute(0, 2, 1, 3))


class _Workspace:
    """One allocation per call, handed out as views: the scratch tensors of `_scan_in_place`.

    A single block of memory instead of a dozen multi-MiB tensors: its pages are touched once per call, and the
    allocator can hand the same block to the next call (a prefill calls the scan once per layer) instead of mapping
    fresh pages for every tensor. `reset()` starts over at the beginning, for a phase whose tensors replace the last
    phase's.
    """

    def __init__(self, numel: int, like: torch.Tensor, dtype: torch.dtype):
        self._memory = like.new_empty(numel, dtype=dtype)
        self._offset = 0

    def take(self, *shape: int) -> torch.Tensor:
        numel = math.prod(shape)
        if self._offset + numel > self._memory.numel():
            raise RuntimeError(f"_Workspace: {shape} does not fit ({self._memory.numel() - self._offset} left).")
        view = self._memory[self._offset : self._offset + numel].view(shape)
        self._offset += numel
        return view

    def reset(self) -> None:
        self._offset = 0


def _scan_in_place(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_enc: torch.Tensor | None,
    v_enc: torch.Tensor | None,
    *,
    raw: torch.Tensor | None,
    decoder_keys: torch.Tensor | None,
    encoder_keys: torch.Tensor | None,
    gate: torch.Tensor | None,
    decay: torch.Tensor | None,
    taylor: _CompactTaylor,
    chunk_size: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan without autograd: what every CPU prefill runs.

    The same arithmetic as `_scan_chunks` (inter-chunk read of the running state, intra-chunk `(C, C)` weights,
    state updates), organised for a CPU:

    - the scratch tensors are views of one `_Workspace` allocated per call and reused by every block of chunks
      (repeated multi-MiB allocations cost page faults);
    - per block of n chunks (about `BLOCK_TOKEN_HEADS` token-heads), the chunk-major copies of q, k, [v, 1], the
      features and the intra-chunk products are batched over the block, every product writing into its buffer
      (`out=`);
    - the running state is read and updated chunk by chunk, two `baddbmm_` over the B H heads per chunk: the state
      `(B H, F', W)` stays in cache between the read and the update, and no per-chunk states are built (at 8k, about
      6% faster than the chunk sums as one product plus a cumulative sum over the block);
    - the normalised rows go straight into the `(B, T, H, V)` output.

    With the Based decay (`decay`, log gamma per head) the numerator columns decay as in `_scan_chunks`, chunk by
    chunk: the intra-chunk numerator weights get gamma**(i - j) (the denominator's do not: its column is taken before),
    the read of the state gamma**(i + 1), and the update is `S[:, :V] = gamma**L S[:, :V] + sum_j gamma**(L - 1 - j)
    phi(k_j) v_j` for a chunk of L tokens (the last one may be shorter), the denominator column undecayed.

    Memory: the inputs, the output and O(block) scratch, whatever T is.

    Args:
        state: `(B, H, F', V + 1)` compact state before the encoder and the first token.
        q, k, v: `(B, T, H, K / V)`; k_enc, v_enc: `(B, M, H, K / V)` or None.
        raw, decoder_keys, encoder_keys: the masks of `_key_masks` (None: every key counts).
        gate: `(B, T, H)` numerator gate, or None.
        decay: `(H,)` log gamma in the compute dtype, or None.

    Returns:
        `(output (B, T, H, V) in the compute dtype, compact state after the last token (B, H, F', V + 1))`.
    """
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim, dtype = v.shape[-1], state.dtype
    width, num_features, token_heads = value_dim + 1, taylor.num_features, batch_size * num_heads
    num_chunks = -(-seq_len // chunk_size)
    block = min(num_chunks, max(1, BLOCK_TOKEN_HEADS // (token_heads * chunk_size)))
    encoder_length = 0 if k_enc is None else k_enc.shape[1]
    encoder_block = max(1, min(encoder_length, ENCODER_BLOCK_TOKEN_HEADS // token_heads))
    # Per token-head of a block: q and k (K each, position last), [v, 1] and the combined output (W each), the
    # features of q and k (F' each), a row of (C, C) weights, the gate, raw-key and counted-key weights and the
    # decayed scan's intra-chunk denominator.
    decoder_numel = block * chunk_size * token_heads * (2 * feature_dim + 2 * width + 2 * num_features + chunk_size + 4)
    decoder_numel += chunk_size * token_heads * width  # the decayed scan's read of one chunk
    encoder_numel = encoder_block * token_heads * (feature_dim + width + num_features)
    workspace = _Workspace(max(decoder_numel, encoder_numel), q, dtype)
    running = state.reshape(token_heads, num_features, width).clone()  # (B H, F', W), updated in place
    as_dtype = (lambda mask: None if mask is None else mask.to(dtype))
    raw, decoder_keys, encoder_keys = as_dtype(raw), as_dtype(decoder_keys), as_dtype(encoder_keys)

    # 1. Encoder reduction: running += phi(K_enc)^T [V_enc, 1] over each row's range.
    if k_enc is not None:
        _add_encoder_in_place(running, k_enc, v_enc, raw, encoder_keys, taylor, workspace, encoder_block)

    # 2. Causal scan, in blocks of n chunks (the encoder's buffers are free again).
    workspace.reset()
    shape = (block, batch_size, num_heads)
    queries = workspace.take(*shape, feature_dim, chunk_size)
    keys = workspace.take(*shape, feature_dim, chunk_size)
    values = workspace.take(*shape, chunk_size, width)
    phi_q = workspace.take(*shape, num_features, chunk_size)
    phi_k = workspace.take(*shape, num_features, chunk_size)
    weights = workspace.take(*shape, chunk_size, chunk_size)
    combined = workspace.take(*shape, chunk_size, width)
    gates = None if gate is None else workspace.take(*shape, chunk_size, 1)
    raw_weights = None if raw is None else workspace.take(*shape, 1, chunk_size)  # 0 / 1 per raw key
    counted_weights = workspace.take(*shape, chunk_size, 1)  # 0 / 1 per [v, 1] row (masks, padding)
    if decay is not None:
        position = torch.arange(chunk_size, device=q.device, dtype=dtype)
        log_gamma = decay[:, None, None]  # (H, 1, 1)
        distance = position[:, None] - position[None, :]  # (C, C): i - j
        intra_decay = torch.exp(log_gamma * distance.clamp(min=0)).tril_()  # (H, C, C): gamma**(i - j), i >= j
        read_decay = torch.exp(log_gamma[..., 0] * (position + 1))[..., None]  # (H, C, 1): gamma**(i + 1)
        whole_chunk_decays = _chunk_decays(log_gamma, position, chunk_size)  # recomputed only for a shorter last one
        intra_denominator = workspace.take(*shape, chunk_size, 1)
        read = workspace.take(token_heads, chunk_size, width)
        read_numerator = read.view(batch_size, num_heads, chunk_size, width)[..., :value_dim]
        running_numerator = running.view(batch_size, num_heads, num_features, width)[..., :value_dim]
    output = q.new_empty(batch_size, seq_len, num_heads, value_dim, dtype=dtype)
    for first in range(0, num_chunks, block):
        n = min(block, num_chunks - first)
        start, end = first * chunk_size, min((first + n) * chunk_size, seq_len)
        q_n, k_n, v_n, phi_q_n, phi_k_n = queries[:n], keys[:n], values[:n], phi_q[:n], phi_k[:n]
        w_n, o_n = weights[:n].flatten(0, 2), combined[:n]
        _copy_chunk_major(q_n, q[:, start:end], position_last=True)
        _copy_chunk_major(k_n, k[:, start:end], position_last=True)
        if raw_weights is not None:  # "reference": a masked raw key is 0 (phi(0) keeps weight 1)
            _copy_chunk_major(raw_weights[:n], raw[:, start:end, None, None].expand(-1, -1, num_heads, 1),
                              position_last=True)
            k_n.mul_(raw_weights[:n])
        _copy_chunk_major(v_n[..., :value_dim], v[:, start:end], position_last=False)
        v_n[..., value_dim] = 1.0
        if decoder_keys is not None or end - start < n * chunk_size:  # keys that do not count, padding of the chunks
            counted = v.new_ones(1, 1, 1, 1, dtype=dtype).expand(batch_size, end - start, num_heads, 1) \
                if decoder_keys is None else decoder_keys[:, start:end, None, None].expand(-1, -1, num_heads, 1)
            _copy_chunk_major(counted_weights[:n], counted, position_last=False)  # zeros past the last token
            v_n.mul_(counted_weights[:n])
        taylor.features(q_n, key=False, out=phi_q_n)
        taylor.features(k_n, key=True, out=phi_k_n)
        # Intra-chunk: tril(1 + s + s**2 / 2) [V, 1] with s = q.k / sqrt(K); (1 + s + s**2 / 2) = (1 + (1 + s)**2) / 2.
        torch.bmm(q_n.flatten(0, 2).transpose(1, 2), k_n.flatten(0, 2), out=w_n)
        w_n.mul_(feature_dim**-0.5).add_(1.0)
        torch.addcmul(w_n.new_full((), 0.5), w_n, w_n, value=0.5, out=w_n).tril_()
        if decay is None:
            torch.bmm(w_n, v_n.flatten(0, 2), out=o_n.flatten(0, 2))
            # Inter-chunk, chunk by chunk: read the state before the chunk, then add the chunk's keys to it.
            for c in range(n):
                o_n[c].flatten(0, 1).baddbmm_(phi_q_n[c].flatten(0, 1).transpose(1, 2), running)
                running.baddbmm_(phi_k_n[c].flatten(0, 1), v_n[c].flatten(0, 1))
        else:
            # The denominator column from the undecayed weights, the numerator from gamma**(i - j) times them.
            torch.bmm(w_n, v_n[..., value_dim:].flatten(0, 2), out=intra_denominator[:n].flatten(0, 2))
            weights[:n].mul_(intra_decay)
            torch.bmm(w_n, v_n.flatten(0, 2), out=o_n.flatten(0, 2))
            o_n[..., value_dim:].copy_(intra_denominator[:n])
            for c in range(n):
                length = min(chunk_size, end - start - c * chunk_size)  # tokens in this chunk
                torch.bmm(phi_q_n[c].flatten(0, 1).transpose(1, 2), running, out=read)
                read_numerator.mul_(read_decay)
                o_n[c].flatten(0, 1).add_(read)
                value_decay, state_decay = (
                    whole_chunk_decays if length == chunk_size else _chunk_decays(log_gamma, position, length)
                )
                v_n[c, ..., :value_dim].mul_(value_decay)
                running_numerator.mul_(state_decay)
                running.baddbmm_(phi_k_n[c].flatten(0, 1), v_n[c].flatten(0, 1))
        numerator, denominator = o_n[..., :value_dim], o_n[..., value_dim:].add_(eps)
        if gates is not None:
            _copy_chunk_major(gates[:n], gate[:, start:end, :, None], position_last=False)
            numerator.mul_(gates[:n])
        _divide_into_rows(output[:, start:end], numerator, denominator)
    return output, running.view(state.shape)


def _chunk_decays(
    log_gamma: torch.Tensor, position: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decays over a chunk of `length` tokens (log_gamma `(H, 1, 1)`, position `(C,)`): each key's value to the
    chunk's end, gamma**(L - 1 - j) `(H, C, 1)`, and the state, gamma**L `(H, 1, 1)`."""
    return torch.exp(log_gamma * (length - 1 - position)[:, None]), torch.exp(log_gamma * length)


def _add_encoder_in_place(
    running: torch.Tensor,
    k_enc: torch.Tensor,
    v_enc: torch.Tensor,
    raw: torch.Tensor | None,
    encoder_keys: torch.Tensor | None,
    taylor: _CompactTaylor,
    workspace: _Workspace,
    block: int,
) -> None:
    """running `(B H, F', V + 1)` += phi(K_enc)^T [V_enc, 1] over each row's encoder range, `block` tokens at a time
    (one product per block: the encoder has no causal structure). `raw` / `encoder_keys` `(B, >= M)` are the 0 / 1
    masks of `_scan_in_place` in the compute dtype (None: every key counts)."""
    batch_size, encoder_length, num_heads, feature_dim = k_enc.shape
    value_dim = v_enc.shape[-1]
    keys = workspace.take(batch_size, num_heads, feature_dim, block)
    values = workspace.take(batch_size, num_heads, block, value_dim + 1)
    phi = workspace.take(batch_size, num_heads, taylor.num_features, block)
    for start in range(0, encoder_length, block):
        end = min(start + block, encoder_length)
        m = end - start
        keys_m, values_m, phi_m = keys[..., :m], values[:, :, :m], phi[..., :m]
        keys_m.copy_(k_enc[:, start:end].permute(0, 2, 3, 1))
        if raw is not None:  # "reference": a masked raw key is 0
            keys_m.mul_(raw[:, None, None, start:end])
        values_m[..., :value_dim].copy_(v_enc[:, start:end].transpose(1, 2))
        values_m[..., value_dim] = 1.0
        if encoder_keys is not None:  # outside the row's range (or a strict pad): no encoder key
            values_m.mul_(encoder_keys[:, None, start:end, None])
        taylor.features(keys_m, key=True, out=phi_m)
        running.baddbmm_(phi_m.flatten(0, 1), values_m.flatten(0, 1))


def _divide_into_rows(destination: torch.Tensor, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
    """destination `(B, L, H, V)` = numerator / denominator, both chunk-major `(n, B, H, C, V)` / `(n, B, H, C, 1)`,
    L <= n C (positions past L are dropped): the normalisation and the layout change in one pass."""
    batch_size, length, num_heads, dim = destination.shape
    chunk_size = numerator.shape[-2]
    whole = length // chunk_size
    if whole:
        rows = destination[:, : whole * chunk_size].view(batch_size, whole, chunk_size, num_heads, dim)
        torch.div(numerator[:whole], denominator[:whole], out=rows.permute(1, 0, 3, 2, 4))
    rest = length - whole * chunk_size
    if rest:
        torch.div(numerator[whole, :, :, :rest], denominator[whole, :, :, :rest],
                  out=destination[:, whole * chunk_size :].transpose(1, 2))


def _blocks(num_items: int, per_block: int) -> list[tuple[int, int]]:
    """[start, end) ranges of the eager block loop; one range for the whole sequence under torch.compile, so the
    traced graph has no loop over T (its size and compile time do not depend on T, and a dynamic T traces once)."""
    if torch.compiler.is_compiling():
        return [(0, num_items)]
    return [(start, min(start + per_block, num_items)) for start in range(0, num_items, per_block)]


def _position_last_chunks(x: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """(B, N C, H, D) -> (N, B, H, D, C) contiguous: chunk-major, so that a block of chunks is one contiguous slice."""
    batch_size, _, num_heads, dim = x.shape
    chunks = x.view(batch_size, num_chunks, chunk_size, num_heads, dim)
    return chunks.permute(1, 0, 3, 4, 2).contiguous()


def chunked_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_enc: torch.Tensor | None,
    v_enc: torch.Tensor | None,
    *,
    raw: torch.Tensor | None,
    decoder_keys: torch.Tensor | None,
    encoder_keys: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    log_decay: torch.Tensor | None,
    gate: torch.Tensor | None,
    eps: float,
    chunk_size: int,
    dtype: torch.dtype,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked prefill of validated inputs, at least one row and one token.

    Args:
        q, k, v, k_enc, v_enc: as `prefix_linear_attention_chunked` takes them (`(B, T, H, K / V)`, encoder
            `(B, M, H, K / V)` or None).
        raw, decoder_keys, encoder_keys: the key masks of `linear_attention._key_masks`, bool, or None where every
            key counts: `raw` `(B, T)` keys whose raw vector is kept ("reference" masking zeroes the others before
            the feature map), `decoder_keys` `(B, T)` and `encoder_keys` `(B, M)` the keys that count.
        initial_state: `(B, H, F, V + 1)` in the full layout, or None (zeros).
        log_decay: `(H,)` log gamma, or None; gate: `(B, T, H)`, or None.
        dtype: the compute dtype (fp32, or fp64 for fp64 inputs).
        in_place: no autograd: the in-place scan of inference (`_scan_in_place`); otherwise `_scan_chunks` per block.

    Returns:
        `(output (B, T, H, V) in v's dtype, final state (B, H, F, V + 1) in the full layout and the compute dtype)`.
    """
    output_dtype = v.dtype
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim = v.shape[-1]
    encoder_length = 0 if k_enc is None else k_enc.shape[1]
    taylor = _CompactTaylor(feature_dim, q.device)
    token_heads = batch_size * num_heads

    residual = None  # the antisymmetric part of the initial state, which the compact state cannot hold
    if initial_state is None:
        state = q.new_zeros(batch_size, num_heads, taylor.num_features, value_dim + 1, dtype=dtype)
    else:
        state = taylor.compress(initial_state.to(dtype))  # (B, H, F', V + 1)
        residual = initial_state.to(dtype) - taylor.expand(state)  # (B, H, F, V + 1)

    if in_place:
        decay = None if log_decay is None else log_decay.to(dtype)
        output, state = _scan_in_place(
            state, q, k, v, k_enc, v_enc, raw=raw, decoder_keys=decoder_keys, encoder_keys=encoder_keys, gate=gate,
            decay=decay, taylor=taylor, chunk_size=chunk_size, eps=eps,
        )
        return output.to(output_dtype), _full_state(state, residual, taylor, decay, seq_len)

    # 1. Encoder reduction: state += sum_m phi(k_enc_m) [v_enc_m, 1] over each row's range, in blocks of tokens.
    if k_enc is not None:
        k_enc = k_enc.to(dtype)
        if raw is not None:
            k_enc = k_enc * raw[:, :encoder_length, None, None].to(dtype)
        counted = encoder_keys.to(dtype)[:, :, None, None]  # (B, M, 1, 1): outside the row's range: no encoder key
        per_block = max(1, ENCODER_BLOCK_TOKEN_HEADS // token_heads)
        for start, end in _blocks(encoder_length, per_block):
            phi_k = taylor.features(k_enc[:, start:end].permute(0, 2, 3, 1), key=True)  # (B, H, F', m)
            values = torch.cat([v_enc[:, start:end].to(dtype), counted.new_ones(1, 1, 1, 1).expand(
                batch_size, end - start, num_heads, 1)], dim=-1) * counted[:, start:end]  # (B, m, H, V + 1)
            state = state + phi_k @ values.transpose(1, 2)  # (B, H, F', V + 1)

    # 2. Causal scan over all T tokens (padded to whole chunks with keys that do not count), from the encoder state.
    num_chunks = -(-seq_len // chunk_size)
    padding = num_chunks * chunk_size - seq_len
    counted = torch.ones(batch_size, seq_len, dtype=dtype, device=q.device) if decoder_keys is None \
        else decoder_keys.to(dtype)  # (B, T)
    q, k = q.to(dtype), k.to(dtype)
    if raw is not None:
        k = k * raw[:, :, None, None].to(dtype)  # a masked raw key is 0 ("reference": phi(0) keeps weight 1)
    values = torch.cat([v.to(dtype), torch.ones_like(v[..., :1], dtype=dtype)], dim=-1) * counted[:, :, None, None]
    if padding:
        q, k, values = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padding)) for x in (q, k, values))
    q = _position_last_chunks(q, num_chunks, chunk_size)  # (N, B, H, K, C)
    k = _position_last_chunks(k, num_chunks, chunk_size)  # (N, B, H, K, C)
    values = values.view(batch_size, num_chunks, chunk_size, num_heads, value_dim + 1)
    values = values.permute(1, 0, 3, 2, 4).contiguous()  # (N, B, H, C, W)
    decay = None if log_decay is None else log_decay.to(dtype)
    if gate is not None:
        gate = torch.nn.functional.pad(gate.to(dtype), (0, 0, 0, padding))
        gate = gate.view(batch_size, num_chunks, chunk_size, num_heads).permute(1, 0, 3, 2)[..., None]  # (N,B,H,C,1)

    # The output in the layout of v, (B, N C, H, V) viewed as (B, N, C, H, V): blocks write their rows into it
    # (eagerly without autograd), or are concatenated (autograd, torch.compile).
    padded_shape = (batch_size, num_chunks, chunk_size, num_heads, value_dim)
    output = q.new_empty(padded_shape) if in_place else None
    outputs = []
    per_block = max(1, BLOCK_TOKEN_HEADS // (token_heads * chunk_size))
    for start, end in _blocks(num_chunks, per_block):
        state, combined = _scan_chunks(
            state, q[start:end], k[start:end], values[start:end], taylor, decay, padding if end == num_chunks else 0
        )
        numerator, denominator = combined[..., :value_dim], combined[..., value_dim:]  # (n, B, H, C, V / 1)
        if gate is not None:
            numerator = numerator * gate[start:end]
        if in_place:
            torch.div(numerator.permute(1, 0, 3, 2, 4), (denominator + eps).permute(1, 0, 3, 2, 4),
                      out=output[:, start:end])
        else:
            outputs.append(numerator / (denominator + eps))  # (n, B, H, C, V)
    if not in_place:
        output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)  # (N, B, H, C, V)
        output = output.permute(1, 0, 3, 2, 4)  # (B, N, C, H, V)
    output = output.reshape(batch_size, num_chunks * chunk_size, num_heads, value_dim)
    if padding:
        output = output[:, :seq_len]

    return output.to(output_dtype), _full_state(state, residual, taylor, decay, seq_len)


def _full_state(
    compact: torch.Tensor, residual: torch.Tensor | None, taylor: _CompactTaylor, decay: torch.Tensor | None,
    seq_len: int,
) -> torch.Tensor:
    """The final state in the full cache layout `(B, H, F, V + 1)`: the compact state expanded, plus the
    antisymmetric part of the initial state (`residual`), decayed like the rest of it (once per token read)."""
    state = taylor.expand(compact)
    if residual is None:
        return state
    if decay is not None:
        value_dim = state.shape[-1] - 1
        total_decay = torch.exp(decay * seq_len)[None, :, None, None]  # (1, H, 1, 1)
        residual = torch.cat([residual[..., :value_dim] * total_decay, residual[..., value_dim:]], dim=-1)
    return state + residual
