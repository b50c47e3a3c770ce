"""JRT-Prompt builders against hand-written reference strings (docs/reference_architecture.md §2.2), truncation,
repeat_to_fill."""

from __future__ import annotations

import pytest
import torch

from jrt_prompt import (
    PROMPT_TEMPLATES,
    default_prompt,
    default_prompts,
    jrt_prompt,
    jrt_prompts,
    repeat_to_fill,
    truncate_context,
)

# Each case: template, context, question, header, expected read-once prompt, expected twice prompt. The expected
# strings were written by hand from the reference task code's string operations (based_*/task.py doc_to_text).
REFERENCE_CASES = [
    pytest.param(
        "swde",
        # The summary block is cut off, then the trailing "founded:" (any case) is removed.
        "\nName: Kalo Company\nFounded: 1871 .\nfounded:Summary of information above... Founded: 1871",
        "founded",
        None,
        # strip("\n").strip().strip("\n").strip().strip(".") + "." -> "...1871 ." (the space survives)
        "Name: Kalo Company\nFounded: 1871 . Founded:",
        # strip("\n").strip(".").strip()... -> "...1871", then "." appended
        "Information about Founded. Name: Kalo Company\nFounded: 1871.\nName: Kalo Company\nFounded: 1871. Founded:",
        id="swde",
    ),
    pytest.param(
        "fda",
        "Recall notice for the Qx pump. Device: infusion pump...\nDEVICE:device:",
        "device",
        None,
        "Recall notice for the Qx pump. Device: infusion pump. Device:",
        "Information about Device. Recall notice for the Qx pump. Device: infusion pump.\n"
        "Recall notice for the Qx pump. Device: infusion pump. Device:",
        id="fda",
    ),
    pytest.param(
        "fda",
        # Only "\n" and "." are stripped: a trailing space stays, and "." is appended after it.
        "Product code: ZZ9 \n",
        "mAX dose",
        None,
        "Product code: ZZ9 . MAX dose:",
        "Information about MAX dose. Product code: ZZ9 .\nProduct code: ZZ9 . MAX dose:",
        id="fda-whitespace-key-case",
    ),
    pytest.param(
        "drop",
        "  The Rams scored 3 touchdowns.. How many touchdowns did the Rams score? ",
        " how many touchdowns did the Rams score? ",
        "Touchdowns?:",
        "The Rams scored 3 touchdowns. how many touchdowns did the Rams score?",
        "Touchdowns? The Rams scored 3 touchdowns.\nThe Rams scored 3 touchdowns. how many touchdowns did the Rams score?",
        id="drop",
    ),
    pytest.param(
        "nq",
        # Read once, NQ removes the trailing question only on an exact (case-sensitive) match.
        "  The Rams scored 3 touchdowns.. How many touchdowns did the Rams score? ",
        " how many touchdowns did the Rams score? ",
        "Touchdowns?:",
        "The Rams scored 3 touchdowns.. How many touchdowns did the Rams score?. "
        "how many touchdowns did the Rams score?",
        "Touchdowns? The Rams scored 3 touchdowns.\nThe Rams scored 3 touchdowns. how many touchdowns did the Rams score?",
        id="nq",
    ),
    pytest.param(
        "nq",
        "The Nile flows north. The Nile flows",
        "The Nile flows",
        None,
        "The Nile flows north. The Nile flows",
        "The Nile flows The Nile flows north.\nThe Nile flows north. The Nile flows",
        id="nq-exact-suffix",
    ),
    pytest.param(
        "triviaqa",
        " [DOC] [TLE] Kalo [PAR] Kalo was born in Ostrava. ",
        " Kalo was born in ",
        "Where was Kalo born?:",
        "Kalo  Kalo was born in Ostrava. Kalo was born in",
        # TriviaQA keeps the header's colon.
        "Where was Kalo born?: Kalo  Kalo was born in Ostrava.\nKalo  Kalo was born in Ostrava. Kalo was born in",
        id="triviaqa",
    ),
    pytest.param(
        "squad",
        "Ostrava is a city in Czechia. ",
        "The city is in ",
        "Which country is Ostrava in?",
        "Ostrava is a city in Czechia.  The city is in",
        # The first copy is the passage as given; the last is the read-once prompt.
        "Which country is Ostrava in? Ostrava is a city in Czechia. \nOstrava is a city in Czechia.  The city is in",
        id="squad",
    ),
]


