"""FSDP2, tested on CPU: the README's configuration (one unit per `JRTRNNDecoderLayer` plus the root, resharding after
forward, activation checkpointing, full state dict on save) with torch's `fully_shard` on 2 processes joined with
gloo (tests/fsdp_probe.py). The saved folder must reload and give the logits of an unsharded model after the same
steps on the same global batches.

Trainer/accelerate are not exercised here: accelerate 1.15 switches to FSDP only for GPU-type backends, so on CPU
`TrainingArguments(fsdp=True, ...)` silently trains with DDP; `test_trainer_ignores_fsdp_on_cpu` pins that down, so
the day it changes this test file can run the Trainer path too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import fsdp_probe  # noqa: E402


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_matches_unsharded_training(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(ROOT / "tests" / "fsdp_probe.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    for rank in (0, 1):
        report = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert report["world_size"] == 2
        assert report["units"] == ["", *(f"model.layers.{i}" for i in range(4))]  # the root and each decoder layer
        # Every parameter is sharded; each rank holds about half of the model.
        local = sum(held for held, _ in report["sizes"].values())
        assert len(report["sizes"]) == len(dict(fsdp_probe.tiny_model().named_parameters()))
        assert 0.4 * report["num_parameters"] < local < 0.6 * report["num_parameters"]

    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    unsharded = fsdp_probe.tiny_model()
    unsharded.activation_checkpointing_enable()
    unsharded.train()
    optimizer = fsdp_probe.make_optimizer(unsharded)
    for step in range(fsdp_probe.STEPS):
        fsdp_probe.train_step(unsharded, optimizer, fsdp_probe.global_batch(step))
    unsharded.eval()

    input_ids = fsdp_probe.global_batch(99)
    with torch.no_grad():
        logits = sharded(input_ids).logits
        torch.testing.assert_close(logits, unsharded(input_ids).logits, rtol=1e-4, atol=1e-5)
        initial = fsdp_probe.tiny_model().eval()(input_ids).logits
    assert (logits - initial).abs().max() > 1e-2  # the three steps did move the model
    assert sharded.lm_head.weight.data_ptr() == sharded.model.embed_tokens.weight.data_ptr()  # still tied


def test_trainer_ignores_fsdp_on_cpu(tmp_path):
    """accelerate enables FSDP only for accelerator backends; on a CPU-only setup the README's config is inert."""
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["JRTRNNDecoderLayer"]},
    )
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: FSDP through Trainer applies there")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator, whatever earlier tests built
    try:
        accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
        assert getattr(accelerator.state, "fsdp_plugin", None) is None
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
