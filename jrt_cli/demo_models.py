"""The models behind `jrt demo`: tiny JRT-RNN and Based trained on set disjointness.

They were trained by the synthetic-experiment harness of the repository (`experiments/synthetic`, experiment E1) and
ship in `jrt_cli/assets/models/{jrt-rnn-sd,based-sd}/` as data: weights, config, `token_map.json`, `training.json`
and a tokenizer built from the token map (`tokenizer.json`), no code. They load offline through the installed package
(`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`); `export_demo_models` (`jrt demo --export
DIR`) writes Hub-ready copies that carry the model's code.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)
from modeling_jrt.cache import JRTRNNConvState, JRTRNNLinearAttentionState
from modeling_jrt.compat import output_cache

from .choices import DEMO_SEED, MODELS_DIR
from .set_disjointness import SyntheticBatch, set_disjointness

DEMO_SLICES = ((4, 16), (16, 4))  # the set sizes the models were trained on
LONGER_SLICES = ((8, 24), (24, 8))  # longer sets never seen in training (prompt of 35 tokens)
# The shipped demo models (folders of `MODELS_DIR`), by the model kind they demonstrate.
JRT_DEMO_MODEL = "jrt-rnn-sd"
BASED_DEMO_MODEL = "based-sd"
DEMO_MODELS = {"JRT-RNN": JRT_DEMO_MODEL, "causal Based": BASED_DEMO_MODEL}


@dataclass
class DemoArm:
    """A model and the prompt format it is given (`repeat = 2` is JRT-Prompt: the context read twice)."""

    label: str
    model_dir: str
    repeat: int = 1


DEMO_ARMS = (DemoArm("JRT-RNN (prefix linear attention)", JRT_DEMO_MODEL),
             DemoArm("Based (causal linear attention)", BASED_DEMO_MODEL),
             DemoArm("Based + JRT-Prompt (input twice)", BASED_DEMO_MODEL, repeat=2))


def load_demo_model(model_dir: str, models_dir: Path = MODELS_DIR) -> tuple[torch.nn.Module, dict]:
    """(model in eval mode, token map) of a shipped demo model, e.g. `"jrt-rnn-sd"`."""
    path = models_dir / model_dir
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"No demo model in {path}: reinstall jrt-rnn, or pass the folder of models exported by "
                                "`python experiments/synthetic export` (see its README).")
    try:
        model = AutoModelForCausalLM.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 -- a damaged or foreign folder: one line naming it
        reason = " ".join(str(error).split()) or type(error).__name__
        raise RuntimeError(f"cannot load the demo model in {path} "
                           f"({reason}): copy or export the folder again") from error
    model.eval()
    return model, json.loads((path / "token_map.json").read_text())


# What a shipped demo folder holds: data only (the code comes from the installed package).
SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "token_map.json", "tokenizer.json",
                 "tokenizer_config.json", "training.json")


def refresh_demo_folder(folder: Path) -> list[str]:
    """Rewrite `config.json` (current layout, no `auto_map`) and the tokenizer (`sd_tokenizer` of `token_map.json`)
    of a demo model folder and remove any file not in `SHIPPED_FILES`; returns the files written. The weights, the
    generation config and `training.json` are left alone. `python -m jrt_cli.demo_models` runs it on the shipped
    folders; tests/jrt_cli/test_demo_assets.py checks them.
    """
    from .set_disjointness import sd_tokenizer

    config = AutoModelForCausalLM.from_pretrained(folder).config
    config.auto_map = None
    config.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("auto_map", None)
    (folder / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    token_map = json.loads((folder / "token_map.json").read_text())
    written = [Path(name).name for name in sd_tokenizer(token_map).save_pretrained(folder)]
    for path in folder.iterdir():
        if path.name not in SHIPPED_FILES:
            path.unlink()
    return ["config.json", *written]


def export_demo_models(destination: Path, models_dir: Path = MODELS_DIR) -> list[Path]:
    """Write each demo model as a Hub-ready folder under `destination`: `save_pretrained` (with the model's code, for
    `trust_remote_code=True` without this package), its tokenizer, `token_map.json`, `training.json` and a model card.
    Each folder is completed in a temporary place, then moved into place; an existing one is refused. Returns them."""
    destination.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DEMO_MODELS.values():
        target = destination / name
        if target.exists():
            raise FileExistsError(f"{target} exists: export into an empty folder, or remove it first.")
        model, _ = load_demo_model(name, models_dir)
        with tempfile.TemporaryDirectory(dir=destination) as scratch:
            staged = Path(scratch) / name
            model.save_pretrained(staged)
            for file in ("token_map.json", "training.json", "tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(models_dir / name / file, staged / file)
            training = json.loads((models_dir / name / "training.json").read_text())
            (staged / "README.md").write_text(render_demo_model_card(name, model.config, training), encoding="utf-8")
            staged.rename(target)
        written.append(target)
    return written


# The prompt of the exported cards' usage block: two sets that share t12 (the model answers after the "?").
CARD_PROMPT = "<bos> t5 t9 t12 t40 | t44 t47 t50 t52 t55 t57 t59 t60 t61 t62 t63 t64 t65 t66 t67 t12 ?"


def render_demo_model_card(name: str, config, training: dict) -> str:
    """The README.md of an exported demo model: what it is, a usage block that runs without jrt-rnn, its architecture
    and training (from its `training.json`), and the papers (`jrt_convert.model_card`'s header and citations)."""
    from jrt_convert.model_card import citation_section, front_matter

    is_prefix = config.linear_attention_type == "prefix"
    kind = "JRT-RNN (prefix linear attention)" if is_prefix else "Based (causal linear attention)"
    spec, task = training.get("spec", {}), training.get("spec", {}).get("task", {})
    slices = ", ".join(f"{a} + {b}" for a, b in task.get("train_slices", DEMO_SLICES))
    accuracy = ", ".join(f"{100 * value:.1f}% on {key.replace('_', ' + ')}" for key, value in
                         training.get("accuracy", {}).items())
    layers = ", ".join(config.mixer_types)
    steps, batch = spec.get("steps", "-"), spec.get("batch_size", "-")
    return f"""{front_matter(tags=("jrt-rnn", "based", "linear-attention", "synthetic", "set-disjointness"))}
# {name}: a tiny {kind} on set disjointness

One of the two models behind `jrt demo` (jrt-rnn), exported with `jrt demo --export`. It was trained from scratch by
the repository's synthetic harness (`experiments/synthetic`, experiment E1) on **set disjointness** (JRT paper,
Algorithm 1): the prompt `<bos> A | B ?` lists two sets of tokens that share exactly one, and after `?` the model
names it. Its vocabulary is that task's (`t4` ... `t67` and `<bos>`, `|`, `?`; one word per token, an unknown word is
`<mask>`): it demonstrates the architecture, not language.

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
prompt = "{CARD_PROMPT}"
inputs = tokenizer(prompt, return_tensors="pt")
answer = model.generate(**inputs, max_new_tokens=1, do_sample=False)[0, inputs["input_ids"].shape[1]:]
print(tokenizer.decode(answer))  # the token both sets hold
```

`PATH_OR_REPO` is this folder (or its Hub repo). The modeling code ships with the folder (`trust_remote_code=True`);
with the `jrt-rnn` package installed, `import modeling_jrt` registers the same classes locally.

## Model and training

| | |
|---|---|
| kind | {kind}{f", prefix of {config.prefix_length} tokens" if is_prefix else ""} |
| layers | {config.num_hidden_layers}: {layers} |
| hidden size / heads / feature dim | {config.hidden_size} / {config.num_attention_heads} / {config.feature_dim} |
| parameters | {training.get("num_parameters", "-")} |
| training | {steps} steps of batch {batch}, sets of sizes {slices}, seed {training.get("seed", "-")} |
| accuracy (held-out examples) | {accuracy or "-"} |

{citation_section()}"""


def demo_batch(num_examples: int, repeat: int = 1, seed: int = DEMO_SEED, vocab_size: int = 68,
               slices: tuple[tuple[int, int], ...] = DEMO_SLICES) -> SyntheticBatch:
    """`num_examples` fresh set-disjointness examples, split evenly over `slices` (`(|A|, |B|)` pairs of the same
    total length), in that order.

    The sets depend only on `seed` (not on `repeat`), so `repeat = 1` and `repeat = 2` give the same questions.
    """
    rng = np.random.RandomState(seed)
    sizes = [num_examples // len(slices) + (i < num_examples % len(slices)) for i in range(len(slices))]
    parts = [set_disjointness(rng, n, a, b, vocab_size, repeat) for n, (a, b) in zip(sizes, slices) if n]
    return SyntheticBatch(torch.cat([p.input_ids for p in parts]), torch.cat([p.labels for p in parts]),
                          parts[0].prefix_length)


@torch.no_grad()
def generate_answers(model: torch.nn.Module, batch: SyntheticBatch) -> torch.Tensor:
    """`(B,)` greedy answer token of each prompt, through `generate()`; the whole prompt is the JRT-RNN prefix
    (causal models ignore it)."""
    output = model.generate(
        batch.input_ids, attention_mask=torch.ones_like(batch.input_ids), max_new_tokens=1, do_sample=False,
        prefix_length=batch.prefix_length, pad_token_id=model.config.pad_token_id,
    )
    return output[:, -1]


def recurrent_state_size(model: torch.nn.Module, batch: SyntheticBatch) -> dict[str, int]:
    """Floats of recurrent state per sequence after prefilling the first row of `batch`, read from the cache:
    `{"linear_attention": ..., "conv": ..., "total": ...}` (everything decoding needs)."""
    with torch.no_grad():
        output = model(input_ids=batch.input_ids[:1], prefix_length=batch.prefix_length, use_cache=True)
    cache = output_cache(output)
    sizes = {"linear_attention": 0, "conv": 0}
    for layer in cache.layers:
        if isinstance(layer, JRTRNNLinearAttentionState):
            sizes["linear_attention"] += 0 if layer.state is None else layer.state.numel()
        elif isinstance(layer, JRTRNNConvState):
            sizes["conv"] += 0 if layer.inputs is None else layer.inputs.numel()
    sizes["total"] = sizes["linear_attention"] + sizes["conv"]
    return sizes


if __name__ == "__main__":
    # Refresh the shipped folders after a change to the config layout or to the demo tokenizer.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for name in DEMO_MODELS.values():
        files = refresh_demo_folder(MODELS_DIR / name)
        print(f"{MODELS_DIR / name}: {', '.join(sorted(set(files)))}")