@pytest.mark.parametrize("template, context, question, header, expected_once, expected_twice", REFERENCE_CASES)
def test_reference_prompt_strings(template, context, question, header, expected_once, expected_twice):
    assert default_prompt(context, question, template=template) == expected_once
    assert jrt_prompt(context, question, repeats=1, template=template, header=header) == expected_once
    assert jrt_prompt(context, question, template=template, header=header) == expected_twice


def test_family_aliases_follow_swde_and_drop():
    swde_case, drop_case = REFERENCE_CASES[0].values, REFERENCE_CASES[3].values
    for alias, (template, context, question, header, once, twice) in (("extraction", swde_case), ("qa", drop_case)):
        assert default_prompt(context, question, template=alias) == once
        assert jrt_prompt(context, question, template=alias, header=header) == twice
    assert set(PROMPT_TEMPLATES) == {"extraction", "qa", "swde", "fda", "drop", "nq", "triviaqa", "squad"}


def test_header_defaults_and_more_repeats():
    assert jrt_prompt("Kalo lives in Ostrava.", "Kalo lives in") == (
        "Kalo lives in Kalo lives in Ostrava.\nKalo lives in Ostrava. Kalo lives in"
    )
    assert jrt_prompt("Kalo lives in Ostrava", "Kalo lives in", repeats=3, header="Where?") == (
        "Where? Kalo lives in Ostrava.\nKalo lives in Ostrava.\nKalo lives in Ostrava. Kalo lives in"
    )
    assert jrt_prompt("Color: teal", "color", template="extraction", header="Paint.", repeats=3) == (
        "Paint. Color: teal.\nColor: teal.\nColor: teal. Color:"
    )


def test_batch_forms_match_single_prompts():
    contexts = ["Kalo lives in Ostrava.", "Mira lives in Brno."]
    questions = ["Kalo lives in", "Mira lives in"]
    headers = ["Where does Kalo live?", None]
    assert jrt_prompts(contexts, questions, headers=headers) == [
        jrt_prompt(c, q, header=h) for c, q, h in zip(contexts, questions, headers)
    ]
    assert default_prompts(contexts, questions, template="nq") == [
        default_prompt(c, q, template="nq") for c, q in zip(contexts, questions)
    ]
    with pytest.raises(ValueError, match="2 contexts, 1 questions"):
        jrt_prompts(contexts, questions[:1])


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_bad_repeats(repeats):
    with pytest.raises(ValueError, match="repeats"):
        jrt_prompt("a", "b", repeats=repeats)


def test_unknown_template():
    with pytest.raises(ValueError, match="'squad_v2'.*extraction, qa"):
        jrt_prompt("a", "b", template="squad_v2")


# ----------------------------------------------------------------------------------------------------------------
# Truncation
# ----------------------------------------------------------------------------------------------------------------


