"""The 2nd-order Taylor feature map without duplicate products (`CompactTaylor`), the layout of the chunked scans."""

from __future__ import annotations

import functools
import math

import torch


class CompactTaylor:
    """The 2nd-order Taylor features without duplicates (docs/prefill.md §4.2, "Symmetric second order").

    x_i x_j = x_j x_i, so the K**2 ordered pairs hold only K (K + 1) / 2 distinct products. With x' = x / K**(1/4),
    the features have F' = 1 + 2 K + K (K - 1) / 2 rows (153 instead of 273 for K = 16):

        [1, x'_1 .. x'_K, x'_1**2 .. x'_K**2, the pairs x'_i x'_j (i != j) by cyclic distance (the doc's order)]

    For keys the squares carry a weight 1/2, so that phi(q).phi(k) = 1 + s + s**2 / 2 exactly. In the full layout the
    quadratic row (i, j) is x'_i x'_j / sqrt(2), so S_ii = sqrt(2) compact_ii and S_ij = S_ji = compact_ij / sqrt(2);
    `compress` maps back ((S_ij + S_ji) / sqrt(2)), exact for symmetric states (the caller keeps the rest aside).
    """

    def __init__(self, feature_dim: int, device: torch.device):
        K = feature_dim
        self.feature_dim = K
        self.scale = K**-0.25  # x' = x * scale
        self.full_distances = (K - 1) // 2  # distances with K pairs each
        self.half_distance = K // 2 if K % 2 == 0 and K > 1 else 0  # the distance K / 2 of an even K: K / 2 pairs
        index = torch.arange(K, device=device)
        first = [index.repeat(self.full_distances)]
        second = [(index[None, :] + torch.arange(1, self.full_distances + 1, device=device)[:, None]).flatten() % K]
        if self.half_distance:
            first.append(index[: self.half_distance])
            second.append(index[: self.half_distance] + self.half_distance)
        rows, cols = torch.cat(first), torch.cat(second)  # (K (K - 1) / 2,) each: the pairs in compact order
        self.pair_rows, self.pair_cols = rows, cols
        self.num_features = 1 + 2 * K + rows.numel()
        offset = 1 + K  # first quadratic row of the full layout
        # Full-layout row of each compact quadratic row (diagonal first, then the pairs) and of its mirror.
        self.upper = offset + torch.cat([index * (K + 1), rows * K + cols])
        self.lower = offset + torch.cat([index * (K + 1), cols * K + rows])
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
        written into `out` `(..., F', n)` (no autograd)."""
        torch.mul(x, self.scale, out=out[..., 1 : 1 + self.feature_dim, :])
        return self.features_in_place(out, key=key)

    def features_in_place(self, out: torch.Tensor, *, key: bool, constant: bool = True) -> torch.Tensor:
        """Complete the features in `out` `(..., F', n)`, whose rows 1 .. K hold x': the pairs, the squares, and the
        constant row unless `constant=False` (row 0 already 1), each row block one `out=` product. The shifted x' of
        the pairs are windows of rows 2 .., x' repeated first into the squares' rows (overwritten last)."""
        K, distances, half = self.feature_dim, self.full_distances, self.half_distance
        x_scaled = out[..., 1 : 1 + K, :]
        row = 1 + 2 * K
        if distances:
            out[..., 1 + K : 1 + K + distances, :].copy_(out[..., 1 : 1 + distances, :])  # x'_0 .. after x'_(K-1)
            # windows[d - 1] = rows 1 + d .. K + d: x' shifted by d, (..., distances, K, n)
            windows = out[..., 2 : 1 + K + distances, :].unfold(-2, K, 1).transpose(-1, -2)
            pairs = out[..., row : row + distances * K, :].unflatten(-2, (distances, K))
            torch.mul(windows, x_scaled.unsqueeze(-3), out=pairs)
            row += distances * K
        if half:
            torch.mul(x_scaled[..., :half, :], x_scaled[..., half:, :], out=out[..., row : row + half, :])
        if key:
            torch.addcmul(out.new_zeros(()), x_scaled, x_scaled, value=0.5, out=out[..., 1 + K : 1 + 2 * K, :])
        else:
            torch.mul(x_scaled, x_scaled, out=out[..., 1 + K : 1 + 2 * K, :])
        if constant:
            out[..., 0, :] = 1.0
        return out

    def features_backward(
        self, x: torch.Tensor, d_phi: torch.Tensor, *, key: bool, scaled: bool = False
    ) -> torch.Tensor:
        """The gradient `(..., K, n)` of x from that of its features `d_phi` `(..., F', n)`; `scaled`: x holds x'.

        d x'_a = d phi_(linear a) + 2 w x'_a d phi_(a, a) + sum_(b != a) x'_b d phi_(a, b), w the squares' weight; a
        pair (i, i + d) gives x'_(i + d) d phi to row i and x'_i d phi to row i + d (mod K), a few ops per distance.
        """
        K, half = self.feature_dim, self.half_distance
        scaled = x if scaled else x * self.scale
        squares = d_phi[..., 1 + K : 1 + 2 * K, :]
        d_scaled = torch.addcmul(d_phi[..., 1 : 1 + K, :], scaled, squares, value=1.0 if key else 2.0)
        row = 1 + 2 * K
        for d in range(1, self.full_distances + 1):
            block = d_phi[..., row : row + K, :]  # pairs (i, (i + d) mod K)
            shifted = torch.roll(scaled, -d, dims=-2)  # x'_(i + d)
            d_scaled.addcmul_(shifted, block)
            d_scaled.add_(torch.roll(scaled * block, d, dims=-2))
            row += K
        if half:
            block = d_phi[..., row : row + half, :]  # pairs (i, i + K / 2), i < K / 2
            d_scaled[..., :half, :].addcmul_(scaled[..., half:, :], block)
            d_scaled[..., half:, :].addcmul_(scaled[..., :half, :], block)
        return d_scaled.mul_(self.scale)

    @functools.cached_property
    def _form_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp64 `(F', (K + 1)**2)` and `((K + 1)**2, F')` matrices between a compact column and its `form`."""
        K, device = self.feature_dim, self.pair_rows.device
        index = torch.arange(K, device=device)
        zero = torch.zeros(1, dtype=torch.long, device=device)
        # The entry (a, b) of the form that each compact row's product x~_a x~_b is, x~ = [1, x'].
        a = torch.cat([zero, zero.expand(K), 1 + index, 1 + self.pair_rows])
        b = torch.cat([zero, 1 + index, 1 + index, 1 + self.pair_cols])
        rows = torch.arange(self.num_features, device=device)
        to_form = torch.zeros(self.num_features, (K + 1) ** 2, dtype=torch.float64, device=device)
        to_form.index_put_((rows, a * (K + 1) + b), torch.full_like(rows, 0.5, dtype=torch.float64), accumulate=True)
        to_form.index_put_((rows, b * (K + 1) + a), torch.full_like(rows, 0.5, dtype=torch.float64), accumulate=True)
        from_form = torch.zeros((K + 1) ** 2, self.num_features, dtype=torch.float64, device=device)
        from_form[a * (K + 1) + b, rows] = 1.0
        from_form[b * (K + 1) + a, rows] = 1.0
        return to_form, from_form

    def form(self, column: torch.Tensor) -> torch.Tensor:
        """(..., F') -> (..., K + 1, K + 1): the symmetric F with phi(x) . column = [1, x'] F [1, x'] for every x, a
        compact state column (the denominator's) as a quadratic form of the K + 1 numbers [1, x'] instead of F'."""
        to_form = self._form_maps[0].to(column.dtype)
        return (column @ to_form).unflatten(-1, (self.feature_dim + 1, self.feature_dim + 1))

    def form_to_compact(self, form: torch.Tensor) -> torch.Tensor:
        """(..., K + 1, K + 1) -> (..., F'): `form`'s inverse (exact for a symmetric form)."""
        return form.flatten(-2) @ self._form_maps[1].to(form.dtype)

    def key_form(self, counted_rows: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The form `(..., K + 1, K + 1)` of what keys add to the denominator column, from their [1, k'] `rows`
        `(..., K + 1, n)` and the same rows times 0 / 1 per key that counts, `counted_rows`. A key adds
        1 + s + s**2 / 2 = 1/2 + 1/2 ([1, q'] . [1, k'])**2 = [1, q'] F [1, q'] with F = 1/2 [1, k'] [1, k']^T +
        1/2 e0 e0^T: half the keys' Gram, its (0, 0) entry (the count of keys) whole.
        """
        gram = torch.matmul(counted_rows, rows.transpose(-1, -2), out=out)
        return gram.mul_(self._form_scale.to(gram.dtype))

    @functools.cached_property
    def _form_scale(self) -> torch.Tensor:
        """(K + 1, K + 1): 1/2, and 1 at (0, 0) (`key_form`)."""
        scale = torch.full((self.feature_dim + 1,) * 2, 0.5, device=self.pair_rows.device)
        scale[0, 0] = 1.0
        return scale

    def add_chunk_forms(
        self, counted_rows: torch.Tensor, rows: torch.Tensor, running: torch.Tensor, chunk_forms: torch.Tensor,
        before: torch.Tensor,
    ) -> None:
        """For a block of n chunks (`counted_rows`, `rows` `(n, B H, K + 1, C)` as in `key_form`): `before[c]` =
        the running form `(B H, K + 1, K + 1)` plus the forms of chunks 0 .. c - 1, and `running` += the forms of all
        n. `chunk_forms`, `before`: `(n, B H, K + 1, K + 1)` buffers."""
        n = chunk_forms.shape[0]
        self.key_form(counted_rows, rows, out=chunk_forms)
        earlier = torch.ones(n, n, dtype=running.dtype, device=running.device).tril_(-1)  # chunk c' < c
        torch.addmm(running.flatten()[None], earlier, chunk_forms.flatten(1), out=before.flatten(1))
        torch.add(before[-1], chunk_forms[-1], out=running)

    def compress(self, state: torch.Tensor) -> torch.Tensor:
        """(..., F, W) full state -> (..., F', W) compact state."""
        quadratic = state[..., self.upper, :] + state[..., self.lower, :] * (~self.is_diagonal)[:, None].to(state.dtype)
        quadratic = quadratic / math.sqrt(2.0)
        return torch.cat([state[..., : 1 + self.feature_dim, :], quadratic], dim=-2)

    def expand(self, compact: torch.Tensor) -> torch.Tensor:
        """(..., F', W) compact state -> (..., F, W) symmetric full state."""
        quadratic = compact[..., self.compact_of_full, :] * self.expand_factor[:, None].to(compact.dtype)
        return torch.cat([compact[..., : 1 + self.feature_dim, :], quadratic], dim=-2)
