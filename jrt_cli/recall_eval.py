"""Recall-intensive evaluation: read-once vs JRT-Prompt on your own documents, with any causal LM.

The protocol of the reference lm-eval tasks (REFERENCE.md §6): cut each document to a token window around the answer,
build the read-once and/or the JRT prompt, generate greedily (48 new tokens by default), cut the continuation at the
first newline, and score "contains": a case-insensitive substring match of any gold answer.

Data: JSON Lines, one record per line (blank lines are ignored):

    context   str, required    the document
    key       str              the attribute asked for (information extraction, SWDE/FDA style)
    question  str              the completion-style question that ends the prompt (document QA)
    answers   str | list[str]  gold answers, at least one non-empty string
    header    str, optional    the natural-language question shown before the first copy in the JRT prompt
                               (the reference data's `orig_question`); default: the question
    template  str, optional    a `modeling_jrt.PROMPT_TEMPLATES` name; default "extraction" when `key` is given,
                               else "qa"
    id        str | int, opt.  echoed in the per-record output; default "line-N"

Extraction templates need `key`, QA templates need `question`. A record that breaks these rules stops the run with an
error naming its line. A record whose prompt (plus the new tokens) exceeds the model's position limit is skipped for
every prompt kind, so both kinds are scored on the same records; the summary counts the skips.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)
from modeling_jrt.prompting import EXTRACTION_TEMPLATES, PROMPT_TEMPLATES, jrt_prompt, truncate_context

PROMPT_KINDS: tuple[str, ...] = ("default", "jrt")
"""`default`: the read-once prompt; `jrt`: the JRT-Prompt (document twice)."""


@dataclass(frozen=True)
class RecallRecord:
    """One validated input record; `line` is its 1-based line number in the JSONL file."""

    line: int
    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    template: str
    header: str | None = None


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
    """All results, plus the records skipped because their prompts were too long for the model."""

    prompt_kinds: tuple[str, ...]
    results: list[RecallResult] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)

    def accuracy(self) -> dict[str, tuple[int, int]]:
        """prompt kind -> (correct, scored)."""
        counts = {kind: (0, 0) for kind in self.prompt_kinds}
        for result in self.results:
            correct, total = counts[result.prompt_kind]
            counts[result.prompt_kind] = (correct + result.correct, total + 1)
        return counts

    def format_table(self) -> str:
        """The summary table: one row per prompt kind, then the skip count."""
        lines = [f"{'prompt':<8} {'correct':>7} {'total':>6} {'contains':>9}"]
        for kind, (correct, total) in self.accuracy().items():
            accuracy = f"{100 * correct / total:.1f}%" if total else "n/a"
            lines.append(f"{kind:<8} {correct:>7} {total:>6} {accuracy:>9}")
        scored = len({result.line for result in self.results})
        lines.append(f"skipped {len(self.skipped)} of {scored + len(self.skipped)} records (prompt too long)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Input
# ----------------------------------------------------------------------------------------------------------------


def _parse_record(raw: object, line: int) -> RecallRecord:
    """Validate one decoded JSON line; errors say what is wrong (the caller adds the file and line)."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    context = raw.get("context")
    if not isinstance(context, str):
        raise ValueError("missing or non-string field 'context' (the document)")
    if not context.strip():
        raise ValueError("empty document in 'context'")
    template = raw.get("template", "extraction" if "key" in raw else "qa")
    if template not in PROMPT_TEMPLATES:
        raise ValueError(f"unknown template {template!r}; expected one of {', '.join(PROMPT_TEMPLATES)}")
    query_field = "key" if template in EXTRACTION_TEMPLATES else "question"
    question = raw.get(query_field)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"template {template!r} needs a non-empty string field {query_field!r}")
    answers = raw.get("answers")
    answers = [answers] if isinstance(answers, str) else answers
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise ValueError("'answers' must be a non-empty string or a non-empty list of non-empty strings")
    header = raw.get("header")
    if header is not None and not isinstance(header, str):
        raise ValueError(f"'header' must be a string, got {type(header).__name__}")
    record_id = raw.get("id", f"line-{line}")
    if not isinstance(record_id, (str, int)) or isinstance(record_id, bool):
        raise ValueError(f"'id' must be a string or an integer, got {type(record_id).__name__}")
    return RecallRecord(line, str(record_id), context, question, tuple(answers), template, header)


