"""The shipped demo model folders stand alone: a copy loads with `trust_remote_code=True` where this distribution is not
importable (config.json has `auto_map`, the folder ships the package's code, byte for byte), and their tokenizers map
unknown words to an unknown token instead of failing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from isolated_python import BLOCK_LOCAL_PACKAGES
from transformers import AutoModelForCausalLM, AutoTokenizer

from jrt_cli.choices import MODELS_DIR
from jrt_cli.demo_models import DEMO_MODELS
from jrt_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(DEMO_MODELS.values())
REFRESH = "python -m jrt_cli.demo_models"
PROMPT = "<bos> t5 t9 t12 t40 | t44 t47 t50 t52 t55 t57 t59 t60 t61 t62 t63 t64 t65 t66 t67 t12 ?"


@pytest.mark.parametrize("name", FOLDERS)
def test_shipped_code_is_what_save_pretrained_writes_from_the_package(name, tmp_path):
    """One source of truth: the folder's .py files are the package's own (fails after any change to modeling_jrt
    until the folders are refreshed with `python -m jrt_cli.demo_models`)."""
    folder = MODELS_DIR / name
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path)
    expected = {path.name: path.read_bytes() for path in tmp_path.glob("*.py")}
    shipped = {path.name: path.read_bytes() for path in folder.glob("*.py")}
    assert sorted(shipped) == sorted(expected), f"{folder}: refresh the shipped code with `{REFRESH}`"
    stale = [file for file in expected if shipped[file] != expected[file]]
    assert not stale, f"{folder}: {stale} differ from modeling_jrt; refresh them with `{REFRESH}`"
    saved_auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert json.loads((folder / "config.json").read_text())["auto_map"] == saved_auto_map


def test_copied_demo_folders_load_with_remote_code_alone(tmp_path):
    copies = []
    for name in FOLDERS:
        shutil.copytree(MODELS_DIR / name, tmp_path / name)
        copies.append(str(tmp_path / name))
    prompt_ids = torch.tensor([AutoTokenizer.from_pretrained(MODELS_DIR / FOLDERS[0])(PROMPT).input_ids])
    torch.save(prompt_ids, tmp_path / "ids.pt")
    script = BLOCK_LOCAL_PACKAGES + textwrap.dedent(
        """
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        ids_path, *folders = sys.argv[1:]
        input_ids = torch.load(ids_path)
        results = {}
        for folder in folders:
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
            assert tokenizer("<bos> t5").input_ids == [1, 5]
            with torch.no_grad():
                results[folder] = model(input_ids).logits
        torch.save(results, ids_path + ".out.pt")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ids.pt"), *copies], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    results = torch.load(tmp_path / "ids.pt.out.pt")
    for name, copy in zip(FOLDERS, copies):
        model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(results[copy], model(prompt_ids).logits)


@pytest.mark.parametrize("name", FOLDERS)
def test_unknown_words_map_to_the_unknown_token(name):
    tokenizer = AutoTokenizer.from_pretrained(MODELS_DIR / name)
    assert tokenizer.unk_token == "<mask>" and tokenizer.unk_token_id == 0
    assert tokenizer("héllo t5 word").input_ids == [0, 5, 0]


def test_generate_with_an_unknown_word(capsys):
    """It failed with `WordLevel error: Missing [UNK] token from the vocabulary`."""
    argv = ["generate", "--model", str(MODELS_DIR / "jrt-rnn-sd"), "--prompt", "héllo", "--max-new-tokens", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("héllo") and captured.err == ""


@pytest.mark.slow
def test_eval_recall_on_a_demo_model_with_the_shipped_fixture(capsys):
    """The shipped recall fixture is prose: every word is unknown to the demo vocabulary. It used to fail on the
    missing [UNK], then on the tokenizer's missing end-of-text token inside lm-eval."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    argv = ["eval-recall", "--model", str(MODELS_DIR / "jrt-rnn-sd"), "--data",
            str(ROOT / "examples" / "data" / "recall_fixture.jsonl"), "--context-tokens", "100", "--limit", "2",
            "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "Loading weights" not in captured.err and "neither marked as CausalLM" not in captured.err
    assert out.splitlines()[0].split() == ["prompt", "correct", "total", "contains"]
    assert [line.split()[::2] for line in out.splitlines()[1:]] == [["default", "2"], ["jrt", "2"]]
