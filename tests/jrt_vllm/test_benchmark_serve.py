"""benchmarks/serve.py serves both models with vLLM end to end (`--quick`) and writes its table and JSON (no timing
asserts)."""

from __future__ import annotations

import json

import pytest

import vllm_models  # noqa: F401  (vLLM's CPU settings, set before vLLM is imported)

pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")


def test_serve_benchmark_quick(load_benchmark, tmp_path, capsys):
    output = tmp_path / "serve.json"
    load_benchmark("serve").main(["--quick", "--json", str(output)])
    table = capsys.readouterr().out
    assert "| jrt / llama |" in table
    result = json.loads(output.read_text())
    assert set(result["results"]) == {"jrt", "llama"}
    for row in result["results"].values():
        assert row["requests_per_s"] > 0 and row["generated_tokens_per_s"] > 0
        assert row["generated_tokens_per_s"] == pytest.approx(row["requests_per_s"] * result["args"]["new_tokens"])
    assert result["jrt_over_llama"]["requests_per_s"] == pytest.approx(
        result["results"]["jrt"]["requests_per_s"] / result["results"]["llama"]["requests_per_s"]
    )


def test_serve_benchmark_table(load_benchmark, tmp_path, capsys, monkeypatch):
    """`--table` runs each row (here two tiny ones) and prints one line of ratios per row."""
    serve = load_benchmark("serve")
    monkeypatch.setattr(serve, "TABLE_ROWS", [("float32", 32, 8), ("bfloat16", 32, 8)])
    output = tmp_path / "table.json"
    serve.main(["--table", "--quick", "--json", str(output)])
    printed = capsys.readouterr().out
    assert "| dtype | prompt | new | JRT req/s | Llama req/s | JRT / Llama |" in printed
    rows = json.loads(output.read_text())["rows"]
    assert [row["args"]["dtype"] for row in rows] == ["float32", "bfloat16"]
    for row in rows:
        ratio = row["jrt_over_llama"]["requests_per_s"]
        assert f"| {row['args']['dtype']} | 32 | 8 |" in printed and f"{ratio:.2f}x |" in printed