def load_records(path: str | Path, *, limit: int | None = None) -> list[RecallRecord]:
    """Read and validate a JSONL file of records (format in the module docstring).

    Args:
        path: The JSONL file.
        limit: Read at most this many records (the first ones).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: A line is not valid JSON or breaks the record format; the message starts with `FILE:LINE:`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    records: list[RecallRecord] = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: invalid JSON ({error.msg} at column {error.colno})") from None
            try:
                records.append(_parse_record(raw, line_number))
            except ValueError as error:
                raise ValueError(f"{path}:{line_number}: {error}") from None
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


# ----------------------------------------------------------------------------------------------------------------
# Prompts, scoring, generation
# ----------------------------------------------------------------------------------------------------------------


def build_prompt(
    record: RecallRecord,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_kind: str,
    context_tokens: int = 1000,
    answer_tokens: int = 50,
) -> str:
    """The `prompt_kind` prompt of `record`, its document cut to `context_tokens - answer_tokens` tokens.

    The window is centred on the first occurrence of a gold answer or, for extraction records, of the key, as the
    reference centres SWDE/FDA windows on either.
    """
    if prompt_kind not in PROMPT_KINDS:
        raise ValueError(f"Unknown prompt kind {prompt_kind!r}; expected one of {', '.join(PROMPT_KINDS)}.")
    anchors = record.answers + ((record.question,) if record.template in EXTRACTION_TEMPLATES else ())
    context = truncate_context(
        record.context, tokenizer, context_tokens=context_tokens, answer_tokens=answer_tokens, answers=anchors
    )
    repeats = 1 if prompt_kind == "default" else 2
    return jrt_prompt(context, record.question, repeats=repeats, template=record.template, header=record.header)


def contains_score(generation: str, answers: Sequence[str]) -> bool:
    """True when any answer occurs in `generation`, case-insensitively (the reference "contains" metric)."""
    return any(re.search(re.escape(answer), generation, re.IGNORECASE) for answer in answers)


def first_line(text: str) -> str:
    """The continuation up to its first newline (the reference's `until: ["\\n"]`)."""
    return text.split("\n", 1)[0]


@torch.no_grad()
def generate_continuations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 48,
) -> list[str]:
    """Greedy continuations of a batch of prompts, left-padded, stopped and cut at the first newline.

    `tokenizer.padding_side` must be `"left"` and `tokenizer.pad_token` set (`load_model_and_tokenizer` does both).
    """
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True).to(model.device)
    output = model.generate(
        **batch,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=["\n"],
        tokenizer=tokenizer,
    )
    new_tokens = output[:, batch["input_ids"].shape[1] :]
    return [first_line(text) for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def model_position_limit(model: PreTrainedModel) -> int | None:
    """`config.max_position_embeddings` when the model has one (Llama); None for position-free models (JRT-RNN)."""
    return getattr(model.config, "max_position_embeddings", None)


def evaluate_recall(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[RecallRecord],
    *,
    prompt_kinds: Sequence[str] = PROMPT_KINDS,
    context_tokens: int = 1000,
    answer_tokens: int = 50,
    batch_size: int = 8,
    max_new_tokens: int = 48,
    max_length: int | None = None,
    progress: bool = True,
) -> RecallReport:
    """Run the recall evaluation of `records` with every prompt kind.

    Args:
        model: Any causal LM with `generate`.
        tokenizer: Its tokenizer, padding on the left, with a pad token.
        records: From `load_records`.
        prompt_kinds: A subset of `PROMPT_KINDS`.
        context_tokens, answer_tokens: The document window is `context_tokens - answer_tokens` tokens.
        batch_size: Prompts per `generate` call.
        max_new_tokens: Tokens generated per prompt before the newline cut (the reference generates 48).
        max_length: Skip records whose prompt length plus `max_new_tokens` exceeds this; default
            `model_position_limit(model)` (no limit when None).
        progress: Show a progress bar on stderr.
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    if not prompt_kinds or any(kind not in PROMPT_KINDS for kind in prompt_kinds):
        raise ValueError(f"`prompt_kinds` must be a non-empty subset of {PROMPT_KINDS}, got {prompt_kinds!r}.")
    max_length = model_position_limit(model) if max_length is None else max_length
    report = RecallReport(prompt_kinds=tuple(prompt_kinds))

    # 1. Build every prompt; skip records with a prompt the model cannot take.
    jobs: list[tuple[RecallRecord, str, str, int]] = []  # (record, kind, prompt, prompt tokens)
    for record in records:
        prompts = {
            kind: build_prompt(
                record, tokenizer, prompt_kind=kind, context_tokens=context_tokens, answer_tokens=answer_tokens
            )
            for kind in prompt_kinds
        }
        lengths = {kind: len(tokenizer(prompt)["input_ids"]) for kind, prompt in prompts.items()}
        longest = max(lengths.values())
        if max_length is not None and longest + max_new_tokens > max_length:
            report.skipped.append(
                (record.line, f"{longest} prompt tokens + {max_new_tokens} new tokens > {max_length} positions")
            )
            continue
        jobs.extend((record, kind, prompts[kind], lengths[kind]) for kind in prompt_kinds)

    # 2. Generate in batches and score.
    with tqdm(total=len(jobs), desc="eval-recall", unit="prompt", file=sys.stderr, disable=not progress) as bar:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            generations = generate_continuations(
                model, tokenizer, [prompt for _, _, prompt, _ in chunk], max_new_tokens=max_new_tokens
            )
            for (record, kind, prompt, length), generation in zip(chunk, generations):
                report.results.append(
                    RecallResult(
                        id=record.id,
                        line=record.line,
                        prompt_kind=kind,
                        prompt=prompt,
                        prompt_tokens=length,
                        generation=generation,
                        answers=list(record.answers),
                        correct=contains_score(generation, record.answers),
                    )
                )
            bar.update(len(chunk))
    return report


def write_results(path: str | Path, report: RecallReport) -> None:
    """Write one JSON object per (record, prompt kind) result: the fields of `RecallResult`."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for result in report.results:
            handle.write(json.dumps(asdict(result), ensure_ascii=False) + "\n")


def load_model_and_tokenizer(
    model_name: str,
    *,
    tokenizer_name: str | None = None,
    dtype: str = "float32",
    device: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an `AutoModelForCausalLM` in eval mode and its tokenizer, set up for left-padded batches.

    The pad token defaults to the EOS token when the tokenizer has none (GPT-2); padded positions are masked by
    the attention mask.
    """
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"Unknown dtype {dtype!r}; expected auto, float32, bfloat16 or float16.")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or model_name, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"The tokenizer of {tokenizer_name or model_name} has neither a pad nor an EOS token; add a pad "
                f"token to it before batching."
            )
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        model_name, dtype=dtype if dtype == "auto" else getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval(), tokenizer


__all__ = [
    "PROMPT_KINDS",
    "RecallRecord",
    "RecallReport",
    "RecallResult",
    "build_prompt",
    "contains_score",
    "evaluate_recall",
    "first_line",
    "generate_continuations",
    "load_model_and_tokenizer",
    "load_records",
    "model_position_limit",
    "write_results",
]
