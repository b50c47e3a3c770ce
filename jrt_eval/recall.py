"""Data, prompts and metric of the recall-intensive lm-eval tasks (JRT paper; docs/reference_architecture.md
§2.2), default and twice; the protocol and its departures from the reference: docs/evaluation.md.

`load_recall_dataset` (lm-eval's `custom_dataset` hook: it receives the task's `dataset_kwargs` and the run's
`--model_args` / `--metadata`) maps every document of a family (`FAMILIES`: the reference's Hub exports, through
`normalize_document`, or `jsonl`, your file in the record format of `load_records`) to one schema,

    context   the document, cut to `context_tokens - answer_tokens` tokens around the answer (`truncate_context`;
              default 1000 - 50, the paper's Table 1), counted with `truncation_tokenizer`
    question  the key (SWDE/FDA) or the completion-style question that ends the prompt
    header    the natural-language question of the JRT prompt ("" = the template's default)
    answers   the gold answers (a non-empty list)
    template  a `jrt_prompt.PROMPT_TEMPLATES` name
    id, line  the record's id and JSONL line (`jsonl` family; "" and 0 for the Hub data)

and the prompts are `jrt_prompt.jrt_prompt(..., repeats=1)` (default tasks) or `repeats=2` (`_twice` tasks);
generation is greedy, 48 tokens, cut at the first newline, and scored by `contains` (`process_results`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jrt_prompt import EXTRACTION_TEMPLATES, PROMPT_TEMPLATES, jrt_prompt, truncate_context

# family -> (Hub path, config name, template, whether the window is centred on the answers)
FAMILIES: dict[str, tuple[str | None, str | None, str, bool]] = {
    "swde": ("hazyresearch/based-swde-v2", "default", "swde", True),
    "fda": ("hazyresearch/based-fda", "default", "fda", True),
    "squad": ("hazyresearch/based-squad", None, "squad", True),
    "drop": ("hazyresearch/based_drop", None, "drop", False),
    "triviaqa": ("hazyresearch/based_triviaqa", None, "triviaqa", False),
    "nq_512": ("hazyresearch/based_nq_512", None, "nq", True),
    "nq_1024": ("hazyresearch/based_nq_1024", None, "nq", True),
    "nq_2048": ("hazyresearch/based_nq_2048", None, "nq", True),
    "jsonl": (None, None, "qa", True),
}


# --------------------------------------------------------------------- Your own documents: the JSON Lines record format


@dataclass(frozen=True)
class RecallRecord:
    """One validated JSONL record; `line` is its 1-based line number in the file."""

    line: int
    id: str
    context: str
    question: str
    answers: tuple[str, ...]
    template: str
    header: str | None = None


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
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise ValueError("'answers' must be a non-blank string or a non-empty list of non-blank strings")
    header = raw.get("header")
    if header is not None and not isinstance(header, str):
        raise ValueError(f"'header' must be a string, got {type(header).__name__}")
    record_id = raw.get("id", f"line-{line}")
    if not isinstance(record_id, (str, int)) or isinstance(record_id, bool):
        raise ValueError(f"'id' must be a string or an integer, got {type(record_id).__name__}")
    return RecallRecord(line, str(record_id), context, question, tuple(answers), template, header)


def load_records(path: str | Path, *, limit: int | None = None) -> list[RecallRecord]:
    """Read and validate a JSONL file of records (format: docs/evaluation.md, "jrt eval-recall").

    `path` is UTF-8 without a byte-order mark; `limit` keeps the first records only. A missing file raises
    `FileNotFoundError`; any other problem `ValueError`, naming the file (and `FILE:LINE:` for a line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}")
    data = path.read_bytes()
    if data.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{path} starts with a byte-order mark (BOM); save it as UTF-8 without BOM")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 (byte {error.start} cannot be decoded); convert it, e.g. "
                         "`iconv -f latin1 -t utf-8`") from None
    records: list[RecallRecord] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
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


def record_doc(record: RecallRecord) -> dict:
    """A JSONL record in the task schema."""
    return {"context": record.context, "question": record.question, "header": record.header or "",
            "answers": list(record.answers), "template": record.template, "id": record.id, "line": record.line}


# --------------------------------------------------------------------------------------- Hub exports -> the task schema


def _answers(value: Any) -> list[str]:
    values = [value] if isinstance(value, str) else list(value or [])
    return [answer for answer in values if isinstance(answer, str) and answer.strip()]


def normalize_document(family: str, doc: dict) -> dict | None:
    """One Hub export row -> `{context, question, header, answers, template, id}`; None when it has no answer."""
    template = FAMILIES[family][2]
    if family in ("swde", "fda"):
        context, question, header, answers = doc["text"], doc["key"], "", _answers(doc["value"])
    elif family == "squad":
        # `text` is the passage followed by the completion statement; `context` holds the passage and "Question:".
        text = doc["text"].strip()
        passage = doc.get("context", "").split("Question:")[0].strip()
        if passage and text.startswith(passage):
            context, question = passage, text[len(passage) :].strip()
        else:
            context, question = text, ""
        header, answers = doc.get("question", "") or "", _answers(doc["value"])
    else:
        context, question = doc["context"], doc["question"]
        header, answers = doc.get("orig_question", "") or "", _answers(doc["answers"])
    if not answers:
        return None
    return {"context": context, "question": question, "header": header, "answers": answers, "template": template,
            "id": str(doc.get("id", "")), "line": 0}


