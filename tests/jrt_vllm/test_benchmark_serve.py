"""benchmarks/serve.py serves both models with vLLM end to end (`--quick`) and writes its table and JSON (no timing
asserts)."""

from __future__ import annotations

import json

import pytest

import vllm_models  # noqa: F401  (vLLM's CPU settings, set before vLLM is imported)

pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")


def test_serve_benchmark_quick(load_benchmark, tmp_path, capsys):
    """Both engines stay up and take turns (`--rounds` timed batches each); the ratios are the medians of the rounds'
    ratios, each model's figures its median round's."""
    output = tmp_path / "serve.json"
    load_benchmark("serve").main(["--quick", "--rounds", "3", "--json", str(output)])
    table = capsys.readouterr().out
    assert "| jrt / llama |" in table and "median of 3 alternating rounds" in table
    result = json.loads(output.read_text())
    assert set(result["results"]) == {"jrt", "llama"}
    for row in result["results"].values():
        assert len(row["rounds"]) == 3
        assert row["requests_per_s"] == sorted(r["requests_per_s"] for r in row["rounds"])[1] > 0
        assert row["generated_tokens_per_s"] == pytest.approx(row["requests_per_s"] * result["args"]["new_tokens"])
    paired = sorted(
        jrt["requests_per_s"] / llama["requests_per_s"]
        for jrt, llama in zip(result["results"]["jrt"]["rounds"], result["results"]["llama"]["rounds"])
    )
    assert result["jrt_over_llama"]["requests_per_s"] == pytest.approx(paired[1])


def test_serve_benchmark_rejects_no_rounds(load_benchmark, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("serve").parse_args(["--rounds", "0"])
    assert "--rounds must be at least 1; got 0" in capsys.readouterr().err


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
