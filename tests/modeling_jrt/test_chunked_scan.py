"""The pieces of the chunked scan (`modeling_jrt/chunked_scan.py`): the compact Taylor features in their cyclic pair
order, the eps folded into the state's read, and the huge-page advice on large outputs."""

from __future__ import annotations

import pytest
import torch

import modeling_jrt.chunked_scan as chunked_scan
from modeling_jrt.chunked_scan import CompactTaylor
from modeling_jrt.linear_attention import prefix_linear_attention_chunked, prefix_linear_attention_quadratic

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


@pytest.mark.parametrize("feature_dim", [1, 2, 3, 5, 8])
def test_chunked_scan_matches_oracle_for_other_feature_dims(feature_dim):
    """The whole chunked prefill against the oracle for feature dims other than the tests' usual 4, with and without
    autograd, a prefix and a key mask."""
    torch.manual_seed(feature_dim)
    batch, seq_len, heads, value_dim, encoder_length = 2, 19, 2, 3, 6
    q, k = (torch.randn(batch, seq_len, heads, feature_dim, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, seq_len, heads, value_dim, dtype=torch.float64)
    k_enc = torch.randn(batch, encoder_length, heads, feature_dim, dtype=torch.float64)
    v_enc = torch.randn(batch, encoder_length, heads, value_dim, dtype=torch.float64)
    key_mask = torch.ones(batch, seq_len, dtype=torch.bool)
    key_mask[1, :3] = False
    expected, expected_state = prefix_linear_attention_quadratic(q, k, v, k_enc, v_enc, key_mask=key_mask)
    for differentiable in (False, True):
        inputs = [t.clone().requires_grad_(differentiable) for t in (q, k, v, k_enc, v_enc)]
        actual, state = prefix_linear_attention_chunked(*inputs, key_mask=key_mask, chunk_size=4)
        torch.testing.assert_close(actual[key_mask], expected[key_mask], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state, expected_state, rtol=1e-10, atol=1e-10)


def test_eps_reaches_every_denominator_but_not_the_state():
    """The scan adds eps to the denominators through the state's constant row: with a large eps the outputs still
    match the oracle's `numerator / (denominator + eps)` (a query with no key at all gives 0), and the returned state
    holds the sums alone; in fp64 without autograd and with it."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 11, 2, 4, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 11, 2, 3, dtype=torch.float64)
    key_mask = torch.ones(2, 11, dtype=torch.bool)
    key_mask[0, :5] = False  # the first queries of row 0 have no key
    for eps in (1e-12, 0.25):
        expected, expected_state = prefix_linear_attention_quadratic(q, k, v, key_mask=key_mask, eps=eps)
        for differentiable in (False, True):
            inputs = [t.clone().requires_grad_(differentiable) for t in (q, k, v)]
            actual, state = prefix_linear_attention_chunked(*inputs, key_mask=key_mask, eps=eps, chunk_size=4)
            torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(state, expected_state, rtol=1e-12, atol=1e-12)
    assert expected[0, :4].abs().max() == 0  # no key before the first kept one: 0 / eps


def test_huge_page_advice_covers_only_large_outputs(monkeypatch):
    """`advise_huge_pages` advises the 2 MiB-aligned part of a CPU tensor of at least `HUGE_PAGE_MIN_BYTES`, and
    nothing for a smaller one; the scan's output gets it and keeps its values."""
    calls = []
    monkeypatch.setattr(chunked_scan, "_madvise", lambda: lambda start, length, advice: calls.append((start, length)))
    monkeypatch.setattr(chunked_scan, "HUGE_PAGE_MIN_BYTES", 8 << 20)
    small = torch.empty(1 << 20)  # 4 MiB
    chunked_scan.advise_huge_pages(small)
    assert calls == []
    large = torch.empty(3 << 20)  # 12 MiB
    chunked_scan.advise_huge_pages(large)
    (start, length), = calls
    storage = large.untyped_storage()
    assert start % (2 << 20) == 0 and length % (2 << 20) == 0 and length >= 8 << 20
    assert storage.data_ptr() <= start and start + length <= storage.data_ptr() + storage.nbytes()

    advised = []
    monkeypatch.setattr(chunked_scan, "advise_huge_pages", lambda tensor: advised.append(tensor))
    q, k = torch.randn(1, 40, 2, 4), torch.randn(1, 40, 2, 4)
    v = torch.randn(1, 40, 2, 3)
    with torch.no_grad():
        output, _ = prefix_linear_attention_chunked(q, k, v)
    expected, _ = prefix_linear_attention_quadratic(q, k, v)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    assert [tensor.data_ptr() for tensor in advised] == [output.data_ptr()]  # the output, before it is written


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


def test_scans_compute_in_their_dtype_under_autocast():
    """A bf16 autocast region around the chunked path (lm-eval's `mixed_precision_dtype`, an autocast training step)
    changes nothing in it: the scan and its explicit backward give the fp32 results (an autocast product in the scan
    used to fail with mixed dtypes)."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 45, 2, 4) for _ in range(2))
    v = torch.randn(2, 45, 2, 3)
    k_enc, v_enc = torch.randn(2, 9, 2, 4), torch.randn(2, 9, 2, 3)
    results = []
    for autocast in (False, True):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, k_enc, v_enc)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                inference = prefix_linear_attention_chunked(*inputs)
            output, state = prefix_linear_attention_chunked(*inputs)
        gradients = torch.autograd.grad(output.square().sum() + state.sum(), inputs)
        results.append([*inference, output, state, *gradients])
    for with_autocast, without in zip(results[1], results[0]):
        assert with_autocast.dtype == torch.float32
        torch.testing.assert_close(with_autocast, without, rtol=0, atol=0)
