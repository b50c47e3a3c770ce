"""`jrt eval-recall`: record loading and validation, argument checks before any work, the report, end to end on tiny
models through the lm-eval recall tasks."""

from __future__ import annotations

import json
import os

import pytest
from conftest import RECALL_FIXTURE, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_jrt
from jrt_cli import eval_recall
from jrt_cli.main import main
from jrt_eval.jsonl_recall import (
    RecallRecord,
    RecallReport,
    RecallResult,
    build_prompt,
    contains_score,
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
    assert report.accuracy() == {"default": (1, 3), "jrt": (2, 3)}
    assert report.format_table().splitlines() == [
        "prompt   correct  total  contains",
        "default        1      3     33.3%",
        "jrt            2      3     66.7%",
    ]


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
        ('{"context": "doc", "question": "q", "answers": []}', "'answers' must be a non-blank"),
        ('{"context": "doc", "question": "q", "answers": ["a", ""]}', "'answers' must be a non-blank"),
        ('{"context": "doc", "question": "q", "answers": ["a", "  "]}', "'answers' must be a non-blank"),
        ('{"context": "doc", "question": "q", "answers": " \\t"}', "'answers' must be a non-blank"),
        ('{"context": "doc", "question": "q"}', "'answers' must be a non-blank"),
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


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xef\xbb\xbf" + GOOD.encode() + b"\n", "starts with a byte-order mark"),
        (GOOD.encode("utf-16"), "starts with a byte-order mark"),
        (GOOD.replace("Ostrava", "Ostrava\u00e9").encode("latin-1") + b"\n", "is not UTF-8 .byte 37 cannot be decoded"),
    ],
    ids=["utf8-bom", "utf16", "latin1"],
)
def test_bom_and_non_utf8_files_name_the_file(tmp_path, content, message):
    path = tmp_path / "encoded.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"encoded.jsonl {message}"):
        load_records(path)


# ----------------------------------------------------------------------------------------------------------------
# The command: one-line errors, checked before the model is loaded
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""

    def refuse(args):
        raise AssertionError("the model was loaded although the input was bad")

    monkeypatch.setattr(eval_recall, "load_lm", refuse)


def _error_line(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    return error


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys, no_model_load):
    path = _write(tmp_path, [GOOD, "{not json"])
    assert main(["eval-recall", "--model", str(tmp_path), "--data", str(path)]) == 1
    error = _error_line(capsys)
    assert error.startswith("jrt eval-recall: error: ") and error.endswith("data.jsonl:2: invalid JSON "
                                                                           "(Expecting property name enclosed in "
                                                                           "double quotes at column 2)")


@pytest.mark.parametrize("output", ["missing-folder/out.jsonl", "."], ids=["no-parent", "folder"])
def test_output_is_checked_before_evaluating(tmp_path, capsys, no_model_load, output):
    data = _write(tmp_path, [GOOD])
    target = tmp_path / output
    assert main(["eval-recall", "--model", str(tmp_path), "--data", str(data), "--output", str(target)]) == 1
    assert _error_line(capsys).startswith(f"jrt eval-recall: error: --output {target}")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder_is_refused(tmp_path, capsys, no_model_load):
    data = _write(tmp_path, [GOOD])
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert main(["eval-recall", "--model", str(tmp_path), "--data", str(data),
                     "--output", str(folder / "out.jsonl")]) == 1
    finally:
        folder.chmod(0o700)
    assert _error_line(capsys).endswith("out.jsonl is not writable")


def test_negative_and_inconsistent_token_budgets(tmp_path, capsys, no_model_load):
    data = _write(tmp_path, [GOOD])
    with pytest.raises(SystemExit) as error:
        main(["eval-recall", "--model", str(tmp_path), "--data", str(data), "--answer-tokens", "-5"])
    assert error.value.code == 2
    assert "--answer-tokens: expected an integer >= 0, got -5" in capsys.readouterr().err
    argv = ["eval-recall", "--model", str(tmp_path), "--data", str(data), "--context-tokens", "50"]
    assert main([*argv, "--answer-tokens", "50"]) == 2  # a usage error
    assert _error_line(capsys) == (
        "jrt eval-recall: error: --context-tokens (50) must exceed --answer-tokens (50): the document window is "
        "their difference"
    )


def test_missing_model_folder_is_one_line(tmp_path, capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    data = _write(tmp_path, [GOOD])
    assert main(["eval-recall", "--model", str(tmp_path / "absent"), "--data", str(data)]) == 1
    assert _error_line(capsys) == f"jrt eval-recall: error: --model '{tmp_path / 'absent'}': no such folder."
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval-recall", "--model", str(empty), "--data", str(data)]) == 1
    assert _error_line(capsys).startswith(f"jrt eval-recall: error: cannot load --model {empty}: ")


# ----------------------------------------------------------------------------------------------------------------
# End to end on tiny models
# ----------------------------------------------------------------------------------------------------------------


def _eval(model_dir, output, *extra: str) -> list[dict]:
    argv = ["eval-recall", "--model", str(model_dir), "--data", str(RECALL_FIXTURE), "--output", str(output),
            "--context-tokens", "80", "--answer-tokens", "20", "--max-new-tokens", "6", "--no-progress",
            "--device", "cpu", *extra]
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
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0,
                         bos_token_id=1, eos_token_id=1)
    model_dir = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    byte_bpe_tokenizer.save_pretrained(model_dir)
    return model_dir


def _check_rows(rows, records, kinds, tokenizer):
    assert len(rows) == len(records) * len(kinds)
    for row, (record, kind) in zip(rows, [(r, k) for r in records for k in kinds]):
        assert set(row) == {"id", "line", "prompt_kind", "prompt", "prompt_tokens", "generation", "answers", "correct"}
        assert (row["id"], row["line"], row["prompt_kind"]) == (record.id, record.line, kind)
        assert row["answers"] == list(record.answers)
        assert row["prompt"] == build_prompt(record, tokenizer, prompt_kind=kind, context_tokens=80, answer_tokens=20)
        assert row["prompt_tokens"] == len(tokenizer(row["prompt"])["input_ids"])
        assert "\n" not in row["generation"]
        assert row["correct"] == contains_score(row["generation"], row["answers"])


def test_eval_recall_end_to_end_jrt(tiny_jrt_dir, tmp_path, capsys, byte_bpe_tokenizer):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    rows = _eval(tiny_jrt_dir, tmp_path / "out.jsonl", "--limit", "5", "--batch-size", "3")
    table = capsys.readouterr().out.splitlines()[-3:]
    _check_rows(rows, load_records(RECALL_FIXTURE, limit=5), ("default", "jrt"), byte_bpe_tokenizer)
    correct = {kind: sum(row["correct"] for row in rows if row["prompt_kind"] == kind) for kind in ("default", "jrt")}
    assert table[0].split() == ["prompt", "correct", "total", "contains"]
    assert table[1].split()[:3] == ["default", str(correct["default"]), "5"]
    assert table[2].split()[:3] == ["jrt", str(correct["jrt"]), "5"]


def test_eval_recall_any_causal_lm(tiny_llama_dir, tmp_path, capsys, byte_bpe_tokenizer):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    rows = _eval(tiny_llama_dir, tmp_path / "out.jsonl", "--limit", "3", "--prompt", "jrt")
    _check_rows(rows, load_records(RECALL_FIXTURE, limit=3), ("jrt",), byte_bpe_tokenizer)
    assert capsys.readouterr().out.splitlines()[-1].split()[:3] == ["jrt", str(sum(r["correct"] for r in rows)), "3"]
