"""`jrt eval-recall`: record loading and validation, the "contains" scorer, the report, end to end on tiny models."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import RECALL_FIXTURE, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_jrt
from jrt_cli import recall_eval
from jrt_cli.main import main
from jrt_cli.recall_eval import (
    RecallRecord,
    RecallReport,
    RecallResult,
    build_prompt,
    contains_score,
    evaluate_recall,
    first_line,
    load_records,
)
from jrt_cli.recall_fixture import make_fixture_records


# ----------------------------------------------------------------------------------------------------------------
# Scorer and report (no model)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "generation, answers, expected",
    [
        (" Ostrava, in the north", ["ostrava"], True),
        (" OSTRAVA", ["Ostrava"], True),
        (" Brno", ["Ostrava", "brno"], True),
        (" Prague", ["Ostrava", "Brno"], False),
        (" 345 units", ["3.5"], False),  # the answer is matched literally, not as a regex
        (" 3.5 units", ["3.5"], True),
        ("", ["Ostrava"], False),
    ],
)
def test_contains_score(generation, answers, expected):
    assert contains_score(generation, answers) is expected


def test_first_line():
    assert first_line(" 1871\nKalo Company was") == " 1871"
    assert first_line("\nanything") == ""
    assert first_line(" no newline") == " no newline"


def _result(line: int, kind: str, correct: bool) -> RecallResult:
    return RecallResult(f"r{line}", line, kind, "prompt", 3, "gen", ["a"], correct)


def test_report_accuracy_and_table():
    report = RecallReport(prompt_kinds=("default", "jrt"))
    report.results = [
        _result(1, "default", False), _result(1, "jrt", True),
        _result(2, "default", True), _result(2, "jrt", True),
        _result(3, "default", False), _result(3, "jrt", False),
    ]
    report.skipped = [(4, "too long")]
    assert report.accuracy() == {"default": (1, 3), "jrt": (2, 3)}
    assert report.format_table().splitlines() == [
        "prompt   correct  total  contains",
        "default        1      3     33.3%",
        "jrt            2      3     66.7%",
        "skipped 1 of 4 records (prompt too long)",
    ]


def test_evaluate_recall_scores_the_generations(byte_bpe_tokenizer, monkeypatch):
    """With generation replaced by hand-made continuations, accuracy counts exactly the matching ones."""
    records = load_records(RECALL_FIXTURE, limit=4)
    answers = {record.id: record.answers[0] for record in records}
    canned = {  # (id, kind) -> continuation; correct: syn-000 twice, syn-001 jrt only, syn-003 default only
        ("syn-000", "default"): f" {answers['syn-000'].upper()}",
        ("syn-000", "jrt"): f" {answers['syn-000']} and more",
        ("syn-001", "jrt"): f"{answers['syn-001']}",
        ("syn-003", "default"): f" it is {answers['syn-003']}",
    }
    prompts_seen: dict[str, tuple[str, str]] = {}
    for record in records:
        for kind in ("default", "jrt"):
            prompts_seen[build_prompt(record, byte_bpe_tokenizer, prompt_kind=kind)] = (record.id, kind)

    def fake_generate(model, tokenizer, prompts, *, max_new_tokens):
        assert max_new_tokens == 48
        return [canned.get(prompts_seen[prompt], " wrong") for prompt in prompts]

    monkeypatch.setattr(recall_eval, "generate_continuations", fake_generate)
    position_free_model = SimpleNamespace(config=SimpleNamespace())  # no max_position_embeddings: nothing skipped
    report = evaluate_recall(position_free_model, byte_bpe_tokenizer, records, batch_size=3, progress=False)
    assert report.accuracy() == {"default": (2, 4), "jrt": (2, 4)}
    assert [(r.id, r.prompt_kind) for r in report.results if r.correct] == sorted(canned, key=list(canned).index)


# ----------------------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------------------


def test_shipped_fixture_is_the_generated_one():
    lines = RECALL_FIXTURE.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == make_fixture_records()


def test_fixture_records_load_and_contain_their_answers():
    records = load_records(RECALL_FIXTURE)
    assert len(records) == 36
    assert {record.template for record in records} == {"extraction", "qa"}
    assert records[0] == RecallRecord(
        line=1,
        id="syn-000",
        context=records[0].context,
        question=records[0].question,
        answers=records[0].answers,
        template="extraction",
    )
    for record in records:
        assert all(answer in record.context for answer in record.answers)
    assert [record.id for record in load_records(RECALL_FIXTURE, limit=3)] == ["syn-000", "syn-001", "syn-002"]


def test_answers_stay_inside_the_truncated_prompts(byte_bpe_tokenizer):
    for record in load_records(RECALL_FIXTURE):
        for kind, copies in (("default", 1), ("jrt", 2)):
            prompt = build_prompt(record, byte_bpe_tokenizer, prompt_kind=kind, context_tokens=60, answer_tokens=10)
            assert prompt.lower().count(record.answers[0].lower()) >= copies, (record.id, kind)


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"context": "Kalo was born in Ostrava.", "question": "Kalo was born in", "answers": "Ostrava"})


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"context": "Kalo", "question": "q", ', "invalid JSON"),
        ('["context", "question"]', "expected a JSON object, got list"),
        ('{"question": "q", "answers": ["a"]}', "missing or non-string field 'context'"),
        ('{"context": "  \\n ", "question": "q", "answers": ["a"]}', "empty document"),
        ('{"context": "doc", "answers": ["a"]}', "template 'qa' needs a non-empty string field 'question'"),
        ('{"context": "doc", "key": "", "answers": ["a"]}', "template 'extraction' needs .* field 'key'"),
        ('{"context": "doc", "question": "q", "template": "fda", "answers": ["a"]}', "template 'fda' needs .* 'key'"),
        ('{"context": "doc", "question": "q", "answers": []}', "'answers' must be a non-empty"),
        ('{"context": "doc", "question": "q", "answers": ["a", ""]}', "'answers' must be a non-empty"),
        ('{"context": "doc", "question": "q"}', "'answers' must be a non-empty"),
        ('{"context": "doc", "question": "q", "answers": "a", "template": "hotpot"}', "unknown template 'hotpot'"),
        ('{"context": "doc", "question": "q", "answers": "a", "header": 3}', "'header' must be a string"),
        ('{"context": "doc", "question": "q", "answers": "a", "id": [1]}', "'id' must be a string or an integer"),
    ],
)
def test_bad_records_name_their_line(tmp_path, bad_line, message):
    path = _write(tmp_path, [GOOD, "", bad_line, GOOD])
    with pytest.raises(ValueError, match=f"data.jsonl:3: {message}"):
        load_records(path)
    assert len(load_records(path, limit=1)) == 1  # reading stops before the bad line


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no data file"):
        load_records(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="holds no records"):
        load_records(_write(tmp_path, ["", "  "]))


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    path = _write(tmp_path, [GOOD, "{not json"])
    assert main(["eval-recall", "--model", str(tmp_path), "--data", str(path)]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("jrt eval-recall: error: ") and error.endswith("data.jsonl:2: invalid JSON "
                                                                           "(Expecting property name enclosed in "
                                                                           "double quotes at column 2)")


# ----------------------------------------------------------------------------------------------------------------
# End to end on tiny models
# ----------------------------------------------------------------------------------------------------------------


def _eval(model_dir, output, *extra: str) -> list[str]:
    argv = ["eval-recall", "--model", str(model_dir), "--data", str(RECALL_FIXTURE), "--output", str(output),
            "--context-tokens", "80", "--answer-tokens", "20", "--max-new-tokens", "6", "--no-progress", *extra]
    assert main(argv) == 0
    return [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def tiny_jrt_dir(tmp_path, byte_bpe_tokenizer):
    config = tiny_config(vocab_size=len(byte_bpe_tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         prefix_pad_token_id=0)
    model_dir = tmp_path / "jrt"
    modeling_jrt.JRTRNNForCausalLM(config).save_pretrained(model_dir)
    byte_bpe_tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.fixture
def tiny_llama_dir(tmp_path, byte_bpe_tokenizer):
    config = LlamaConfig(vocab_size=len(byte_bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=160, pad_token_id=0,
                         bos_token_id=1, eos_token_id=1)
    model_dir = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    byte_bpe_tokenizer.save_pretrained(model_dir)
    return model_dir


def test_eval_recall_end_to_end_jrt(tiny_jrt_dir, tmp_path, capsys, byte_bpe_tokenizer):
    rows = _eval(tiny_jrt_dir, tmp_path / "out.jsonl", "--limit", "5", "--batch-size", "3")
    table = capsys.readouterr().out.splitlines()
    assert len(rows) == 10 and [row["id"] for row in rows[::2]] == [f"syn-00{i}" for i in range(5)]
    records = load_records(RECALL_FIXTURE, limit=5)
    for row, (record, kind) in zip(rows, [(r, k) for r in records for k in ("default", "jrt")]):
        assert set(row) == {"id", "line", "prompt_kind", "prompt", "prompt_tokens", "generation", "answers", "correct"}
        assert row["prompt_kind"] == kind and row["line"] == record.line and row["answers"] == list(record.answers)
        assert row["prompt"] == build_prompt(
            record, byte_bpe_tokenizer, prompt_kind=kind, context_tokens=80, answer_tokens=20
        )
        assert row["prompt_tokens"] == len(byte_bpe_tokenizer(row["prompt"])["input_ids"])
        assert "\n" not in row["generation"]
        assert row["correct"] == contains_score(row["generation"], row["answers"])
    correct = {kind: sum(row["correct"] for row in rows if row["prompt_kind"] == kind) for kind in ("default", "jrt")}
    assert table[0].split() == ["prompt", "correct", "total", "contains"]
    assert table[1].split()[:3] == ["default", str(correct["default"]), "5"]
    assert table[2].split()[:3] == ["jrt", str(correct["jrt"]), "5"]
    assert table[3] == "skipped 0 of 5 records (prompt too long)"


def test_eval_recall_llama_skips_prompts_longer_than_the_model(tiny_llama_dir, tmp_path, capsys, byte_bpe_tokenizer):
    # The Llama has 160 positions: with 6 new tokens, prompts of more than 154 tokens cannot run.
    rows = _eval(tiny_llama_dir, tmp_path / "out.jsonl", "--limit", "8", "--prompt", "jrt")
    table = capsys.readouterr().out.splitlines()
    lengths = {
        record.line: len(byte_bpe_tokenizer(build_prompt(record, byte_bpe_tokenizer, prompt_kind="jrt",
                                                         context_tokens=80, answer_tokens=20))["input_ids"])
        for record in load_records(RECALL_FIXTURE, limit=8)
    }
    kept = sorted(line for line, length in lengths.items() if length + 6 <= 160)
    assert 0 < len(kept) < 8, sorted(lengths.values())  # the fixture has both kinds of records at this budget
    assert [row["line"] for row in rows] == kept
    assert {row["prompt_kind"] for row in rows} == {"jrt"}
    assert len(table) == 3 and table[1].split()[:3] == ["jrt", table[1].split()[1], str(len(kept))]
    assert table[2] == f"skipped {8 - len(kept)} of 8 records (prompt too long)"


def test_llama_batched_left_padding_matches_one_by_one(tiny_llama_dir, byte_bpe_tokenizer):
    model, tokenizer = recall_eval.load_model_and_tokenizer(str(tiny_llama_dir), device="cpu")
    assert tokenizer.padding_side == "left"
    prompts = [build_prompt(record, tokenizer, prompt_kind="default", context_tokens=60, answer_tokens=20)
               for record in load_records(RECALL_FIXTURE, limit=3)]
    assert len({len(tokenizer(prompt)["input_ids"]) for prompt in prompts}) > 1  # the batch needs padding
    batched = recall_eval.generate_continuations(model, tokenizer, prompts, max_new_tokens=5)
    single = [recall_eval.generate_continuations(model, tokenizer, [prompt], max_new_tokens=5)[0] for prompt in prompts]
    assert batched == single


def test_generation_stops_at_the_first_newline(tiny_llama_dir, byte_bpe_tokenizer):
    """A model that always emits "\\n" after one token: generation stops early and the newline is cut."""
    model, tokenizer = recall_eval.load_model_and_tokenizer(str(tiny_llama_dir), device="cpu")
    newline_id = tokenizer.encode("\n", add_special_tokens=False)[0]
    word_id = tokenizer.encode("Kalo", add_special_tokens=False)[0]
    calls = []

    def scripted_logits(module, args, kwargs, output):
        calls.append(1)
        logits = torch.full_like(output.logits, -1e4)
        logits[..., word_id if len(calls) == 1 else newline_id] = 0
        output.logits = logits
        return output

    model.register_forward_hook(scripted_logits, with_kwargs=True)
    assert recall_eval.generate_continuations(model, tokenizer, ["Kalo was born in"], max_new_tokens=20) == [
        tokenizer.decode([word_id])
    ]
    assert len(calls) == 2  # stopped after the newline, not after 20 tokens
