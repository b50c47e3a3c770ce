"""The training examples: train_jrt.py and finetune_lora.py run offline on tiny models, alone and under
`accelerate launch` with two CPU processes.

`accelerate launch --cpu --num_processes 2` starts a single process (accelerate's CPU launcher needs MPI for more),
so the two-process test uses `--multi_gpu`, which starts the processes with torchrun; the examples train on CPU
when there is no accelerator, and Trainer then joins the processes with gloo DDP."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["--max-steps", "2", "--batch-size", "2"]


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return lambda name: importlib.import_module(name)


def test_train_jrt_help(examples, capsys):
    with pytest.raises(SystemExit) as exit_info:
        examples("train_jrt").parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--max-steps" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["train_jrt", "finetune_lora"])
@pytest.mark.parametrize("argv, status", [(["--help"], 0), (["--output-dir", "out", "--max-steps", "abc"], 2)])
def test_examples_answer_help_and_usage_errors_before_importing_torch(tmp_path, script, argv, status):
    """`--help` used to import torch, transformers and the model first (about 7 s)."""
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{script!r}, *{argv!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'examples' / (script + '.py'))!r}, run_name='__main__')\n"
        "except SystemExit as exit_info:\n"
        "    print('status', exit_info.code, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == f"status {status} False", result.stdout + result.stderr
    if status:
        assert "--max-steps: invalid int value: 'abc'" in result.stderr


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("finetune_lora", ["--model", "converted/missing"], "--model converted/missing: no such folder"),
        ("finetune_lora", ["--text-file", "missing.txt"], "--text-file missing.txt: no such file"),
        ("finetune_lora", ["--dataset", "data/missing"], "--dataset data/missing: no such folder or file"),
        ("train_jrt", ["--train-file", "missing.txt"], "--train-file missing.txt: no such file"),
    ],
)
def test_examples_check_their_paths_before_anything_else(examples, tmp_path, monkeypatch, capsys, script, argv,
                                                         message):
    """A missing --model folder went through a minute of Hub retries, then a traceback."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        examples(script).parse_args(["--output-dir", "out", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err


def test_train_jrt_saves_a_model_that_generates_with_its_cache(examples, tmp_path):
    assert examples("train_jrt").main(["--output-dir", str(tmp_path), "--prefix-length", "16", "--block-size", "40", *TINY_RUN]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["use_cache"] is True  # Trainer had set it to False
    assert config["prefix_length"] == 16 and config["mask_token_id"] == 257
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.generate(torch.tensor([[97, 98, 99]]), max_new_tokens=3, do_sample=False).shape == (1, 6)


@pytest.mark.parametrize("objective", ["jrt", "causal"])
def test_finetune_lora_saves_adapter_and_merged_model(examples, tmp_path, objective, capsys):
    assert examples("finetune_lora").main(["--output-dir", str(tmp_path), "--objective", objective, "--block-size", "80", *TINY_RUN]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["use_cache"] is True
    out = capsys.readouterr().out
    difference = float(out.split("max |logit difference| = ")[1].split()[0])
    assert difference < 1e-4
    assert f"{objective} objective" in out


def test_finetune_lora_reads_a_local_dataset(examples, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the --dataset option needs the `datasets` package")
    corpus = examples("tiny_setup").builtin_corpus(60)
    datasets.Dataset.from_dict({"body": corpus}).save_to_disk(str(tmp_path / "data"))
    argv = ["--output-dir", str(tmp_path / "run"), "--dataset", str(tmp_path / "data"), "--text-column", "body"]
    assert examples("finetune_lora").main([*argv, "--block-size", "80", *TINY_RUN]) == 0


@pytest.mark.slow
def test_train_jrt_under_accelerate_launch_with_two_cpu_processes(tmp_path):
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--multi_gpu",
        str(ROOT / "tests" / "accelerate_train_probe.py"), str(tmp_path),
        "--output-dir", str(tmp_path / "model"), "--max-steps", "3", "--batch-size", "2", "--block-size", "40",
        "--prefix-length", "16", "--hidden-size", "32",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert all(rank["world_size"] == 2 for rank in ranks)
    # At least 3 steps x 2 sequences per rank (accelerate's loader collates one batch ahead), none seen by both.
    assert all(len(rank["blocks"]) >= 6 for rank in ranks)
    rows = [{tuple(block.tolist()) for block in rank["blocks"]} for rank in ranks]
    assert rows[0].isdisjoint(rows[1])
    # DDP averaged the gradients: both ranks end with the same weights, which the saved model holds.
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    for name, weight in saved.items():
        assert torch.equal(weight, ranks[0]["weights"][name]), name
    assert saved["model.embed_tokens.weight"].shape == (264, 32)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["use_cache"] is True
