"""`jrt --help` and every `jrt COMMAND --help` are instant: building the parser imports neither torch nor
transformers (it took 11-16 s when it did), and the choices it shows are the library's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jrt_cli import choices
from jrt_cli.main import SUBCOMMAND_MODULES, build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("demo", "generate", "eval-recall", "lm-eval", "convert")

# Runs each --help in one fresh interpreter and reports the exit codes and which heavy modules got imported.
HELP_PROBE = """
import contextlib, io, json, sys
from jrt_cli.choices import HEAVY_MODULES
from jrt_cli.main import main
codes = {}
for argv in [["--help"], *[[command, "--help"] for command in sys.argv[1:]]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exit_info:
            codes[" ".join(argv)] = [exit_info.code, out.getvalue()]
heavy = sorted(name for name in HEAVY_MODULES if name in sys.modules)
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def _run_probe(*commands: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, *commands], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_help_of_every_command_imports_no_heavy_module():
    result = _run_probe(*(command for command in COMMANDS if command != "lm-eval"))
    assert result["heavy"] == [], f"building the parser imported {result['heavy']}"
    assert set(result["codes"]) == {"--help", *(f"{c} --help" for c in COMMANDS if c != "lm-eval")}
    for argv, (code, text) in result["codes"].items():
        assert code == 0 and text.startswith("usage: jrt"), argv


def test_lm_eval_help_shows_the_jrt_default_without_importing_torch():
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    result = _run_probe("lm-eval")
    code, text = result["codes"]["lm-eval --help"]
    assert code == 0
    assert "default: jrt" in " ".join(text.split()) and "(default: hf)" not in text
    assert "torch" not in result["heavy"] and "transformers" not in result["heavy"]


def test_subcommand_modules_import_no_heavy_module_at_import_time():
    """The same, in this process: reimporting the parser modules pulls in nothing heavy (checked by name)."""
    for name in SUBCOMMAND_MODULES:
        source = (ROOT / "jrt_cli" / f"{name}.py").read_text(encoding="utf-8")
        top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
        for line in top_level:
            assert not any(f" {heavy}" in line.replace(".", " ") for heavy in choices.HEAVY_MODULES), (name, line)
            assert "modeling_jrt" not in line and "jrt_convert" not in line and "jrt_eval" not in line, (name, line)
    build_parser()


def test_parser_choices_equal_the_library_constants():
    from jrt_cli.demo_models import DEMO_SEED, MODELS_DIR
    from jrt_convert import DTYPES, FAMILIES
    from modeling_jrt.configuration_jrt import PREFIX_PAD_MASKINGS
    from modeling_jrt.configuration_jrt import PREFIX_STRATEGIES

    assert choices.PREFIX_STRATEGIES == PREFIX_STRATEGIES
    assert choices.PREFIX_PAD_MASKINGS == PREFIX_PAD_MASKINGS
    assert choices.FAMILIES == FAMILIES
    assert choices.DTYPES == tuple(DTYPES)
    assert (choices.DEMO_SEED, choices.MODELS_DIR) == (DEMO_SEED, MODELS_DIR)
    pytest.importorskip("lm_eval", reason="jrt_eval.jsonl_recall needs the optional `eval` extra")
    from jrt_eval.jsonl_recall import PROMPT_KINDS

    assert choices.PROMPT_KINDS == PROMPT_KINDS


def test_recall_fixture_module_has_a_help():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "jrt_cli.recall_fixture", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m jrt_cli.recall_fixture")
    assert '"context"' not in run.stdout  # it used to ignore --help and dump the data


def test_recall_fixture_still_writes_the_shipped_file(capsys):
    from jrt_cli.recall_fixture import main

    assert main([]) == 0
    assert capsys.readouterr().out == (ROOT / "examples" / "data" / "recall_fixture.jsonl").read_text(encoding="utf-8")
