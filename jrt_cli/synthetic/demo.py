"""The models behind `jrt demo`: tiny JRT-RNN and Based trained on set disjointness by `jrt synthetic e1`.

They ship in `jrt_cli/assets/models/{jrt-rnn-sd,based-sd}/` (`save_pretrained` output plus `token_map.json` and
`training.json`) and load offline through `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)

from .data import SyntheticBatch, set_disjointness
from .train import recurrent_state_size

MODELS_DIR = Path(__file__).resolve().parent.parent / "assets" / "models"
DEMO_SEED = 2024
DEMO_SLICES = ((4, 16), (16, 4))  # the set sizes the models were trained on
LONGER_SLICES = ((8, 24), (24, 8))  # longer sets never seen in training (prompt of 35 tokens)


@dataclass
class DemoArm:
    """A model and the prompt format it is given (`repeat = 2` is JRT-Prompt: the context read twice)."""

    label: str
    model_dir: str
    repeat: int = 1


DEMO_ARMS = (
    DemoArm("JRT-RNN (prefix linear attention)", "jrt-rnn-sd"),
    DemoArm("Based (causal linear attention)", "based-sd"),
    DemoArm("Based + JRT-Prompt (input twice)", "based-sd", repeat=2),
)


def load_demo_model(model_dir: str, models_dir: Path = MODELS_DIR) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode, token map) of a shipped demo model, e.g. `"jrt-rnn-sd"`."""
    path = models_dir / model_dir
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"No demo model in {path}; reinstall jrt-rnn or export one with `jrt synthetic export runs/e1`."
        )
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, json.loads((path / "token_map.json").read_text())


def demo_batch(num_examples: int, repeat: int = 1, seed: int = DEMO_SEED, vocab_size: int = 68,
               slices: tuple[tuple[int, int], ...] = DEMO_SLICES) -> SyntheticBatch:
    """`num_examples` fresh set-disjointness examples, split evenly over `slices` (`(|A|, |B|)` pairs of the same
    total length), in that order.

    The sets depend only on `seed` (not on `repeat`), so `repeat = 1` and `repeat = 2` give the same questions.
    """
    rng = np.random.RandomState(seed)
    sizes = [num_examples // len(slices) + (i < num_examples % len(slices)) for i in range(len(slices))]
    parts = [set_disjointness(rng, n, a, b, vocab_size, repeat) for n, (a, b) in zip(sizes, slices) if n]
    return SyntheticBatch(
        torch.cat([p.input_ids for p in parts]), torch.cat([p.labels for p in parts]), parts[0].prefix_length
    )


@torch.no_grad()
def generate_answers(model: torch.nn.Module, batch: SyntheticBatch) -> torch.Tensor:
    """`(B,)` greedy answer token of each prompt, through `generate()` (prefill, then one decoded token).

    The whole prompt is the JRT-RNN prefix (`prefix_length = T`); causal models ignore it.
    """
    output = model.generate(
        batch.input_ids, attention_mask=torch.ones_like(batch.input_ids), max_new_tokens=1, do_sample=False,
        prefix_length=batch.prefix_length, pad_token_id=model.config.pad_token_id,
    )
    return output[:, -1]


def describe_state(model: torch.nn.Module, batch: SyntheticBatch) -> dict[str, int]:
    """Recurrent state floats per sequence after the prefill (from the cache); see `train.recurrent_state_size`."""
    return recurrent_state_size(model, batch)
