"""The chunked scan of prefix linear attention in PyTorch: O(T) time, O(block x state) working memory.

What `prefix_linear_attention_chunked` runs on validated inputs: the inter-chunk read `phi(Q_c) @ state`, the
intra-chunk weights `tril(1 + s + s**2 / 2)` from the raw q and k, the state update, one division (docs/prefill.md
§4.2, with the layout, the denominator's quadratic form and the decay).

The features are those of `CompactTaylor`. `scan_in_place` keeps the numerator columns `state[:, :V]` apart from
the denominator column, so the numerator products are V wide, not V + 1 (an odd column costs a vector tail in every
GEMM), and carries the denominator as a quadratic form of [1, x'] (`CompactTaylor.form`). It reads and returns the
compact state (`full_state` maps it back to the cache layout); it is every CPU prefill and the forward of the op of
`chunked_scan_autograd.py`, whose backward uses the helpers here too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

from .compact_taylor import CompactTaylor
from .huge_pages import advise_huge_pages

# Token-heads per block of the scans: a block's scratch stays within a few MiB, whatever T is.
BLOCK_TOKEN_HEADS = 8192
ENCODER_BLOCK_TOKEN_HEADS = 8192


def block_sizes(num_chunks: int, chunk_size: int, encoder_length: int, token_heads: int) -> tuple[int, int]:
    """`(chunks per decoder block, tokens per encoder block)` of every scan, forward and backward, from
    `BLOCK_TOKEN_HEADS` / `ENCODER_BLOCK_TOKEN_HEADS` as they are at call time."""
    block = min(num_chunks, max(1, BLOCK_TOKEN_HEADS // (token_heads * chunk_size)))
    return block, max(1, min(encoder_length, ENCODER_BLOCK_TOKEN_HEADS // token_heads))


def decay_factors(decay: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """`(log_gamma (H, 1, 1), position (C,), intra-chunk gamma**(i - j) masked to i >= j (H, C, C), read decay
    gamma**(i + 1) (H, C, 1))` of the decayed scans, from `decay` = log gamma `(H,)`."""
    position = torch.arange(chunk_size, device=decay.device, dtype=decay.dtype)
    log_gamma = decay[:, None, None]
    distance = position[:, None] - position[None, :]  # (C, C): i - j
    intra_decay = torch.exp(log_gamma * distance.clamp(min=0)).tril_()
    read_decay = torch.exp(log_gamma[..., 0] * (position + 1))[..., None]
    return log_gamma, position, intra_decay, read_decay


def copy_chunk_major(
    destination: torch.Tensor, source: torch.Tensor, *, position_last: bool, scale: float | None = None
) -> None:
    """Copy `source` `(B, L, H, D)` (times `scale`, in the same pass, when given) into the chunk-major `destination`
    `(n, B, H, D, C)` (`position_last`) or `(n, B, H, C, D)`, for L <= n C tokens; the positions past L (a last chunk
    that is not whole) are set to 0."""
    num_chunks, chunk_size = destination.shape[0], destination.shape[-1 if position_last else -2]
    batch_size, length, num_heads, dim = source.shape
    whole = length // chunk_size
    order = (1, 0, 3, 4, 2) if position_last else (1, 0, 3, 2, 4)

    def write(target: torch.Tensor, rows: torch.Tensor) -> None:
        target.copy_(rows) if scale is None else torch.mul(rows, scale, out=target)

    if whole:
        write(destination[:whole], source[:, : whole * chunk_size].view(
            batch_size, whole, chunk_size, num_heads, dim).permute(*order))
    if whole < num_chunks:
        destination[whole:].zero_()
        rest = length - whole * chunk_size
        if rest:
            last = destination[whole, ..., :rest] if position_last else destination[whole, ..., :rest, :]
            write(last, source[:, whole * chunk_size :].permute(0, 2, 3, 1) if position_last
                  else source[:, whole * chunk_size :].permute(0, 2, 1, 3))


class Workspace:
    """One allocation per call, handed out as views: the scratch tensors of `scan_in_place` (one block the allocator
    can hand to the next layer's call, not a dozen fresh multi-MiB mappings). `reset()` starts over at the beginning.
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


def without_autocast(function):
    """Run `function` with autocast off on the device of its first tensor argument: the scans compute in the dtype
    they are given, and an autocast region around a prefill would run some products in bf16 and mix dtypes."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        device = next(arg for arg in args if isinstance(arg, torch.Tensor)).device.type
        if not torch.is_autocast_enabled(device):
            return function(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return function(*args, **kwargs)

    return run


@without_autocast
def scan_in_place(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_enc: torch.Tensor | None,
    v_enc: torch.Tensor | None, *, raw: torch.Tensor | None, decoder_keys: torch.Tensor | None,
    encoder_keys: torch.Tensor | None, gate: torch.Tensor | None, decay: torch.Tensor | None, taylor: CompactTaylor,
    chunk_size: int, eps: float, denominators: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan without autograd (module docstring), organised for a CPU (docs/prefill.md §4.2, execution 1):
    blocks of about `BLOCK_TOKEN_HEADS` token-heads written `out=` views of one `Workspace`, the running numerator
    state `(B H, F', V)` read and updated chunk by chunk, the denominators from the form (`add_chunk_forms`).

    The Based decay (`decay`, log gamma per head) weighs the numerator only (docs/prefill.md §4.2, "Decay"). Memory:
    the inputs, the output and O(block) scratch.

    Args:
        state: `(B, H, F', V + 1)` compact state before the encoder and the first token.
        q, k, v: `(B, T, H, K / V)`; k_enc, v_enc: `(B, M, H, K / V)` or None.
        raw, decoder_keys, encoder_keys: the masks of `LinearAttentionInputs.key_masks` (None: every key counts).
        gate: `(B, T, H)` numerator gate, or None.
        decay: `(H,)` log gamma in the compute dtype, or None.
        denominators: a chunk-major `(N, B, H, C, 1)` tensor (N = ceil(T / C)) for each query's `denominator + eps`
            (for the backward of `chunked_scan_autograd.py`), or None.

    Returns:
        `(output (B, T, H, V) in the compute dtype, compact state after the last token (B, H, F', V + 1))`.
    """
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim, dtype = v.shape[-1], state.dtype
    num_features, token_heads, form_dim = taylor.num_features, batch_size * num_heads, feature_dim + 1
    num_chunks = -(-seq_len // chunk_size)
    block, encoder_block = block_sizes(num_chunks, chunk_size, 0 if k_enc is None else k_enc.shape[1], token_heads)
    # Per token-head of a block: v and the numerator (V each), the features of q and k (F' each), a row of (C, C)
    # weights, five single columns (denominator, its inter-chunk part, gate, raw and counted weights), the counted
    # [1, k'] rows and the form's read (K + 1 each); per chunk-head the chunk's form and the form before it.
    per_token_head = 2 * value_dim + 2 * num_features + chunk_size + 5 + 2 * form_dim
    decoder_numel = block * chunk_size * token_heads * per_token_head
    decoder_numel += block * token_heads * 2 * form_dim**2 + chunk_size * token_heads * value_dim
    encoder_numel = encoder_scratch_numel(encoder_block, token_heads, taylor)
    workspace = Workspace(max(decoder_numel, encoder_numel), q, dtype)
    # The running state: the numerator columns `(B H, F', V)` and the denominator's form `(B H, K + 1, K + 1)`.
    running = state[..., :value_dim].reshape(token_heads, num_features, value_dim).clone()
    form = taylor.form(state[..., value_dim].reshape(token_heads, num_features))
    # 0 / 1 weights in the compute dtype, or None when every key counts (no product by them)
    raw, decoder_keys, encoder_keys = (
        None if mask is None or bool(mask.all()) else mask.to(dtype) for mask in (raw, decoder_keys, encoder_keys)
    )

    # 1. Encoder reduction: running += phi(K_enc)^T V_enc and the form += its keys' [1, k'] Gram, over each row's range.
    if k_enc is not None:
        add_encoder_in_place(running.view(batch_size, num_heads, num_features, value_dim),
                             form.view(batch_size, num_heads, form_dim, form_dim), k_enc, v_enc, raw, encoder_keys,
                             taylor, workspace, encoder_block)

    # 2. Causal scan, in blocks of n chunks (the encoder's buffers are free again); eps is taken off at the end.
    form[:, 0, 0] += eps
    workspace.reset()
    shape = (block, batch_size, num_heads)
    values = workspace.take(*shape, chunk_size, value_dim)
    phi_q = workspace.take(*shape, num_features, chunk_size)
    phi_k = workspace.take(*shape, num_features, chunk_size)
    phi_q[..., 0, :] = 1.0  # the constant feature, the same in every block
    phi_k[..., 0, :] = 1.0
    weights = workspace.take(*shape, chunk_size, chunk_size)
    numerators = workspace.take(*shape, chunk_size, value_dim)
    denominator = workspace.take(*shape, chunk_size, 1)
    inter_denominator = workspace.take(*shape, 1, chunk_size)
    counted_keys = workspace.take(*shape, form_dim, chunk_size)  # [1, k'] of the keys that count
    form_read = workspace.take(*shape, form_dim, chunk_size)
    chunk_forms = workspace.take(block, token_heads, form_dim, form_dim)
    forms_before = workspace.take(block, token_heads, form_dim, form_dim)
    gates = None if gate is None else workspace.take(*shape, chunk_size, 1)
    raw_weights = None if raw is None else workspace.take(*shape, 1, chunk_size)  # 0 / 1 per raw key
    counted_weights = workspace.take(*shape, chunk_size, 1)  # 0 / 1 per v row (masks, padding)
    if decay is not None:
        log_gamma, position, intra_decay, read_decay = decay_factors(decay, chunk_size)
        whole_chunk_decays = chunk_decays(log_gamma, position, chunk_size)  # recomputed only for a shorter last one
        read = workspace.take(token_heads, chunk_size, value_dim)
    # The per-chunk operands of the state's read and update, (B H)-batched views, the same for every block.
    reads = [(numerators[c].flatten(0, 1), phi_q[c].flatten(0, 1).transpose(1, 2)) for c in range(block)]
    updates = [(phi_k[c].flatten(0, 1), values[c].flatten(0, 1)) for c in range(block)]
    output = q.new_empty(batch_size, seq_len, num_heads, value_dim, dtype=dtype)
    advise_huge_pages(output)
    for first in range(0, num_chunks, block):
        n = min(block, num_chunks - first)
        start, end = first * chunk_size, min((first + n) * chunk_size, seq_len)
        v_n, phi_q_n, phi_k_n = values[:n], phi_q[:n], phi_k[:n]
        w_n, o_n, den_n = weights[:n].flatten(0, 2), numerators[:n], denominator[:n]
        # q' and k' straight into the features' linear rows
        copy_chunk_major(phi_q_n[..., 1 : 1 + feature_dim, :], q[:, start:end], position_last=True, scale=taylor.scale)
        copy_chunk_major(phi_k_n[..., 1 : 1 + feature_dim, :], k[:, start:end], position_last=True, scale=taylor.scale)
        if raw_weights is not None:  # "reference": a masked raw key is 0 (phi(0) keeps weight 1)
            copy_chunk_major(raw_weights[:n], raw[:, start:end, None, None].expand(-1, -1, num_heads, 1),
                              position_last=True)
            phi_k_n[..., 1 : 1 + feature_dim, :].mul_(raw_weights[:n])
        copy_chunk_major(v_n, v[:, start:end], position_last=False)
        counted = None  # 0 / 1 per key of the block, (n, B, H, C, 1), when some key does not count
        if decoder_keys is not None or end - start < n * chunk_size:  # keys that do not count, padding of the chunks
            mask = v.new_ones(1, 1, 1, 1, dtype=dtype).expand(batch_size, end - start, num_heads, 1) \
                if decoder_keys is None else decoder_keys[:, start:end, None, None].expand(-1, -1, num_heads, 1)
            counted = counted_weights[:n]
            copy_chunk_major(counted, mask, position_last=False)  # zeros past the last token
            v_n.mul_(counted)
        taylor.features_in_place(phi_q_n, key=False, constant=False)
        taylor.features_in_place(phi_k_n, key=True, constant=False)
        # Intra-chunk: tril(1 + s + s**2 / 2) with s = q'.k' = q.k / sqrt(K). The features' first rows [1, x'] give
        # 1 + s in one product, and 1 + s + s**2 / 2 = (1 + (1 + s)**2) / 2.
        query_rows, key_rows = phi_q_n[..., :form_dim, :], phi_k_n[..., :form_dim, :]  # [1, x'] (n, B, H, K + 1, C)
        torch.bmm(query_rows.flatten(0, 2).transpose(1, 2), key_rows.flatten(0, 2), out=w_n)
        torch.addcmul(w_n.new_full((), 0.5), w_n, w_n, value=0.5, out=w_n).tril_()
        # Denominators: the intra-chunk weights' sums over the keys that count, plus [1, q'] F [1, q'].
        if counted is None:
            torch.sum(w_n, dim=-1, keepdim=True, out=den_n.flatten(0, 2))
            keys_counted = key_rows
        else:
            torch.bmm(w_n, counted.flatten(0, 2), out=den_n.flatten(0, 2))
            keys_counted = torch.mul(key_rows, counted.transpose(-1, -2), out=counted_keys[:n])
        taylor.add_chunk_forms(keys_counted.flatten(1, 2), key_rows.flatten(1, 2), form, chunk_forms[:n],
                               forms_before[:n])
        form_read_n = form_read[:n]  # F [1, q'] (n, B, H, K + 1, C), then times [1, q'] and summed over the K + 1
        torch.bmm(forms_before[:n].flatten(0, 1), query_rows.flatten(0, 2), out=form_read_n.flatten(0, 2))
        form_read_n.mul_(query_rows)
        torch.sum(form_read_n, dim=-2, keepdim=True, out=inter_denominator[:n])  # (n, B, H, 1, C)
        den_n.add_(inter_denominator[:n].transpose(-1, -2))
        if denominators is not None:
            denominators[first : first + n].copy_(den_n)
        if decay is not None:  # the numerator from gamma**(i - j) times the weights (the denominators are undecayed)
            weights[:n].mul_(intra_decay)
        torch.bmm(w_n, v_n.flatten(0, 2), out=o_n.flatten(0, 2))
        # Inter-chunk, chunk by chunk: read the state before the chunk, then add the chunk's keys to it.
        for c, ((read_out, read_features), (update_features, update_values)) in enumerate(zip(reads[:n], updates[:n])):
            if decay is None:
                read_out.baddbmm_(read_features, running)
            else:
                length = min(chunk_size, end - start - c * chunk_size)  # tokens in this chunk
                torch.bmm(read_features, running, out=read)
                read.view(batch_size, num_heads, chunk_size, value_dim).mul_(read_decay)
                read_out.add_(read)
                value_decay, state_decay = (
                    whole_chunk_decays if length == chunk_size else chunk_decays(log_gamma, position, length)
                )
                v_n[c].mul_(value_decay)
                running.view(batch_size, num_heads, num_features, value_dim).mul_(state_decay)
            running.baddbmm_(update_features, update_values)
        if gates is not None:
            copy_chunk_major(gates[:n], gate[:, start:end, :, None], position_last=False)
            o_n.mul_(gates[:n])
        _divide_into_rows(output[:, start:end], o_n, den_n)
    form[:, 0, 0] -= eps
    compact = torch.cat([running, taylor.form_to_compact(form)[..., None]], dim=-1)
    return output, compact.view(state.shape)


def chunk_decays(log_gamma: torch.Tensor, position: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decays over a chunk of `length` tokens (log_gamma `(H, 1, 1)`, position `(C,)`): each key's value to the
    chunk's end, gamma**(L - 1 - j) `(H, C, 1)`, and the state, gamma**L `(H, 1, 1)`."""
    return torch.exp(log_gamma * (length - 1 - position)[:, None]), torch.exp(log_gamma * length)


def encoder_scratch_numel(block: int, token_heads: int, taylor: CompactTaylor) -> int:
    """Elements of the `Workspace` that `encoder_blocks` takes its buffer from: the features of a block of `block`
    encoder tokens per token-head."""
    return block * token_heads * taylor.num_features


def encoder_blocks(
    k_enc: torch.Tensor, raw: torch.Tensor | None, taylor: CompactTaylor, workspace: Workspace, block: int
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """The encoder keys' operands, `block` tokens at a time: `(start, end, k' (B, H, K, m), phi(keys) (B, H, F', m))`
    for positions [start, end), k' = k / K**(1/4). A masked raw key is 0 ("reference"; `raw` `(B, >= M)` 0 / 1 or
    None); the features are not masked by range. Views of one `workspace` buffer, rewritten for the next block."""
    batch_size, encoder_length, num_heads, feature_dim = k_enc.shape
    phi = workspace.take(batch_size, num_heads, taylor.num_features, block)
    for start in range(0, encoder_length, block):
        end = min(start + block, encoder_length)
        phi_m = phi[..., : end - start]
        scaled = phi_m[..., 1 : 1 + feature_dim, :]
        torch.mul(k_enc[:, start:end].permute(0, 2, 3, 1), taylor.scale, out=scaled)
        if raw is not None:
            scaled.mul_(raw[:, None, None, start:end])
        taylor.features_in_place(phi_m, key=True)
        yield start, end, scaled, phi_m


def add_encoder_in_place(
    numerator: torch.Tensor, form: torch.Tensor, k_enc: torch.Tensor, v_enc: torch.Tensor, raw: torch.Tensor | None,
    encoder_keys: torch.Tensor | None, taylor: CompactTaylor, workspace: Workspace, block: int,
) -> None:
    """Add the encoder keys over each row's range (`encoder_keys` `(B, >= M)` 0 / 1, or None: every key) to a state:
    `numerator` `(B, H, F', V)` += phi(K_enc)^T V_enc (v_enc read in place, one product per row), and the
    denominator's `form` `(B, H, K + 1, K + 1)` += the keys' `key_form`, a block of `encoder_blocks` at a time."""
    form_dim = taylor.feature_dim + 1
    v_enc = v_enc.to(numerator.dtype)  # no copy in the compute dtype
    for start, end, _, phi in encoder_blocks(k_enc, raw, taylor, workspace, block):
        if encoder_keys is not None:
            phi.mul_(encoder_keys[:, None, None, start:end])
        for row in range(numerator.shape[0]):  # (H, F', m) @ (H, m, V)
            numerator[row].baddbmm_(phi[row], v_enc[row, start:end].transpose(0, 1))
        rows = phi[..., :form_dim, :]  # [1, k'] of the keys that count, 0 for the others
        form += taylor.key_form(rows, rows)


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
