"""The compact Taylor feature map (`modeling_jrt/compact_taylor.py`): its cyclic pair order against the definition, the
maps between its compact state and the full cache layout, the features' gradient, and the denominator's quadratic
form."""

from __future__ import annotations

import pytest
import torch

from modeling_jrt.compact_taylor import CompactTaylor

FEATURE_DIMS = [1, 2, 3, 4, 5, 8, 16, 17]


def reference_features(x: torch.Tensor, *, key: bool) -> torch.Tensor:
    """(..., K, n) -> (..., 1 + 2 K + K (K - 1) / 2, n), written pair by pair from the definition: [1, x', the
    squares (weight 1/2 for keys), x'_i x'_j for every i < j], x' = x / K**(1/4); rows in no particular order."""
    K = x.shape[-2]
    scaled = x * K**-0.25
    rows = [torch.ones_like(scaled[..., :1, :]), scaled, scaled * scaled * (0.5 if key else 1.0)]
    rows += [scaled[..., i : i + 1, :] * scaled[..., j : j + 1, :] for i in range(K) for j in range(i + 1, K)]
    return torch.cat(rows, dim=-2)


@pytest.mark.parametrize("feature_dim", FEATURE_DIMS)
def test_compact_features_are_the_distinct_products(feature_dim):
    """The features hold each distinct product once (the same multiset of rows as the definition), and the
    query-key dot products are 1 + s + s**2 / 2 with s = q.k / sqrt(K): odd and even K, K = 1 and 2 included."""
    taylor = CompactTaylor(feature_dim, torch.device("cpu"))
    assert taylor.num_features == 1 + 2 * feature_dim + feature_dim * (feature_dim - 1) // 2
    q, k = (torch.randn(2, 3, feature_dim, 7, dtype=torch.float64) for _ in range(2))
    for x, key in ((q, False), (k, True)):
        out = torch.empty(2, 3, taylor.num_features, 7, dtype=torch.float64)
        actual = taylor.features(x, key=key, out=out)
        assert actual is out
        expected = reference_features(x, key=key)
        torch.testing.assert_close(actual.sort(dim=-2).values, expected.sort(dim=-2).values, rtol=0, atol=1e-15)
    phi_q = taylor.features(q, key=False, out=torch.empty(2, 3, taylor.num_features, 7, dtype=torch.float64))
    phi_k = taylor.features(k, key=True, out=torch.empty(2, 3, taylor.num_features, 7, dtype=torch.float64))
    s = torch.einsum("bhfi,bhfj->bhij", q, k) / feature_dim**0.5
    torch.testing.assert_close(torch.einsum("bhfi,bhfj->bhij", phi_q, phi_k), 1 + s + s * s / 2)


@pytest.mark.parametrize("feature_dim", FEATURE_DIMS)
def test_compact_layout_maps_match_the_features(feature_dim):
    """`expand` puts each compact row where the full layout has its pair (the full features read the expanded state as
    the compact features read the compact one), and `compress` inverts it; `features_backward` is autograd's
    gradient of the features, from x or from x'."""
    taylor = CompactTaylor(feature_dim, torch.device("cpu"))
    K, n = feature_dim, 5
    x = torch.randn(2, K, n, dtype=torch.float64, requires_grad=True)
    compact = torch.randn(2, taylor.num_features, 3, dtype=torch.float64)
    scaled = x.detach() * K**-0.25
    # Full-layout query features [1, x', x' x'^T / sqrt(2)] (the cache layout of linear_attention.py).
    full = torch.cat([torch.ones(2, 1, n, dtype=torch.float64), scaled,
                      (scaled[:, :, None] * scaled[:, None]).flatten(1, 2) / 2**0.5], dim=1)
    phi = taylor.features(x.detach(), key=False, out=torch.empty(2, taylor.num_features, n, dtype=torch.float64))
    torch.testing.assert_close(full.transpose(1, 2) @ taylor.expand(compact), phi.transpose(1, 2) @ compact)
    torch.testing.assert_close(taylor.compress(taylor.expand(compact)), compact)
    d_phi = torch.randn(2, taylor.num_features, n, dtype=torch.float64)
    for key in (False, True):
        expected, = torch.autograd.grad((reference_like(taylor, x, key) * d_phi).sum(), x)
        torch.testing.assert_close(taylor.features_backward(x.detach(), d_phi, key=key), expected)
        torch.testing.assert_close(taylor.features_backward(scaled, d_phi, key=key, scaled=True), expected)


def reference_like(taylor: CompactTaylor, x: torch.Tensor, key: bool) -> torch.Tensor:
    """The compact features in `taylor`'s row order, differentiably: each compact row from its full-layout pair."""
    K = taylor.feature_dim
    scaled = x * K**-0.25
    offset = 1 + K
    first, second = (taylor.upper - offset) // K, (taylor.upper - offset) % K
    quadratic = scaled[..., first, :] * scaled[..., second, :]
    quadratic = torch.cat([quadratic[..., :K, :] * (0.5 if key else 1.0), quadratic[..., K:, :]], dim=-2)
    return torch.cat([torch.ones_like(scaled[..., :1, :]), scaled, quadratic], dim=-2)


@pytest.mark.parametrize("feature_dim", FEATURE_DIMS)
def test_denominator_form_reads_like_the_features(feature_dim):
    """The denominator column as a quadratic form of [1, x']: phi(q) . z = [1, q'] form(z) [1, q'] for any compact
    column z, `form_to_compact` inverts `form`, and the form of a set of keys (`key_form`, masked keys excluded)
    is what their features add to the denominator column: sum over counted keys of 1 + s + s**2 / 2."""
    taylor = CompactTaylor(feature_dim, torch.device("cpu"))
    K, n = feature_dim, 6
    column = torch.randn(3, taylor.num_features, dtype=torch.float64)
    q = torch.randn(3, K, n, dtype=torch.float64)
    phi_q = taylor.features(q, key=False, out=torch.empty(3, taylor.num_features, n, dtype=torch.float64))
    rows_q = phi_q[:, : K + 1]  # [1, q']
    form = taylor.form(column)
    assert form.shape == (3, K + 1, K + 1)
    torch.testing.assert_close(form, form.transpose(-1, -2))
    torch.testing.assert_close(torch.einsum("bfn,bf->bn", phi_q, column),
                               torch.einsum("zan,zab,zbn->zn", rows_q, form, rows_q))
    torch.testing.assert_close(taylor.form_to_compact(form), column)

    k = torch.randn(3, K, 9, dtype=torch.float64)
    counts = (torch.rand(3, 1, 9) > 0.3).to(torch.float64)
    phi_k = taylor.features(k, key=True, out=torch.empty(3, taylor.num_features, 9, dtype=torch.float64))
    rows_k = phi_k[:, : K + 1]
    key_form = taylor.key_form(rows_k * counts, rows_k)
    s = torch.einsum("bkn,bkm->bnm", q, k) / K**0.5  # (3, n queries, 9 keys)
    expected = ((1 + s + s * s / 2) * counts).sum(-1)
    torch.testing.assert_close(torch.einsum("zan,zab,zbn->zn", rows_q, key_form, rows_q), expected)
    torch.testing.assert_close(taylor.form_to_compact(key_form), (phi_k * counts).sum(-1))
