"""The documentation's two-process commands (docs/training.md), run exactly as written (on CPU, gloo DDP), and the
examples' clean exit.

Each command is read from docs/training.md and run from a scratch folder in which `examples/` links to the repository's
examples, so relative paths such as `runs/jrt-ddp` land in the scratch folder."""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Launchers of the README and the module each console script runs (this interpreter, not one on PATH).
LAUNCHERS = {"accelerate": ["-m", "accelerate.commands.accelerate_cli"], "torchrun": ["-m", "torch.distributed.run"]}


def readme_command(prefix: str) -> list[str]:
    """The line of the training documentation (docs/training.md) that starts with `prefix`, without its trailing
    comment, as argv."""
    document = ROOT / "docs" / "training.md"
    lines = [line for line in document.read_text(encoding="utf-8").splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"docs/training.md has {len(lines)} lines starting with {prefix!r}"
    argv = shlex.split(lines[0].split("#", 1)[0])
    return [sys.executable, *LAUNCHERS[argv[0]], *argv[1:]]


def run_in_scratch(command: list[str], scratch: Path) -> subprocess.CompletedProcess:
    (scratch / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_readme_ddp_training_command(tmp_path):
    result = run_in_scratch(readme_command("accelerate launch --multi_gpu --num_processes 2"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval loss (NTP + 0.25 x MLM):" in result.stdout
    assert (tmp_path / "runs" / "jrt-ddp" / "model.safetensors").is_file()
    assert "terminate called" not in result.stderr


@pytest.mark.slow
def test_readme_torchrun_lora_command_exits_cleanly(tmp_path):
    result = run_in_scratch(readme_command("torchrun --nproc_per_node 2 examples/finetune_lora.py"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr
    assert (tmp_path / "runs" / "lora-ddp" / "merged" / "config.json").is_file()


@pytest.fixture
def examples(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    return lambda name: importlib.import_module(name)


def test_evaluation_keeps_its_blocks_when_they_are_fewer_than_a_batch(examples, tmp_path, capsys):
    """One eval block and batch 8 with `dataloader_drop_last`: the evaluation used to drop its only batch, and
    printing `metrics['eval_loss']` raised KeyError (as with 11 blocks on 2 processes in the README's DDP run)."""
    text = tmp_path / "corpus.txt"
    text.write_text("amber=12; basil=34; what is basil? basil is 34. " * 12, encoding="utf-8")  # 12 blocks of 40
    argv = ["--output-dir", str(tmp_path / "model"), "--train-file", str(text), "--block-size", "40",
            "--prefix-length", "16", "--max-steps", "1"]
    assert examples("train_jrt").main(argv) == 0
    assert "eval loss (NTP + 0.25 x MLM):" in capsys.readouterr().out


def test_end_distributed_destroys_the_process_group(examples, tmp_path):
    tiny_setup = examples("tiny_setup")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    tiny_setup.end_distributed(synchronize=True)
    assert not torch.distributed.is_initialized()
    tiny_setup.end_distributed(synchronize=True)  # no group: nothing to do
