"""The folders the cross-release set loads, and what the newest transformers computes with them.

`python tests/cross_release/folders.py DIR` (run by `.ci/run` in the newest-release venv) saves, with the package
imported:

    jrt-demo/        the shipped JRT-RNN demo model (attention-free: conv + prefix linear attention, a tokenizer)
    based-demo/      the shipped Based demo model (attention-free, a tokenizer)
    based-decay/     an attention-free Based with the fixed decay and the input-dependent gate
    jrt-sliding/     a tiny JRT-RNN with every mixer (conv, prefix linear attention, sliding attention)
    converted/       a reference-format JRT checkpoint after `jrt convert`
    legacy-0.3/      jrt-sliding as jrt-rnn 0.3 saved it: `layer_types` in config.json (with "conv", which some
                     transformers releases rewrite), and 0.2's `prefix_strategy` in generation_config.json

each with `expected.pt`: the inputs the checks use and what the package computes from them on this release (logits
and greedy tokens of a left-padded batch, a two-turn continuation). `isolated_checks.py` loads the folders with
`trust_remote_code=True` alone on any release; `test_cross_release.py` compares.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
if __name__ == "__main__":  # run as a script: import the repository's packages and the tests' helpers
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path[:0] = [str(ROOT), str(TESTS)]

import modeling_jrt  # noqa: E402
from modeling_jrt import JRTRNNForCausalLM  # noqa: E402

FOLDERS = ("jrt-demo", "based-demo", "based-decay", "jrt-sliding", "converted", "legacy-0.3")
LEGACY_STRATEGY = "repeat"  # what the legacy folder's generation_config.json says (its config.json says "pad")
NEW_TOKENS = 5


def _load_module(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny(**overrides) -> modeling_jrt.JRTRNNConfig:
    return _load_module(TESTS / "conftest.py", "jrt_tests_conftest").tiny_config(**overrides)


def _batch(vocab: int, low: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two rows: a 3-token prompt (shorter than every prefix here, so the fill applies) and
    an 11-token one."""
    input_ids = torch.randint(low, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :8] = 0
    input_ids[0, :8] = 0
    return input_ids, attention_mask


def expected_outputs(model: JRTRNNForCausalLM, vocab: int) -> dict:
    """What the checks compare on another release: fp32 logits of the batch, its greedy tokens, and a second turn
    (the one-shot run of the same length, which a continuation from the first turn's cache must equal)."""
    input_ids, attention_mask = _batch(vocab)
    settings = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
    generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, **settings)
    two_turns = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2 * NEW_TOKENS, **settings)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "logits": logits, "generated": generated,
            "two_turns": two_turns, "mixer_types": list(model.config.mixer_types),
            "transformers": transformers.__version__}


def _save(model: JRTRNNForCausalLM, folder: Path, extra: tuple[Path, ...] = ()) -> None:
    model.save_pretrained(folder)
    for path in extra:  # the demo tokenizers
        shutil.copyfile(path, folder / path.name)
    torch.save(expected_outputs(model, model.config.vocab_size), folder / "expected.pt")


def _demo(folder: Path, name: str) -> None:
    source = ROOT / "jrt_cli" / "assets" / "models" / name
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    _save(model, folder, tuple(source / file for file in ("tokenizer.json", "tokenizer_config.json")))


def _converted(folder: Path, scratch: Path) -> None:
    from jrt_convert import convert_checkpoint

    reference = _load_module(TESTS / "jrt_convert" / "reference_checkpoints.py", "jrt_tests_reference")
    config = reference.reference_config("jrt")
    source = scratch / "JRT-360M-30B"
    reference.write_reference_checkpoint(source, config, reference.reference_state_dict(config), lightning=False)
    convert_checkpoint(source, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.save(expected_outputs(model, model.config.vocab_size), folder / "expected.pt")


def _legacy(folder: Path) -> None:
    """jrt-sliding's weights and code, with config.json / generation_config.json in the 0.2 / 0.3 layout. Expected:
    the model with the legacy `prefix_strategy` applied."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(_tiny(initializer_range=0.3)).eval()
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = config.pop("mixer_types")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["prefix_strategy"] = LEGACY_STRATEGY
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    model.config.prefix_strategy = LEGACY_STRATEGY
    torch.save(expected_outputs(model, model.config.vocab_size), folder / "expected.pt")


def save_folders(root: Path, scratch: Path | None = None) -> list[Path]:
    """Save every folder of `FOLDERS` under `root`; returns their paths."""
    root.mkdir(parents=True, exist_ok=True)
    scratch = scratch or root / "_scratch"
    _demo(root / "jrt-demo", "jrt-rnn-sd")
    _demo(root / "based-demo", "based-sd")
    torch.manual_seed(0)
    decay = _tiny(mixer_types=["conv", "linear_attention", "conv", "linear_attention"],
                  linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True,
                  initializer_range=0.3)
    _save(JRTRNNForCausalLM(decay).eval(), root / "based-decay")
    torch.manual_seed(0)
    _save(JRTRNNForCausalLM(_tiny(initializer_range=0.3)).eval(), root / "jrt-sliding")
    _converted(root / "converted", scratch)
    _legacy(root / "legacy-0.3")
    shutil.rmtree(scratch, ignore_errors=True)
    return [root / name for name in FOLDERS]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/cross_release/folders.py DIR")
    save_folders(Path(sys.argv[1]))
    print(f"saved {len(FOLDERS)} folders in {sys.argv[1]} with transformers {transformers.__version__}")
