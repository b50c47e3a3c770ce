"""JRT-Prompt: read the document twice before answering (docs/reference_architecture.md §2.2; usage:
docs/evaluation.md). The question comes first, so the second read happens knowing what is asked:

    read once (default):  document + " " + query
    JRT-Prompt:           header + " " + document + "\\n" + document + " " + query

The header is the natural-language question (document QA) or "Information about {Key}." (information
extraction); the query is the completion-style question ("The capital of Xanadu is") or "{Key}:". The builders
here reproduce the reference lm-eval tasks character for character, including their whitespace and punctuation
handling, one template per task:

    family       template    reference task                  query             header
    extraction   "swde"      based_swde / based_swde_twice   key               "Information about {Key}."
    extraction   "fda"       based_fda / based_fda_twice     key               "Information about {Key}."
    qa           "drop"      based_drop / _twice             question          orig_question
    qa           "nq"        based_nq_* / _twice             question          orig_question
    qa           "triviaqa"  based_triviaqa / _twice         question          orig_question
    qa           "squad"     based_squad / _twice            completion text   question

`"extraction"` is an alias of `"swde"` and `"qa"` an alias of `"drop"`: use them for your own documents.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# ----------------------------------------------------------------------------------------------------- Prompt templates


def _capitalize_first(text: str) -> str:
    """Upper-case the first character only (unlike `str.capitalize`, which lower-cases the rest)."""
    return text[:1].upper() + text[1:]


def _remove_trailing(text: str, suffix: str) -> str:
    """Remove `suffix` from the end of `text` as many times as it occurs there, case-insensitively."""
    while suffix and text.lower().endswith(suffix.lower()):
        text = text[: -len(suffix)]
    return text


def _ensure_period(text: str) -> str:
    return text if text.endswith(".") else text + "."


@dataclass(frozen=True)
class _Document:
    """The parts of a prompt: read once = `read_once`; repeated k times = header + " " + (k - 1) x (`text` + "\\n")
    + `last`, where `last` is the final copy of the document followed by the query."""

    header: str
    text: str
    last: str
    read_once: str


def _swde(context: str, question: str, header: str | None) -> _Document:
    # The SWDE export appends a summary block; the reference cuts the document before it.
    text = _remove_trailing(context.split("Summary of information above...")[0], question + ":")
    key = _capitalize_first(question)
    read_once = text.strip("\n").strip().strip("\n").strip().strip(".") + ". " + key + ":"
    twice = _ensure_period(text.strip("\n").strip(".").strip().strip("\n").strip())
    header = f"Information about {key.strip(':')}." if header is None else header
    return _Document(header, twice, twice + " " + key + ":", read_once)


def _fda(context: str, question: str, header: str | None) -> _Document:
    text = _ensure_period(_remove_trailing(context, question + ":").strip("\n").strip("."))
    key = _capitalize_first(question)
    header = f"Information about {key.strip(':')}." if header is None else header
    return _Document(header, text, text + " " + key + ":", text + " " + key + ":")


def _qa(context: str, question: str, header: str, *, remove_once_exact: bool = False) -> _Document:
    """The shared QA rules; `context` arrives stripped (and cleaned), `header` final."""
    question = question.strip()
    if remove_once_exact:  # based_nq's read-once prompt removes a trailing question once, case-sensitively
        read_once_context = context[: -len(question)] if question and context.endswith(question) else context
    else:
        read_once_context = _remove_trailing(context, question)
    twice = _remove_trailing(context, question).strip().strip(".").strip() + "."
    return _Document(header, twice, twice + " " + question, read_once_context.strip().strip(".") + ". " + question)


def _drop(context: str, question: str, header: str | None) -> _Document:
    return _qa(context.strip(), question, (question if header is None else header).strip(":"))


def _nq(context: str, question: str, header: str | None) -> _Document:
    header = (question if header is None else header).strip(":")
    return _qa(context.strip(), question, header, remove_once_exact=True)


def _triviaqa(context: str, question: str, header: str | None) -> _Document:
    # The TriviaQA export marks paragraphs, documents and titles; the reference drops the markers and, unlike the
    # other QA tasks, keeps colons around the header.
    context = re.sub(r"\[PAR\]|\[DOC\]|\[TLE\]", "", context.strip())
    return _qa(context, question, question if header is None else header)


def _squad(context: str, question: str, header: str | None) -> _Document:
    # SQuAD-completion: the read-once prompt is the passage followed by the completion statement; the repeated
    # prompt shows the passage as is (not stripped), then the read-once prompt.
    read_once = (context + " " + question.strip()).strip()
    return _Document(question if header is None else header, context, read_once, read_once)


_TEMPLATES: dict[str, Callable[[str, str, str | None], _Document]] = {
    "swde": _swde, "fda": _fda, "drop": _drop, "nq": _nq, "triviaqa": _triviaqa, "squad": _squad}
_ALIASES = {"extraction": "swde", "qa": "drop"}

PROMPT_TEMPLATES: tuple[str, ...] = (*_ALIASES, *_TEMPLATES)
"""Names accepted by `template=`: the two families (`"extraction"`, `"qa"`) and the six reference tasks."""

EXTRACTION_TEMPLATES: frozenset[str] = frozenset({"extraction", "swde", "fda"})
"""Templates whose `question` is an attribute key (SWDE/FDA style) rather than a question."""


# Between two copies of the document in a JRT-Prompt (the reference's `*_twice` tasks).
DOCUMENT_SEPARATOR = "\n"


def _check_repeats(repeats: int) -> None:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"`repeats` must be a positive integer (1 = read once, 2 = JRT-Prompt), got {repeats!r}.")


def read_twice(text: str, repeats: int = 2) -> str:
    """JRT-Prompt in its simplest form, for text without a separate question: `text` `repeats` times, joined by
    `DOCUMENT_SEPARATOR` (what `jrt generate --jrt-prompt` feeds the model)."""
    _check_repeats(repeats)
    return DOCUMENT_SEPARATOR.join([text] * repeats)


def jrt_prompt(context: str, question: str, *, repeats: int = 2, template: str = "qa",
               header: str | None = None) -> str:
    """Build a JRT-Prompt (the document `repeats` times) or, with `repeats=1`, the default read-once prompt.

    With `repeats=2` the result is exactly the reference `*_twice` task prompt and with `repeats=1` the reference
    default prompt. Larger values repeat the document more often:
    `header + " " + "\\n".join([document] * repeats) + " " + query`.

    Args:
        context: The document. For `"squad"`, the passage without the completion statement.
        question: For the extraction templates, the attribute key (`"release date"`: the prompt ends in
            `"Release date:"`). For the QA templates, the completion-style question that ends the prompt
            (`"The capital of Xanadu is"`); for `"squad"`, the completion statement that follows the passage.
        repeats: How many times the document is shown. 1 gives the read-once prompt.
        template: One of `PROMPT_TEMPLATES` (see the module docstring).
        header: The text before the first copy of the document in a repeated prompt: the natural-language question
            (the reference's `orig_question`; `question` for SQuAD). Defaults to `question` for the QA templates and
            to `"Information about {Key}."` for the extraction templates. Unused when `repeats=1`.

    Returns:
        The prompt string. Feed it to the model without a trailing space: the answer starts with one.

    Example:
        >>> jrt_prompt("Zorbin Vale was born in Ostrava.", "Zorbin Vale was born in",
        ...            header="Where was Zorbin Vale born?")
        'Where was Zorbin Vale born? Zorbin Vale was born in Ostrava.\\nZorbin Vale was born in Ostrava. Zorbin Vale was born in'
    """
    _check_repeats(repeats)
    name = _ALIASES.get(template, template)
    if name not in _TEMPLATES:
        raise ValueError(f"Unknown prompt template {template!r}; expected one of {', '.join(PROMPT_TEMPLATES)}.")
    document = _TEMPLATES[name](context, question, header)
    if repeats == 1:
        return document.read_once
    return document.header + " " + DOCUMENT_SEPARATOR.join([document.text] * (repeats - 1) + [document.last])


def default_prompt(context: str, question: str, *, template: str = "qa") -> str:
    """The reference's default (read-once) prompt: `jrt_prompt(context, question, repeats=1, template=template)`."""
    return jrt_prompt(context, question, repeats=1, template=template)


def jrt_prompts(contexts: Sequence[str], questions: Sequence[str], *, repeats: int = 2, template: str = "qa",
                headers: Sequence[str | None] | None = None) -> list[str]:
    """Batch form of `jrt_prompt`: one prompt per (context, question[, header]) triple, all with one template."""
    if len(contexts) != len(questions) or (headers is not None and len(headers) != len(contexts)):
        raise ValueError(f"Got {len(contexts)} contexts, {len(questions)} questions"
                         + ("" if headers is None else f" and {len(headers)} headers")
                         + "; pass one of each per prompt.")
    headers = [None] * len(contexts) if headers is None else headers
    return [jrt_prompt(context, question, repeats=repeats, template=template, header=header)
            for context, question, header in zip(contexts, questions, headers)]


def default_prompts(contexts: Sequence[str], questions: Sequence[str], *, template: str = "qa") -> list[str]:
    """Batch form of `default_prompt`."""
    return jrt_prompts(contexts, questions, repeats=1, template=template)


# ----------------------------------------------------------------------------------------- Truncation around the answer


def find_answer(context: str, answers: Sequence[str]) -> int | None:
    """Character offset of the first case-insensitive occurrence of any of `answers` in `context`, or None."""
    matches = [re.search(re.escape(answer), context, re.IGNORECASE) for answer in answers if answer]
    return min((match.start() for match in matches if match is not None), default=None)


def truncate_context(context: str, tokenizer: PreTrainedTokenizerBase, *, context_tokens: int = 1000,
                     answer_tokens: int = 50, answers: Sequence[str] = ()) -> str:
    """Cut `context` to a window of `context_tokens - answer_tokens` tokens around the first answer occurrence.

    The reference `--cutting_context` rule (docs/reference_architecture.md §2.2): with W the window and `a` the
    token index where the earliest case-insensitive occurrence of any of `answers` starts, keep the tokens
    `[max(0, a - W // 2), max(0, a - W // 2) + W)` of the stripped document, decoded back to text. Truncating
    *before* building the prompts gives the read-once and the JRT prompt the same information.

    When no answer occurs in the document, the window starts at the beginning (the reference centres it on the
    *end* of the document, an artefact of slicing with index -1). A document that already fits is returned stripped
    but otherwise unchanged. Tokens are counted without special tokens (no BOS), and the decoded window is
    re-encoded and shortened if needed, so the result never exceeds W tokens.

    Args:
        tokenizer: A transformers tokenizer (`encode(..., add_special_tokens=False)` and `decode`).
        context_tokens: The token budget for the document plus the answer (the reference's `context_length`).
        answer_tokens: Tokens reserved for the answer (the reference's `answer_length`).
        answers: Strings to centre the window on (the reference uses the gold answer, and for SWDE/FDA also the
            key).
    """
    window = context_tokens - answer_tokens
    if window < 1:
        raise ValueError(f"`context_tokens` ({context_tokens}) must exceed `answer_tokens` ({answer_tokens}): the "
                         "document window is their difference.")
    context = context.strip()
    token_ids = tokenizer.encode(context, add_special_tokens=False)
    if len(token_ids) <= window:
        return context
    answer_char = find_answer(context, answers)
    answer_token = 0 if answer_char is None else len(tokenizer.encode(context[:answer_char], add_special_tokens=False))
    start = max(0, answer_token - window // 2)
    end = min(len(token_ids), start + window)
    text = tokenizer.decode(token_ids[start:end], skip_special_tokens=True)
    while end > start and len(tokenizer.encode(text, add_special_tokens=False)) > window:
        end -= 1
        text = tokenizer.decode(token_ids[start:end], skip_special_tokens=True)
    return text