@functools.cache
def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    # AutoTokenizer reads config.json first: with `jrt_rnn` registered it neither falls back to a bare config ("You
    # are using a model of type jrt_rnn to instantiate a model of type ``") nor asks about the folder's remote code.
    import modeling_jrt  # noqa: F401

    return AutoTokenizer.from_pretrained(name)


def truncation_tokenizer(metadata: dict):
    """The tokenizer that counts document tokens: the run's `tokenizer` (from `--model_args` / `--metadata`), else
    its `pretrained` (a name or an object), else GPT-2's (the reference's)."""
    for key in ("tokenizer", "pretrained"):
        value = metadata.get(key)
        if isinstance(value, str) and value:
            return _load_tokenizer(value)
        if value is not None and hasattr(value, "encode") and hasattr(value, "decode"):
            return value
    return _load_tokenizer("gpt2")


def load_recall_dataset(family: str, *, data_files: str | None = None, split: str = "validation",
                        context_tokens: int = 1000, answer_tokens: int = 50, limit_docs: int | None = None,
                        **metadata: Any):
    """lm-eval `custom_dataset`: the `family` data as a `DatasetDict` with one `split`, in the task schema.

    Args:
        family: A key of `FAMILIES`.
        data_files: A local JSON Lines file instead of the Hub data set (same columns as the export; for `jsonl`,
            the record format of `load_records`).
        split: The Hub split read (the reference evaluates `validation`); the result's split has this name.
        context_tokens, answer_tokens: The document window is their difference (tokens).
        limit_docs: Keep only the first N documents (the truncation tokenizes every document kept).
        metadata: The run's model arguments and metadata (`tokenizer`, `pretrained`, ...); see `truncation_tokenizer`.
    """
    import datasets

    if family not in FAMILIES:
        raise ValueError(f"Unknown recall family {family!r}; expected one of {', '.join(FAMILIES)}.")
    if answer_tokens < 0 or context_tokens <= answer_tokens:
        raise ValueError(f"`answer_tokens` ({answer_tokens}) must be >= 0 and `context_tokens` ({context_tokens}) "
                         "larger.")
    path, name, _, centred = FAMILIES[family]
    if family == "jsonl":
        if data_files is None:
            raise ValueError("The jrt_jsonl tasks need `data_files=` (a JSON Lines file of records).")
        docs = [record_doc(record) for record in load_records(data_files, limit=limit_docs)]
    else:
        if data_files is not None:
            rows = datasets.load_dataset("json", data_files={split: str(data_files)})[split]
        else:
            rows = datasets.load_dataset(path, name, split=split)
        rows = rows if limit_docs is None else rows.select(range(min(limit_docs, len(rows))))
        docs = [doc for doc in (normalize_document(family, row) for row in rows) if doc is not None]
    tokenizer = truncation_tokenizer(metadata)
    for doc in docs:
        doc["context"] = window_context(doc, tokenizer, context_tokens, answer_tokens, centred=centred)
    return datasets.DatasetDict({split: datasets.Dataset.from_list(docs)})


def window_context(doc: dict, tokenizer, context_tokens: int, answer_tokens: int, *, centred: bool = True) -> str:
    """`doc`'s document cut by `truncate_context`, centred (when `centred`) on its answers and, for the extraction
    templates, its key."""
    anchors = doc["answers"] + ([doc["question"]] if doc["template"] in EXTRACTION_TEMPLATES else [])
    return truncate_context(doc["context"], tokenizer, context_tokens=context_tokens, answer_tokens=answer_tokens,
                            answers=anchors if centred else ())


# ----------------------------------- Prompts and metric (the task YAMLs' doc_to_text / doc_to_target / process_results)


def _prompt(doc: dict, repeats: int) -> str:
    return jrt_prompt(doc["context"], doc["question"], repeats=repeats, template=doc["template"],
                      header=doc["header"] or None)


def default_prompt(doc: dict) -> str:
    """The read-once prompt of a task document."""
    return _prompt(doc, 1)


def twice_prompt(doc: dict) -> str:
    """The JRT-Prompt (document twice) of a task document."""
    return _prompt(doc, 2)


def first_answer(doc: dict) -> str:
    """The target shown in logged samples: the first gold answer, with its leading space."""
    return " " + doc["answers"][0]


def contains_score(generation: str, answers: Sequence[str]) -> bool:
    """True when any answer occurs in `generation`, case-insensitively (the reference "contains" metric)."""
    return any(re.search(re.escape(answer), generation, re.IGNORECASE) for answer in answers)


def first_line(text: str) -> str:
    """The continuation up to its first newline (the reference's `until: ["\\n"]`)."""
    return text.split("\n", 1)[0]


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval `process_results`: `contains` of the first line generated."""
    return {"contains": float(contains_score(first_line(results[0]), doc["answers"]))}


__all__ = ["FAMILIES", "RecallRecord", "contains_score", "default_prompt", "first_answer", "first_line",
           "load_recall_dataset", "load_records", "normalize_document", "process_results", "record_doc",
           "truncation_tokenizer", "twice_prompt", "window_context"]