def _filler(start: int, count: int) -> str:
    return " ".join(f"Company number {i} was founded in year {1700 + i}." for i in range(start, start + count))


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_truncation_centres_the_window_on_the_answer(byte_bpe_tokenizer):
    tokenizer = byte_bpe_tokenizer
    fact = "The mascot of Kalo Company is Zorbin Vale."
    document = _filler(0, 40) + " " + fact + " " + _filler(40, 40)
    window = 100 - 20
    assert _token_count(tokenizer, document) > 4 * window
    truncated = truncate_context(document, tokenizer, context_tokens=100, answer_tokens=20, answers=["zorbin vale"])
    assert truncated in document
    assert "Zorbin Vale" in truncated
    assert window - 2 <= _token_count(tokenizer, truncated) <= window
    # The answer starts `window // 2` tokens into the window (give or take a token merged across the cut).
    answer_offset = _token_count(tokenizer, truncated[: truncated.index("Zorbin Vale")])
    assert abs(answer_offset - window // 2) <= 1


def test_truncation_uses_the_earliest_answer_and_clamps_at_the_start(byte_bpe_tokenizer):
    tokenizer = byte_bpe_tokenizer
    document = "Kalo Company was founded in 1871. " + _filler(0, 80) + " Its mascot is Zorbin Vale."
    truncated = truncate_context(
        document, tokenizer, context_tokens=60, answer_tokens=10, answers=["Zorbin Vale", "KALO COMPANY"]
    )
    assert document.startswith(truncated)
    assert _token_count(tokenizer, truncated) <= 50


@pytest.mark.parametrize("answers", [(), ("Ostrava",)], ids=["no-answer", "absent-answer"])
def test_truncation_without_an_answer_keeps_the_start(byte_bpe_tokenizer, answers):
    tokenizer = byte_bpe_tokenizer
    document = "  " + _filler(0, 60) + "  "
    truncated = truncate_context(document, tokenizer, context_tokens=70, answer_tokens=20, answers=answers)
    assert document.strip().startswith(truncated)
    assert 48 <= _token_count(tokenizer, truncated) <= 50


def test_short_documents_are_only_stripped(byte_bpe_tokenizer):
    document = "\n Kalo Company was founded in 1871. \n"
    assert truncate_context(document, byte_bpe_tokenizer, context_tokens=1000, answers=["1871"]) == document.strip()


@pytest.mark.parametrize("template", ["extraction", "fda", "qa", "nq", "triviaqa", "squad"])
def test_truncated_prompts_respect_the_budget(byte_bpe_tokenizer, template):
    """Both prompt kinds hold the same window: about `window` document tokens read once, `2 * window` twice."""
    tokenizer = byte_bpe_tokenizer
    document = _filler(0, 30) + " The mascot of Kalo Company is Zorbin Vale. " + _filler(30, 30)
    question = "mascot" if template in ("extraction", "fda") else "The mascot of Kalo Company is"
    header = "What is the mascot of Kalo Company?"
    context_tokens, answer_tokens = 120, 30
    window = context_tokens - answer_tokens
    truncated = truncate_context(
        document, tokenizer, context_tokens=context_tokens, answer_tokens=answer_tokens, answers=["Zorbin Vale"]
    )
    once = default_prompt(truncated, question, template=template)
    twice = jrt_prompt(truncated, question, template=template, header=header)
    assert "Zorbin Vale" in once and twice.count("Zorbin Vale") == 2
    query_tokens = _token_count(tokenizer, question) + 3  # the key's capital letter, ":", joining spaces
    assert _token_count(tokenizer, once) <= window + query_tokens
    assert _token_count(tokenizer, twice) <= 2 * window + _token_count(tokenizer, header) + query_tokens + 3


def test_truncation_rejects_an_empty_window(byte_bpe_tokenizer):
    with pytest.raises(ValueError, match=r"`context_tokens` \(50\) must exceed `answer_tokens` \(50\)"):
        truncate_context("text", byte_bpe_tokenizer, context_tokens=50, answer_tokens=50)


# ----------------------------------------------------------------------------------------------------------------
# repeat_to_fill
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, length, expected",
    [
        ([1, 2, 3], 3, [1, 2, 3]),
        ([1, 2, 3], 6, [1, 2, 3, 1, 2, 3]),
        ([1, 2, 3], 8, [2, 3, 1, 2, 3, 1, 2, 3]),
        ([1, 2, 3], 4, [3, 1, 2, 3]),
        ([7], 5, [7, 7, 7, 7, 7]),
    ],
    ids=["exact", "twice", "partial-first-copy", "one-extra", "single-token"],
)
def test_repeat_to_fill_ends_with_a_whole_copy(prompt, length, expected):
    assert repeat_to_fill(prompt, length) == expected
    tensor = repeat_to_fill(torch.tensor(prompt, dtype=torch.int32), length)
    assert tensor.dtype == torch.int32 and tensor.tolist() == expected


def test_repeat_to_fill_2d_is_row_wise():
    prompt_ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    filled = repeat_to_fill(prompt_ids, 7)
    assert filled.shape == (2, 7)
    assert filled.tolist() == [repeat_to_fill([1, 2, 3], 7), repeat_to_fill([4, 5, 6], 7)]


@pytest.mark.parametrize(
    "prompt, length, error, match",
    [
        ([1, 2, 3], 2, ValueError, r"`length` \(2\) is shorter than the prompt \(3 tokens\)"),
        ([], 4, ValueError, "empty"),
        (torch.zeros(1, 1, 3, dtype=torch.long), 4, ValueError, r"shape \(1, 1, 3\)"),
        ((1, 2), 4, TypeError, "tuple"),
    ],
    ids=["too-short", "empty", "3d", "tuple"],
)
def test_repeat_to_fill_errors(prompt, length, error, match):
    with pytest.raises(error, match=match):
        repeat_to_fill(prompt, length)


def test_read_twice_repeats_the_text_with_the_jrt_prompt_separator():
    """`jrt generate --jrt-prompt` and `jrt_prompt` join the copies of a document the same way."""
    from jrt_prompt import DOCUMENT_SEPARATOR, read_twice

    assert read_twice("a b") == "a b\na b" == DOCUMENT_SEPARATOR.join(["a b"] * 2)
    assert read_twice("x", 3) == "x\nx\nx"
    with pytest.raises(ValueError, match="repeats"):
        read_twice("x", 0)
