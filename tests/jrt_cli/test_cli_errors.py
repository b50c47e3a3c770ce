"""Every `jrt` subcommand: expected errors are one line on stderr with exit code 2 (usage) or 1 (runtime), and a
traceback only with `--debug` or for a bug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jrt_cli import main as cli
from jrt_cli.main import UsageError, main

ROOT = Path(__file__).resolve().parents[2]


def _one_line(err: str, command: str) -> None:
    assert err.count("\n") == 1 and err.startswith(f"jrt {command}: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["demo", "--examples", "2"], 2, "`--examples` must be >="),
        (["generate", "--model", "./no/such/folder", "--prompt", "x"], 1, "no such folder"),
        (["generate", "--model", "./no/such/folder", "--prompt", "x", "--max-new-tokens", "0"], 2, "--max-new-tokens"),
        (["convert", "./no/such/src", "out"], 1, "neither an existing file or folder"),
        (["convert", "./no/such/src", "out", "--private"], 2, "need --push-to-hub"),
        (["convert", "src", "out", "--push-to-hub", "a/b", "--create-pr", "--revision", "dev"], 2, "--create-pr"),
        (["eval-recall", "--model", "./no/such/model", "--data", "./no/such/data.jsonl"], 2, "no data file at"),
    ],
)
def test_expected_errors_are_one_line_with_the_exit_code(argv, code, message, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err
    _one_line(err, argv[0])
    assert message in err


def test_argparse_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "src", "dst", "--dtype", "int8"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("argv", [["convert", "src"], ["convert"], ["convert", "src", "--example", "dir"]])
def test_convert_needs_src_and_dst_or_example(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    _one_line(err, "convert")
    assert "jrt convert SRC DST" in err or "give no SRC or DST" in err


def test_no_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: jrt" in capsys.readouterr().err


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_shows_the_traceback(position):
    argv = ["demo", "--examples", "2"]
    argv = ["--debug", *argv] if position == "before" else [*argv, "--debug"]
    with pytest.raises(UsageError, match="`--examples` must be >="):
        main(argv)


def _patched_demo(monkeypatch, error: BaseException) -> None:
    import jrt_cli.demo as demo

    def fail(args):
        raise error

    monkeypatch.setattr(demo, "run", fail)
    original = demo.add_parser

    def add_parser(subparsers):
        original(subparsers)
        subparsers.choices["demo"].set_defaults(func=fail)

    monkeypatch.setattr(demo, "add_parser", add_parser)


def test_bugs_keep_their_traceback(monkeypatch):
    _patched_demo(monkeypatch, TypeError("unsupported operand"))
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["demo"])


def test_multi_line_library_errors_are_joined(monkeypatch, capsys):
    _patched_demo(monkeypatch, OSError("first line\n  second line\n"))
    assert main(["demo"]) == 1
    assert capsys.readouterr().err == "jrt demo: error: first line second line\n"


def test_interrupt_exits_130(monkeypatch, capsys):
    _patched_demo(monkeypatch, KeyboardInterrupt())
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "jrt demo: interrupted\n"


def test_console_entry_point_exit_codes():
    """`python -m jrt_cli` (what the `jrt` script runs) returns the codes to the shell."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "jrt_cli", "demo", "--examples", "2"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert cli.EXPECTED_ERRORS  # the documented set of one-line errors exists


_NO_TORCH = """
import sys
from jrt_cli.main import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules, "torch was imported before the usage error"
sys.exit(code)
"""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--seed", "-1"], "argument --seed: expected an integer from 0 to 2**32 - 1 (4294967295), got -1"),
        (["demo", "--seed", str(2**70)], "argument --seed: expected an integer from 0 to 2**32 - 1"),
        (["demo", "--examples", "2"], "`--examples` must be >="),
        (["eval-recall", "--model", "m", "--data", "./missing.jsonl"], "no data file at ./missing.jsonl"),
        (["eval-recall", "--model", "m", "--data", str(ROOT / "examples" / "data" / "recall_fixture.jsonl"),
          "--context-tokens", "10", "--answer-tokens", "50"], "--context-tokens (10) must exceed --answer-tokens (50)"),
    ],
)
def test_argument_errors_answer_before_torch_is_imported(argv, message):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_demo_help_shows_the_seed_range(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "0 to 2**32 - 1" in capsys.readouterr().out


def test_a_damaged_demo_model_is_one_line(tmp_path, capsys):
    import shutil

    from jrt_cli.choices import MODELS_DIR

    for name in ("jrt-rnn-sd", "based-sd"):
        shutil.copytree(MODELS_DIR / name, tmp_path / name)
    (tmp_path / "jrt-rnn-sd" / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["demo", "--models-dir", str(tmp_path), "--examples", "4"]) == 1
    err = capsys.readouterr().err
    _one_line(err, "demo")
    assert f"cannot load the demo model in {tmp_path / 'jrt-rnn-sd'}" in err and "export the folder again" in err


def _converted_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "jrt_rnn", "hidden_size": 8}', encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


