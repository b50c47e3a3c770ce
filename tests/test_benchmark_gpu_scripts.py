"""The scripts `benchmarks/gpu_check.sh` runs on a GPU machine, run here on the CPU with tiny shapes (no timing
asserts): benchmarks/decode.py, benchmarks/launches.py and benchmarks/gpu_model_check.py."""

from __future__ import annotations

import json
import re

import pytest
import torch


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
    build = gpu_model_check.build

    def build_and_fail(*args, **kwargs):
        model = build(*args, **kwargs)
        model.model.kernels.failures["linear attention backward"] = "OutOfResources: shared memory"
        return model

    monkeypatch.setattr(gpu_model_check, "build", build_and_fail)
    assert gpu_model_check.main(["--device", "cpu", "--impl", "chunked", "--kinds", "jrt-pad"]) == 1
    output = capsys.readouterr().out
    assert "the Triton linear attention backward kernel fell back to PyTorch: OutOfResources: shared memory" in output
    assert output.rstrip().endswith("FAILED: triton linear attention backward fallback")


def test_launch_counts_are_printed_side_by_side(load_benchmark, capsys, tmp_path):
    """benchmarks/launches.py --quick: the dispatched ops of a decode step and of two prefills, both models; the
    JSON holds the printed counts."""
    launches = load_benchmark("launches")
    report = launches.main(["--quick", "--json", str(tmp_path / "launches.json")])
    output = capsys.readouterr().out
    rows = {line[:22].strip(): line[22:].split() for line in output.splitlines()[2:]}
    assert set(rows) == {"decode step (B=2)", "prefill (B=1)", "prefill (B=2)"}
    counts = report["counts"]
    assert rows["decode step (B=2)"][:2] == [str(counts["jrt"]["decode"]), str(counts["llama"]["decode"])]
    assert all(count > 20 for model in counts.values() for count in model.values())
    assert json.loads((tmp_path / "launches.json").read_text())["counts"] == counts


def test_the_dispatch_counter_counts_the_gpu_code_path(load_benchmark):
    """Views launch nothing and are not counted; on the GPU's code path the linear attention's prefill is one launch
    (the fused kernel), not the CPU scan's ops."""
    launches = load_benchmark("launches")
    counter = launches.DispatchCounter()
    x = torch.randn(4, 6)
    with counter:
        (x.view(6, 4).t() + 1).sum()
    assert counter.total == 2 and set(counter.ops) == {"aten.add.Tensor", "aten.sum.default"}
    from modeling_jrt import modeling_jrt as model_module

    counter = launches.DispatchCounter()
    q, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 3)
    with launches.gpu_code_path(counter), counter:
        model_module.prefix_linear_attention(q, q, v)
    assert counter.total == 1


@pytest.mark.slow
def test_decode_benchmark_times_generate_on_both_paths(load_benchmark, capsys):
    """--generate: per-token times of each model's default and static (compiled) generate(), and the three ratios."""
    decode = load_benchmark("decode")
    decode.main([
        "--lengths", "24", "--hidden-size", "32", "--layers", "2", "--heads", "2", "--vocab-size", "64",
        "--sliding-window", "5", "--steps", "2", "--generate",
    ])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+ \|", line)]
    assert len(rows) == 1 and len(rows[0][1].split()) == 4 and len(rows[0][2].split()) == 3
    assert all(float(value) > 0 for value in rows[0][1].split()[:4] + rows[0][2].split())


def test_the_gpu_script_fits_eight_minutes_step_by_step():
    """benchmarks/gpu_check.sh: valid bash, every step under its own `timeout`, the limits (the optional ptxas step
    aside) adding up to at most 8 minutes."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    default_run = text[: text.index("JRT_GPU_CHECK_PTXAS:-0")]
    limits = [int(seconds) for seconds in re.findall(r"timeout (\d+) ", default_run)]
    loops = re.findall(r"for batch in ([\d ]+); do", default_run)
    assert len(limits) == 11 and loops == ["1 8"]
    model_prefill = int(re.search(r"timeout (\d+) \"\$python\" benchmarks/model_prefill.py", default_run).group(1))
    assert sum(limits) + model_prefill <= 480, limits
    for script_name in ("decode.py", "launches.py", "model_prefill.py", "prefill.py", "gpu_model_check.py",
                        "train_step.py", "serve.py"):
        assert f"benchmarks/{script_name}" in default_run


def test_training_step_throughput_of_both_models(load_benchmark, capsys):
    """benchmarks/train_step.py --quick: tokens/s of a full training step of each model, and their ratio."""
    train_step = load_benchmark("train_step")
    results = train_step.main(["--quick"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+ \|", line)]
    assert [int(row[0]) for row in rows] == list(results) == [128]
    jrt, llama, ratio = (float(value) for value in rows[0][1].split())
    assert jrt > 0 and llama > 0 and ratio == pytest.approx(jrt / llama, rel=0.02)
