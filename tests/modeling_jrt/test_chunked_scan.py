"""The chunked scan (`modeling_jrt/chunked_scan.py`) beyond the oracle tests of test_linear_attention.py: feature dims
other than 4, the eps folded into the state's read, autocast, and the huge-page advice on large outputs."""

from __future__ import annotations

import pytest
import torch

import modeling_jrt.chunked_scan as chunked_scan
import modeling_jrt.huge_pages as huge_pages
from modeling_jrt.linear_attention import (
    prefix_linear_attention_chunked,
    prefix_linear_attention_quadratic,
)


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
    monkeypatch.setattr(huge_pages, "libc_madvise", lambda: lambda start, length, advice: calls.append((start, length)))
    monkeypatch.setattr(huge_pages, "HUGE_PAGE_MIN_BYTES", 8 << 20)
    small = torch.empty(1 << 20)  # 4 MiB
    huge_pages.advise_huge_pages(small)
    assert calls == []
    large = torch.empty(3 << 20)  # 12 MiB
    huge_pages.advise_huge_pages(large)
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
