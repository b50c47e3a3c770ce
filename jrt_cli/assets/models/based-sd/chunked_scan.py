"""The chunked scan of prefix linear attention in PyTorch: O(T) time, O(block x state) working memory.

What `prefix_linear_attention_chunked` (in `linear_attention.py`, with the validation and the dispatch around it)
runs on inputs it has checked; the algorithm and its measurements are in docs/prefill.md §4.2.

    inter-chunk   o_c  = phi(Q_c) @ state                       everything before the chunk (and the encoder)
    intra-chunk   o_c += tril(1 + s + s**2 / 2) @ [V_c, 1]       s = Q_c K_c^T / sqrt(K): no (C, F) features
    update        state += phi(K_c)^T @ [V_c, 1]
    y_c = o_c[:, :V] / (o_c[:, V] + eps)

The features are the compact Taylor features of `CompactTaylor` (153 instead of 273 rows for K = 16); the scan
reads and returns the compact state, `full_state` maps it back to the cache layout of `linear_attention.py`
`(B, H, F, V + 1)`. `scan_in_place` runs without autograd, in blocks of chunks in one reused workspace, the running
state read and updated chunk by chunk: every CPU prefill, and the forward of the differentiable op of
`chunked_scan_autograd.py`, whose backward uses the helpers here too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

# Token-heads per block of the scans (forward and backward): a block's features, weights and scratch stay within a few
# MiB, whatever T is.
BLOCK_TOKEN_HEADS = 8192
ENCODER_BLOCK_TOKEN_HEADS = 8192


def block_sizes(num_chunks: int, chunk_size: int, encoder_length: int, token_heads: int) -> tuple[int, int]:
    """`(chunks per decoder block, tokens per encoder block)` of every scan, forward and backward, from
    `BLOCK_TOKEN_HEADS` / `ENCODER_BLOCK_TOKEN_HEADS` as they are at call time."""
    block = min(num_chunks, max(1, BLOCK_TOKEN_HEADS // (token_heads * chunk_size)))
    return block, max(1, min(encoder_length, ENCODER_BLOCK_TOKEN_HEADS // token_heads))


def encoder_scratch_numel(block: int, token_heads: int, feature_dim: int, width: int, num_features: int) -> int:
    """Elements of the `Workspace` that `encoder_blocks` takes its buffers from: keys, [v, 1] and features of a block
    of `block` encoder tokens per token-head."""
    return block * token_heads * (feature_dim + width + num_features)


def decay_factors(decay: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """`(log_gamma (H, 1, 1), position (C,), intra-chunk gamma**(i - j) masked to i >= j (H, C, C), read decay
    gamma**(i + 1) (H, C, 1))` of the decayed scans, from `decay` = log gamma `(H,)`."""
    position = torch.arange(chunk_size, device=decay.device, dtype=decay.dtype)
    log_gamma = decay[:, None, None]
    distance = position[:, None] - position[None, :]  # (C, C): i - j
    intra_decay = torch.exp(log_gamma * distance.clamp(min=0)).tril_()
    read_decay = torch.exp(log_gamma[..., 0] * (position + 1))[..., None]
    return log_gamma, position, intra_decay, read_decay


class CompactTaylor:
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

    def features(self, x: torch.Tensor, *, key: bool, out: torch.Tensor) -> torch.Tensor:
        """(..., K, n) -> (..., F', n): the compact features of n tokens, token index last (the matmuls' layout),
        written into `out` `(..., F', n)` row block by row block with `out=` products (no autograd), about 5x faster on
        a CPU than building the rows and concatenating them."""
        K = self.feature_dim
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

    def features_backward(self, x: torch.Tensor, d_phi: torch.Tensor, *, key: bool) -> torch.Tensor:
        """The gradient `(..., K, n)` of x from that of its features `d_phi` `(..., F', n)` (the explicit backward).

        d x'_a = d phi_(linear a) + 2 w x'_a d phi_(a, a) + sum_(b != a) x'_b d phi_(a, b), w the squares' weight;
        the pairs go by the row blocks of `features` (row i pairs x'_i with x'_(i+1..K)), a few ops per block.
        """
        K = self.feature_dim
        scaled = x * K**-0.25
        squares = d_phi[..., 1 + K : 1 + 2 * K, :]
        d_scaled = torch.addcmul(d_phi[..., 1 : 1 + K, :], scaled, squares, value=1.0 if key else 2.0)
        row = 1 + 2 * K
        for i in range(K - 1):  # the pair rows (i, j > i)
            block = d_phi[..., row : row + K - 1 - i, :]
            d_scaled[..., i, :] += (scaled[..., i + 1 :, :] * block).sum(-2)
            d_scaled[..., i + 1 :, :].addcmul_(scaled[..., i : i + 1, :], block)
            row += K - 1 - i
        return d_scaled.mul_(K**-0.25)

    def compress(self, state: torch.Tensor) -> torch.Tensor:
        """(..., F, W) full state -> (..., F', W) compact state."""
        quadratic = state[..., self.upper, :] + state[..., self.lower, :] * (~self.is_diagonal)[:, None].to(state.dtype)
        quadratic = quadratic / math.sqrt(2.0)
        return torch.cat([state[..., : 1 + self.feature_dim, :], quadratic], dim=-2)

    def expand(self, compact: torch.Tensor) -> torch.Tensor:
        """(..., F', W) compact state -> (..., F, W) symmetric full state."""
        quadratic = compact[..., self.compact_of_full, :] * self.expand_factor[:, None].to(compact.dtype)
        return torch.cat([compact[..., : 1 + self.feature_dim, :], quadratic], dim=-2)


def copy_chunk_major(destination: torch.Tensor, source: torch.Tensor, *, position_last: bool) -> None:
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


class Workspace:
    """One allocation per call, handed out as views: the scratch tensors of `scan_in_place`.

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
            raise RuntimeError(f"Workspace: {shape} does not fit ({self._memory.numel() - self._offset} left).")
        view = self._memory[self._offset : self._offset + numel].view(shape)
        self._offset += numel
        return view

    def reset(self) -> None:
        self._offset = 0


def scan_in_place(
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
    taylor: CompactTaylor,
    chunk_size: int,
    eps: float,
    denominators: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan without autograd: what every CPU prefill runs.

    Per chunk: the inter-chunk read of the running state, the intra-chunk `(C, C)` weights, the state update
    (module docstring), organised for a CPU:

    - the scratch tensors are views of one `Workspace` allocated per call and reused by every block of chunks
      (repeated multi-MiB allocations cost page faults);
    - per block of n chunks (about `BLOCK_TOKEN_HEADS` token-heads), the chunk-major copies of q, k, [v, 1], the
      features and the intra-chunk products are batched over the block, every product writing into its buffer
      (`out=`);
    - the running state is read and updated chunk by chunk, two `baddbmm_` over the B H heads per chunk: the state
      `(B H, F', W)` stays in cache between the read and the update, and no per-chunk states are built (at 8k, about
      6% faster than the chunk sums as one product plus a cumulative sum over the block);
    - the normalised rows go straight into the `(B, T, H, V)` output.

    With the Based decay (`decay`, log gamma per head) the numerator columns decay by gamma per token, chunk by
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
        denominators: a chunk-major `(N, B, H, C, 1)` tensor (N = ceil(T / C)) that receives each query's
            `denominator + eps` (what the explicit backward of `chunked_scan_autograd.py` needs), or None.

    Returns:
        `(output (B, T, H, V) in the compute dtype, compact state after the last token (B, H, F', V + 1))`.
    """
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim, dtype = v.shape[-1], state.dtype
    width, num_features, token_heads = value_dim + 1, taylor.num_features, batch_size * num_heads
    num_chunks = -(-seq_len // chunk_size)
    block, encoder_block = block_sizes(num_chunks, chunk_size, 0 if k_enc is None else k_enc.shape[1], token_heads)
    # Per token-head of a block: q and k (K each, position last), [v, 1] and the combined output (W each), the
    # features of q and k (F' each), a row of (C, C) weights, the gate, raw-key and counted-key weights and the
    # decayed scan's intra-chunk denominator.
    decoder_numel = block * chunk_size * token_heads * (2 * feature_dim + 2 * width + 2 * num_features + chunk_size + 4)
    decoder_numel += chunk_size * token_heads * width  # the decayed scan's read of one chunk
    encoder_numel = encoder_scratch_numel(encoder_block, token_heads, feature_dim, width, num_features)
    workspace = Workspace(max(decoder_numel, encoder_numel), q, dtype)
    running = state.reshape(token_heads, num_features, width).clone()  # (B H, F', W), updated in place
    as_dtype = (lambda mask: None if mask is None else mask.to(dtype))
    raw, decoder_keys, encoder_keys = as_dtype(raw), as_dtype(decoder_keys), as_dtype(encoder_keys)

    # 1. Encoder reduction: running += phi(K_enc)^T [V_enc, 1] over each row's range.
    if k_enc is not None:
        add_encoder_in_place(running, k_enc, v_enc, raw, encoder_keys, taylor, workspace, encoder_block)

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
        log_gamma, position, intra_decay, read_decay = decay_factors(decay, chunk_size)
        whole_chunk_decays = chunk_decays(log_gamma, position, chunk_size)  # recomputed only for a shorter last one
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
        copy_chunk_major(q_n, q[:, start:end], position_last=True)
        copy_chunk_major(k_n, k[:, start:end], position_last=True)
        if raw_weights is not None:  # "reference": a masked raw key is 0 (phi(0) keeps weight 1)
            copy_chunk_major(raw_weights[:n], raw[:, start:end, None, None].expand(-1, -1, num_heads, 1),
                              position_last=True)
            k_n.mul_(raw_weights[:n])
        copy_chunk_major(v_n[..., :value_dim], v[:, start:end], position_last=False)
        v_n[..., value_dim] = 1.0
        if decoder_keys is not None or end - start < n * chunk_size:  # keys that do not count, padding of the chunks
            counted = v.new_ones(1, 1, 1, 1, dtype=dtype).expand(batch_size, end - start, num_heads, 1) \
                if decoder_keys is None else decoder_keys[:, start:end, None, None].expand(-1, -1, num_heads, 1)
            copy_chunk_major(counted_weights[:n], counted, position_last=False)  # zeros past the last token
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
                    whole_chunk_decays if length == chunk_size else chunk_decays(log_gamma, position, length)
                )
                v_n[c, ..., :value_dim].mul_(value_decay)
                running_numerator.mul_(state_decay)
                running.baddbmm_(phi_k_n[c].flatten(0, 1), v_n[c].flatten(0, 1))
        numerator, denominator = o_n[..., :value_dim], o_n[..., value_dim:].add_(eps)
        if denominators is not None:
            denominators[first : first + n].copy_(denominator)
        if gates is not None:
            copy_chunk_major(gates[:n], gate[:, start:end, :, None], position_last=False)
            numerator.mul_(gates[:n])
        _divide_into_rows(output[:, start:end], numerator, denominator)
    return output, running.view(state.shape)


def chunk_decays(
    log_gamma: torch.Tensor, position: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decays over a chunk of `length` tokens (log_gamma `(H, 1, 1)`, position `(C,)`): each key's value to the
    chunk's end, gamma**(L - 1 - j) `(H, C, 1)`, and the state, gamma**L `(H, 1, 1)`."""
    return torch.exp(log_gamma * (length - 1 - position)[:, None]), torch.exp(log_gamma * length)


def encoder_blocks(
    k_enc: torch.Tensor,
    v_enc: torch.Tensor,
    raw: torch.Tensor | None,
    encoder_keys: torch.Tensor | None,
    taylor: CompactTaylor,
    workspace: Workspace,
    block: int,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The encoder's operands, `block` tokens at a time: `(start, end, keys (B, H, K, m), [v, 1] (B, H, m, V + 1),
    phi(keys) (B, H, F', m))` for positions [start, end), masked as the scan masks them: a masked raw key is 0
    ("reference"), and the [v, 1] row of a key outside its row's encoder range (or a strict pad) is 0. `raw` /
    `encoder_keys` `(B, >= M)` are 0 / 1 masks in the compute dtype (None: every key counts). The tensors are views
    of buffers taken from `workspace` (`encoder_scratch_numel` elements), rewritten for the next block."""
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
        if raw is not None:
            keys_m.mul_(raw[:, None, None, start:end])
        values_m[..., :value_dim].copy_(v_enc[:, start:end].transpose(1, 2))
        values_m[..., value_dim] = 1.0
        if encoder_keys is not None:
            values_m.mul_(encoder_keys[:, None, start:end, None])
        taylor.features(keys_m, key=True, out=phi_m)
        yield start, end, keys_m, values_m, phi_m


def add_encoder_in_place(
    running: torch.Tensor,
    k_enc: torch.Tensor,
    v_enc: torch.Tensor,
    raw: torch.Tensor | None,
    encoder_keys: torch.Tensor | None,
    taylor: CompactTaylor,
    workspace: Workspace,
    block: int,
) -> None:
    """running `(B H, F', V + 1)` += phi(K_enc)^T [V_enc, 1] over each row's encoder range, one product per block of
    `encoder_blocks` (the encoder has no causal structure)."""
    for _, _, _, values, phi in encoder_blocks(k_enc, v_enc, raw, encoder_keys, taylor, workspace, block):
        running.baddbmm_(phi.flatten(0, 1), values.flatten(0, 1))


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


def full_state(
    compact: torch.Tensor, residual: torch.Tensor | None, taylor: CompactTaylor, decay: torch.Tensor | None,
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