@pytest.mark.parametrize(
    "make_source, code, message",
    [
        (lambda tmp: tmp / "empty", 2, "No weights in"),
        (lambda tmp: tmp / "notes", 2, "found ['notes.txt']"),
        (lambda tmp: tmp / "bad-json", 1, "config.json' is not valid JSON: Expecting value at line 2, column 1"),
        (lambda tmp: tmp / "list-json", 1, "config.json' must hold a JSON object, got list"),
        (lambda tmp: tmp / "converted", 2, "is already a converted folder (['model.safetensors'] and a config.json "
                                           "with model_type 'jrt_rnn')"),
        (lambda tmp: tmp / "two-ckpts", 2, "holds several Lightning checkpoints"),
        (lambda tmp: tmp / "converted" / "model.safetensors", 2, "is already a converted folder"),
    ],
    ids=["empty-folder", "no-weights", "config-not-json", "config-a-list", "already-converted", "two-ckpts",
         "converted-weights-file"],
)
def test_a_source_that_is_not_a_checkpoint_answers_before_the_heavy_imports(tmp_path, make_source, code, message):
    """They took 14-29 s (importing torch and transformers first), and an already converted folder listed its 25
    files as "no weights": now one line at once. A folder that holds no checkpoint (or an already converted one) is
    a wrong SRC, a usage error (2); a config.json that is not a JSON object is a damaged file (1)."""
    from usage_error_timing import USAGE_ERROR_SECONDS, run_jrt

    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("x")
    for name, text in (("bad-json", "\n"), ("list-json", "[1]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        (tmp_path / name / "pytorch_model.bin").write_bytes(b"x")
    _converted_folder(tmp_path / "converted")
    (tmp_path / "two-ckpts").mkdir()
    for name in ("a.ckpt", "b.ckpt", "config.json"):
        (tmp_path / "two-ckpts" / name).write_text("{}")
    source = make_source(tmp_path)
    returncode, err, seconds, startup = run_jrt(["convert", str(source), str(tmp_path / "out")])
    assert returncode == code, err
    _one_line(err, "convert")
    assert message in err and str(source.parent if source.is_file() else source) in err
    assert seconds < startup + USAGE_ERROR_SECONDS, (seconds, startup)
    assert not (tmp_path / "out").exists()


def test_an_already_converted_folder_is_refused_by_the_python_api_too(tmp_path):
    from jrt_convert import ConversionError, convert_checkpoint

    source = _converted_folder(tmp_path / "JRT-360M-30B-hf")
    with pytest.raises(ConversionError, match=r"is already a converted folder .*it loads as it is, with from_pretr"):
        convert_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("existing", ["folder", "file"])
def test_convert_example_into_an_existing_folder_answers_before_the_heavy_imports(tmp_path, existing):
    """`jrt convert --example DIR` into a folder that is not empty (or a file): exit 2 at once (it took 14 s and
    exited 1), and nothing there is touched."""
    from usage_error_timing import USAGE_ERROR_SECONDS, run_jrt

    target = tmp_path / "example"
    if existing == "folder":
        target.mkdir()
        (target / "keep.txt").write_text("mine")
    else:
        target.write_text("mine")
    returncode, err, seconds, startup = run_jrt(["convert", "--example", str(target)])
    assert returncode == 2, err
    _one_line(err, "convert")
    what = "a folder that is not empty" if existing == "folder" else "a file"
    assert f"--example {target} is {what}: the example is written into a new (or empty) folder only" in err
    assert seconds < startup + USAGE_ERROR_SECONDS, (seconds, startup)
    assert (target / "keep.txt" if existing == "folder" else target).read_text() == "mine"
