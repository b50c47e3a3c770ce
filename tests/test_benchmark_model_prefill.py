"""benchmarks/model_prefill.py runs end to end on a tiny model, a fresh worker process per point (no timing asserts)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def model_prefill(load_benchmark):
    return load_benchmark("model_prefill")


@pytest.mark.slow  # three worker processes, each importing transformers
def test_model_prefill_benchmark_writes_its_table(model_prefill, tmp_path, capsys):
    output = tmp_path / "model_prefill.json"
    model_prefill.main([
        "--device", "cpu", "--lengths", "64", "128", "--llama-max-length", "64", "--hidden-size", "32",
        "--layers", "3", "--heads", "2", "--vocab-size", "64", "--sliding-window", "5", "--prefix-length", "16",
        "--repeats", "1", "--json", str(output),
    ])
    table = capsys.readouterr().out
    assert "| N | JRT ms | Llama ms | Llama/JRT |" in table
    result = json.loads(output.read_text())
    assert result["lengths"] == [64, 128] and result["environment"]["threads"] == 1
    jrt, llama = result["jrt"], result["llama"]
    assert all(point["ms"] > 0 and point["peak_mib"] >= 0 for point in jrt)
    assert llama[0]["ms"] > 0 and llama[1] is None  # Llama stops at --llama-max-length
    ratio = f"{llama[0]['ms'] / jrt[0]['ms']:.2f}x"
    growth = f"{jrt[1]['ms'] / jrt[0]['ms']:.2f}"
    assert f"| 64 | {jrt[0]['ms']:.0f} | {llama[0]['ms']:.0f} | {ratio} | - |" in table
    assert f"| 128 | {jrt[1]['ms']:.0f} | - | - | {growth} |" in table


def test_model_prefill_models_have_the_same_size(model_prefill):
    args = model_prefill.parse_args(["--hidden-size", "32", "--layers", "3", "--heads", "2", "--vocab-size", "64"])
    jrt, llama = model_prefill.build_model("jrt", args), model_prefill.build_model("llama", args)
    assert jrt.config.mixer_types == ["conv", "linear_attention", "sliding_attention"]
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        assert getattr(jrt.config, field) == getattr(llama.config, field), field
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        model_prefill.build_model("gpt", args)


@pytest.mark.slow  # one worker process, importing transformers
def test_model_prefill_profile_prints_the_share_per_module_type(model_prefill, tmp_path, capsys):
    output = tmp_path / "profile.json"
    model_prefill.main([
        "--device", "cpu", "--profile", "96", "--hidden-size", "32", "--layers", "3", "--heads", "2",
        "--vocab-size", "64", "--sliding-window", "5", "--prefix-length", "16", "--json", str(output),
    ])
    table = capsys.readouterr().out
    profile = json.loads(output.read_text())["profile"]
    rows = ("linear attention", "sliding window", "MLP", "short conv", "RMSNorm", "other")
    assert profile["length"] == 96 and set(profile["ms"]) == set(rows)
    assert all(ms >= 0 for ms in profile["ms"].values()) and profile["total_ms"] > 0
    # "other" is the rest of the forward (clipped at 0): the rows add up to at least the total
    assert sum(profile["ms"].values()) >= profile["total_ms"] - 1e-6
    assert "JRT-RNN prefill of 96 tokens" in table and "| module type | ms | share |" in table
    for row in rows:
        assert f"| {row} |" in table
