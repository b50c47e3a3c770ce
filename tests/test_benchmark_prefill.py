"""benchmarks/prefill.py runs end to end on tiny shapes and writes its table and JSON (no timing asserts)."""

from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.fixture(scope="module")
def prefill_benchmark(load_benchmark):
    return load_benchmark("prefill")


NO_TRITON = importlib.util.find_spec("triton") is None


@pytest.mark.parametrize(
    "impl",
    ["chunked", pytest.param("triton", marks=pytest.mark.skipif(NO_TRITON, reason="triton is not installed"))],
)  # triton: interpreted on CPU (tests/conftest.py)
def test_prefill_benchmark_writes_rows(prefill_benchmark, tmp_path, capsys, impl):
    output = tmp_path / "prefill.json"
    prefill_benchmark.main([
        "--device", "cpu", "--impl", impl, "--seq-lens", "32", "64", "--heads", "2", "--head-dim", "16",
        "--repeats", "1", "--warmup", "0", "--peak-tflops", "1", "--peak-gbps", "10", "--json", str(output),
    ])
    table = capsys.readouterr().out
    assert "| sdpa/ours |" in table and "| 1 | 64 | 32 |" in table
    result = json.loads(output.read_text())
    rows = result["rows"]
    assert [(row["B"], row["T"], row["M"]) for row in rows] == [(1, 32, 16), (1, 64, 32)]
    for row in rows:
        assert row["ours_impl"] == impl
        assert row["ours"] > 0 and row["sdpa"] > 0 and row["quadratic"] > 0
        assert row["sdpa_over_ours"] == pytest.approx(row["sdpa"] / row["ours"])
        assert 0 < row["ours_pct_floor"]
    assert rows[1]["growth"] == pytest.approx(rows[1]["ours"] / rows[0]["ours"])
    assert result["environment"]["dtype"] == "float32"


def test_flop_model_matches_kernels_md(prefill_benchmark):
    """The FLOP model: about 80.8k FLOP per decoder token and 35.2k per encoder token at K=16, V=64, C=64."""
    decoder = prefill_benchmark.pla_flops(1, 0, 16, 64)
    encoder = prefill_benchmark.pla_flops(0, 1, 16, 64)
    assert decoder == pytest.approx(80.8e3, rel=0.01)
    assert encoder == pytest.approx(35.2e3, rel=0.01)


def test_prefill_benchmark_forward_backward_and_train_step(prefill_benchmark, tmp_path, capsys):
    """--backward adds the forward+backward columns; --train-step times a (quick, tiny) training step."""
    output = tmp_path / "prefill.json"
    prefill_benchmark.main([
        "--device", "cpu", "--impl", "chunked", "--seq-lens", "32", "--heads", "2", "--head-dim", "16",
        "--repeats", "1", "--warmup", "0", "--no-quadratic", "--backward", "--train-step",
        "--train-length", "32", "--train-batch", "2", "--json", str(output),
    ])
    table = capsys.readouterr().out
    assert "| ours fwd+bwd ms |" in table and "sdpa/ours fwd+bwd" in table
    result = json.loads(output.read_text())
    row = result["rows"][0]
    assert row["ours_fb"] > 0 and row["sdpa_fb"] > 0
    assert row["sdpa_fb_over_ours_fb"] == pytest.approx(row["sdpa_fb"] / row["ours_fb"])
    (train,) = result["train_steps"]
    assert train["implementation"] == "chunked" and train["tokens_per_s"] > 0
