"""Recall evaluation of a JSONL file (the engine of `jrt eval-recall`): your documents through the lm-eval recall
tasks `jrt_jsonl` / `jrt_jsonl_twice`.

There is one evaluation code path: this module writes two task YAMLs that include the shipped `jrt_jsonl` tasks
(`jrt_eval/tasks`) with your file as their data, runs them with lm-eval's `simple_evaluate` on the `JRTLM` model
(leak-free JRT scoring; any other causal LM works as under lm-eval's `hf`), and turns lm-eval's logged samples into
the summary table and the per-record file. Records, prompts and protocol: `jrt_eval.recall`. Prompts longer than
the model's window (`max_length`: `max_position_embeddings`, else 2048) are left-truncated by lm-eval. Needs the
`eval` extra (lm-eval).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jrt_eval import TASKS_DIR
from jrt_eval.recall import (RecallRecord, contains_score, default_prompt, first_line, load_records, record_doc,
                             twice_prompt, window_context)

PROMPT_KINDS: tuple[str, ...] = ("default", "jrt")
"""`default`: the read-once prompt; `jrt`: the JRT-Prompt (document twice)."""

_TASK_SUFFIX = {"default": "", "jrt": "_twice"}


@dataclass(frozen=True)
class RecallResult:
    """The outcome of one prompt of one record (a line of the per-record output file)."""

    id: str
    line: int
    prompt_kind: str
    prompt: str
    prompt_tokens: int
    generation: str
    answers: list[str]
    correct: bool


@dataclass
class RecallReport:
    """All results of a run, in record order, then prompt kind."""

    prompt_kinds: tuple[str, ...]
    results: list[RecallResult] = field(default_factory=list)

    def accuracy(self) -> dict[str, tuple[int, int]]:
        """prompt kind -> (correct, scored)."""
        counts = {kind: (0, 0) for kind in self.prompt_kinds}
        for result in self.results:
            correct, total = counts[result.prompt_kind]
            counts[result.prompt_kind] = (correct + result.correct, total + 1)
        return counts

    def format_table(self) -> str:
        """The summary table: one row per prompt kind."""
        lines = [f"{'prompt':<8} {'correct':>7} {'total':>6} {'contains':>9}"]
        for kind, (correct, total) in self.accuracy().items():
            accuracy = f"{100 * correct / total:.1f}%" if total else "n/a"
            lines.append(f"{kind:<8} {correct:>7} {total:>6} {accuracy:>9}")
        return "\n".join(lines)


def build_prompt(record: RecallRecord, tokenizer, *, prompt_kind: str, context_tokens: int = 1000,
                 answer_tokens: int = 50) -> str:
    """The `prompt_kind` prompt of `record` exactly as the `jrt_jsonl` tasks build it."""
    if prompt_kind not in PROMPT_KINDS:
        raise ValueError(f"Unknown prompt kind {prompt_kind!r}; expected one of {', '.join(PROMPT_KINDS)}.")
    doc = record_doc(record)
    doc["context"] = window_context(doc, tokenizer, context_tokens, answer_tokens)
    return default_prompt(doc) if prompt_kind == "default" else twice_prompt(doc)


def check_output_writable(path: str | Path) -> None:
    """Refuse an output path that cannot be written, before the evaluation runs (its results would be lost)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--output {path} is a folder; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"--output {path}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--output {path} is not writable")


def _task_yaml(task: str, shipped: Path, data: Path, limit: int | None) -> str:
    lines = [f"include: {json.dumps(str(shipped))}", f"task: {task}", "dataset_kwargs:", "  family: jsonl",
             f"  data_files: {json.dumps(str(data.resolve()))}"]
    if limit is not None:
        lines.append(f"  limit_docs: {limit}")
    return "\n".join(lines) + "\n"


def evaluate_recall(lm, data: str | Path, *, tokenizer_name: str, prompt_kinds: Sequence[str] = PROMPT_KINDS,
                    context_tokens: int = 1000, answer_tokens: int = 50, max_new_tokens: int = 48,
                    limit: int | None = None) -> RecallReport:
    """Run the `jrt_jsonl` tasks (one per prompt kind) on the JSONL file `data` with the lm-eval model `lm`.

    Args:
        lm: An lm-eval `LM`, normally `jrt_eval.JRTLM`.
        data: The JSONL file (validated with `load_records` first).
        tokenizer_name: Tokenizer that counts document tokens for the truncation (the model's).
        prompt_kinds: A subset of `PROMPT_KINDS`.
        context_tokens, answer_tokens: The document window is `context_tokens - answer_tokens` tokens.
        max_new_tokens: Greedy tokens generated per prompt before the newline cut.
        limit: Evaluate only the first `limit` records.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if not prompt_kinds or any(kind not in PROMPT_KINDS for kind in prompt_kinds):
        raise ValueError(f"`prompt_kinds` must be a non-empty subset of {PROMPT_KINDS}, got {prompt_kinds!r}.")
    records = {record.line: record for record in load_records(data, limit=limit)}
    tasks = {kind: f"jrt_eval_recall{_TASK_SUFFIX[kind]}" for kind in prompt_kinds}
    with tempfile.TemporaryDirectory(prefix="jrt-eval-recall-") as folder:
        for kind, task in tasks.items():
            shipped = TASKS_DIR / f"jrt_jsonl{_TASK_SUFFIX[kind]}.yaml"
            (Path(folder) / f"{task}.yaml").write_text(_task_yaml(task, shipped, Path(data), limit), encoding="utf-8")
        manager = TaskManager(
            include_path=folder, include_defaults=False,
            metadata={"tokenizer": tokenizer_name, "context_tokens": context_tokens, "answer_tokens": answer_tokens},
        )
        output = simple_evaluate(model=lm, tasks=list(tasks.values()), task_manager=manager, log_samples=True,
                                 gen_kwargs={"max_gen_toks": max_new_tokens})
    results = []
    for kind, task in tasks.items():
        for sample in output["samples"][task]:
            record, prompt = records[sample["doc"]["line"]], sample["arguments"][0][0]
            generation = first_line(sample["filtered_resps"][0])
            results.append(RecallResult(id=record.id, line=record.line, prompt_kind=kind, prompt=prompt,
                                        prompt_tokens=len(lm.tok_encode(prompt)), generation=generation,
                                        answers=list(record.answers),
                                        correct=contains_score(generation, record.answers)))
    results.sort(key=lambda result: (result.line, PROMPT_KINDS.index(result.prompt_kind)))
    return RecallReport(prompt_kinds=tuple(prompt_kinds), results=results)


def write_results(path: str | Path, report: RecallReport) -> None:
    """Write one JSON object per (record, prompt kind) result: the fields of `RecallResult`."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for result in report.results:
            handle.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")


def quiet_lm_eval() -> None:
    """Only errors from lm-eval's loggers (its per-task warnings would drown the summary)."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)


__all__ = ["PROMPT_KINDS", "RecallRecord", "RecallReport", "RecallResult", "build_prompt", "check_output_writable",
           "contains_score", "evaluate_recall", "first_line", "load_records", "quiet_lm_eval", "write_results"]
