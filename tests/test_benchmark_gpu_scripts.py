"""The scripts `benchmarks/gpu_check.sh` runs on a GPU machine, run here on the CPU with tiny shapes (no timing
asserts): benchmarks/decode.py and benchmarks/gpu_model_check.py."""

from __future__ import annotations

import re

import pytest


def test_decode_benchmark_keeps_jrt_state_flat(load_benchmark, capsys):
    """Two lengths, two sequences, bf16: JRT-RNN's cache is the same size at both, Llama's grows with N."""
    decode = load_benchmark("decode")
    decode.main([
        "--lengths", "40", "80", "--hidden-size", "32", "--layers", "3", "--heads", "2", "--vocab-size", "64",
        "--sliding-window", "5", "--steps", "2", "--batch", "2", "--dtype", "bfloat16",
    ])
    output = capsys.readouterr().out
    assert "bfloat16 on cpu, batch 2" in output
    rows = [line.split("|") for line in output.splitlines() if re.match(r"\s+\d+ \|", line)]
    assert [int(row[0]) for row in rows] == [40, 80]
    jrt_mib, llama_mib = ([float(row[2].split()[column]) for row in rows] for column in (0, 1))
    assert jrt_mib[0] == jrt_mib[1] > 0
    assert llama_mib[1] > llama_mib[0] > 0


@pytest.fixture(scope="module")
def gpu_model_check(load_benchmark):
    return load_benchmark("gpu_model_check")


def test_gpu_model_check_passes_on_identical_paths(gpu_model_check, capsys):
    """On the CPU with the chunked path on both sides the model checks give zero differences and pass."""
    assert gpu_model_check.main(["--device", "cpu", "--impl", "chunked", "--kinds", "jrt-pad"]) == 0
    output = capsys.readouterr().out
    assert re.search(r"jrt-pad\s+\|\s+0\.00e\+00 \|\s+96/96 tokens equal \|\s+0\.00e\+00 \|", output)
    assert "decode step at slots, graph replay vs eager, max |diff|: chunked 0.00e+00" in output
    assert output.rstrip().endswith("all checks passed")


def test_gpu_model_check_reports_a_failed_bound(gpu_model_check, monkeypatch, capsys):
    """A bound the run misses (bf16 at 1e-9: bf16 weights differ from fp32 by far more) fails the check: exit 1."""
    monkeypatch.setitem(gpu_model_check.TOLERANCE, "bf16", 1e-9)
    assert gpu_model_check.main(["--device", "cpu", "--impl", "chunked", "--kinds", "based-decay"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAILED: based-decay bf16")


def test_gpu_model_check_fails_when_a_kernel_fell_back(gpu_model_check, monkeypatch, capsys):
    """A backward kernel that failed under "auto" (logged once, then the PyTorch gradients) fails the check: the GPU
    side would have been the chunked path."""
    monkeypatch.setattr(gpu_model_check.linear_attention_module, "_backward_failure", "OutOfResources: shared memory")
    assert gpu_model_check.main(["--device", "cpu", "--impl", "chunked", "--kinds", "jrt-pad"]) == 1
    output = capsys.readouterr().out
    assert "the Triton backward kernel fell back to PyTorch: OutOfResources: shared memory" in output
    assert output.rstrip().endswith("FAILED: triton backward kernel fallback")
