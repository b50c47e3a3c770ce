"""jrt-rnn's lm-evaluation-harness integration (optional extra: `pip install "jrt-rnn[eval]"`).

Importing this package registers with lm-eval

- the model `jrt` (`jrt_eval.lm.JRTLM`): lm-eval's HF model with leak-free JRT prefix scoring, and
- nothing else: the recall tasks are YAML files in `TASKS_DIR`, loaded with `--include_path` (`jrt lm-eval` adds it).

The recall tasks (`jrt_swde`, `jrt_fda`, `jrt_squad`, `jrt_drop`, `jrt_triviaqa`, `jrt_nq_{512,1024,2048}`, each with
a `_twice` JRT-Prompt variant, and the groups `jrt_recall` / `jrt_recall_twice`) build their prompts with
`modeling_jrt.prompting`, the single source of the prompt strings; see `jrt_eval.recall`.
"""

from __future__ import annotations

from pathlib import Path

from .lm import JRTLM, SCORING_MODES

TASKS_DIR: Path = Path(__file__).resolve().parent / "tasks"
"""The folder of the recall task YAMLs (pass it to lm-eval's `--include_path` / `TaskManager(include_path=...)`)."""

__all__ = ["JRTLM", "SCORING_MODES", "TASKS_DIR"]
