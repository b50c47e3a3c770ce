"""benchmarks/convert.py builds a checkpoint with the released keys, converts it in a fresh process and reports the
peak RSS against the checkpoint's size (run here at a tiny size; no timing or memory asserts)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def convert_benchmark(load_benchmark):
    return load_benchmark("convert")


@pytest.mark.parametrize(
    "checkpoint, extra", [("JRT-360M-30B", []), ("based-360M-30B", []), ("JRT-360M-30B", ["--legacy"])],
    ids=["jrt", "based-decay", "jrt-legacy-pickle"],
)
def test_convert_benchmark_reports_peak_rss(convert_benchmark, tmp_path, capsys, checkpoint, extra):
    output = tmp_path / "convert.json"
    result = convert_benchmark.main([
        "--checkpoint", checkpoint, "--layers", "4", "--hidden", "64", "--vocab", "257", "--workdir", str(tmp_path),
        "--json", str(output), *extra,
    ])
    assert result["legacy"] is bool(extra)
    printed = capsys.readouterr().out
    assert "peak RSS" in printed and "x the checkpoint" in printed and "conversion time" in printed
    assert json.loads(output.read_text()) == result
    assert result["checkpoint"] == checkpoint and result["parameters"] > 0
    assert result["peak_over_checkpoint"] == pytest.approx(result["peak_rss_bytes"] / result["checkpoint_bytes"])
    assert result["peak_rss_bytes"] >= result["import_rss_bytes"] > 0 and result["output_bytes"] > 0
    assert list(tmp_path.iterdir()) == [output]  # the built checkpoint and its conversion are removed


def test_full_size_shapes_match_the_released_checkpoint(convert_benchmark):
    """JRT-360M-30B: 227 keys with lm_head (plus one metric counter), 356.6 M parameters (tied counted once)."""
    preset = convert_benchmark.PRESETS["JRT-360M-30B"]
    config = convert_benchmark.reference_config(preset, vocab=50257)
    shapes = convert_benchmark.reference_shapes(config, preset)
    assert len(shapes) == 227 + 1
    assert shapes["model.transformer.layers.1.mixer.proj_k_enc.weight"] == (256, 1024)
    assert shapes["model.transformer.layers.2.mixer.Wqkv.weight"] == (3072, 1024)
    unique = sum(math_prod(s) for k, s in shapes.items() if k != "model.lm_head.weight" and "metrics" not in k)
    assert unique == 356_578_304


def math_prod(shape):
    result = 1
    for size in shape:
        result *= size
    return result
