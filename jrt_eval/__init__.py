"""jrt-rnn's lm-evaluation-harness integration (optional extra: `pip install -e ".[eval]"` in a checkout).

- `jrt_eval.lm.JRTLM`, registered with lm-eval as the model `jrt` when `jrt_eval.lm` is imported (`jrt lm-eval`
  does it): lm-eval's HF model with leak-free JRT prefix scoring.
- The recall tasks, YAML files in `TASKS_DIR` for lm-eval's `--include_path` (`jrt lm-eval` adds it): `jrt_swde`,
  `jrt_fda`, `jrt_squad`, `jrt_drop`, `jrt_triviaqa`, `jrt_nq_{512,1024,2048}` and `jrt_jsonl` (your own documents),
  each with a `_twice` JRT-Prompt variant, and the groups `jrt_recall` / `jrt_recall_twice`. Their data and prompts
  come from `jrt_eval.recall`.

`jrt_eval.recall` needs only `datasets`; `JRTLM` needs lm-eval, imported on first use of `jrt_eval.JRTLM`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR: Path = Path(__file__).resolve().parent / "tasks"
"""The folder of the recall task YAMLs (pass it to lm-eval's `--include_path` / `TaskManager(include_path=...)`)."""

SCORING_MODES: tuple[str, ...] = ("leak_free", "reference")
"""The `scoring=` of `JRTLM` (here, not in `jrt_eval.lm`, so that `jrt lm-eval` checks it without importing torch)."""


def __getattr__(name: str) -> Any:
    # `JRTLM` imports lm-eval (the optional extra): only when asked for.
    if name == "JRTLM":
        from . import lm

        return getattr(lm, name)
    raise AttributeError(f"module 'jrt_eval' has no attribute {name!r}")


__all__ = ["JRTLM", "SCORING_MODES", "TASKS_DIR"]
