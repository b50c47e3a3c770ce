"""The shipped demo model folders are data (weights, config, tokenizer: the installed package is their code), and
`jrt demo --export DIR` writes Hub-ready copies that load with `trust_remote_code=True` where this distribution is
not importable; their tokenizers map unknown words to an unknown token instead of failing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from isolated_python import BLOCK_LOCAL_PACKAGES
from transformers import AutoModelForCausalLM, AutoTokenizer

from jrt_cli.choices import MODELS_DIR
from jrt_cli.demo_models import DEMO_MODELS, SHIPPED_FILES
from jrt_cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(DEMO_MODELS.values())
PROMPT = "<bos> t5 t9 t12 t40 | t44 t47 t50 t52 t55 t57 t59 t60 t61 t62 t63 t64 t65 t66 t67 t12 ?"


@pytest.mark.parametrize("name", FOLDERS)
def test_shipped_folders_hold_data_only(name):
    """No copy of the model's code in the package data (the installed package loads them), and no `auto_map` that
    would point a copied folder at code it lacks; the config is in the current layout (`mixer_types`)."""
    folder = MODELS_DIR / name
    assert sorted(path.name for path in folder.iterdir()) == sorted(SHIPPED_FILES)
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and "layer_types" not in config and config["mixer_types"]


def test_exported_demo_folders_load_with_remote_code_alone(tmp_path, capsys):
    assert main(["demo", "--export", str(tmp_path / "hub")]) == 0
    copies = [str(tmp_path / "hub" / name) for name in FOLDERS]
    assert sorted(capsys.readouterr().out.splitlines()) == [f"wrote {copy}" for copy in copies]
    for copy in copies:  # save_pretrained's folder: the code and auto_map, with the demo's data
        assert {"modeling_jrt.py", "configuration_jrt.py", "token_map.json", "tokenizer.json"} <= {
            path.name for path in Path(copy).iterdir()}
        assert json.loads((Path(copy) / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    assert main(["demo", "--export", str(tmp_path / "hub")]) == 2  # never over an existing export
    assert "exists: export into an empty folder" in capsys.readouterr().err
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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "mods")}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ids.pt"), *copies], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    results = torch.load(tmp_path / "ids.pt.out.pt")
    for name, copy in zip(FOLDERS, copies):
        model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(results[copy], model(prompt_ids).logits, rtol=0, atol=0)


def test_exported_demo_folders_carry_a_model_card_whose_usage_runs_without_the_package(tmp_path, capsys):
    """`jrt demo --export` folders had no README.md, although the converter writes one: each now carries a card with
    the converter's Hub header and citations, what the model is and how it was trained, and a usage block that runs as
    written (PATH_OR_REPO replaced) where jrt-rnn is not importable, printing the model's own answer."""
    import re

    from huggingface_hub import ModelCard

    from jrt_convert.model_card import CITATIONS

    assert main(["demo", "--export", str(tmp_path / "hub")]) == 0
    capsys.readouterr()
    script = BLOCK_LOCAL_PACKAGES
    expected = []
    for name in FOLDERS:
        folder = tmp_path / "hub" / name
        card = ModelCard.load(folder / "README.md")
        assert card.data.license == "apache-2.0" and card.data.library_name == "transformers"
        assert {"jrt-rnn", "set-disjointness"} <= set(card.data.tags)
        assert CITATIONS in card.text
        kind = "JRT-RNN (prefix linear attention)" if name.startswith("jrt") else "Based (causal linear attention)"
        assert card.text.lstrip().startswith(f"# {name}: a tiny {kind} on set disjointness")
        training = json.loads((MODELS_DIR / name / "training.json").read_text())
        assert f"| parameters | {training['num_parameters']} |" in card.text
        usage = re.search(r"## Usage\n\n```python\n(.*?)```", card.text, re.S).group(1)
        script += usage.replace("PATH_OR_REPO", str(folder))
        model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / name).eval()
        tokenizer = AutoTokenizer.from_pretrained(MODELS_DIR / name)
        inputs = tokenizer(PROMPT, return_tensors="pt")
        answer = model.generate(**inputs, max_new_tokens=1, do_sample=False)[0, inputs["input_ids"].shape[1]:]
        expected.append(tokenizer.decode(answer))
    assert expected[0] == "t12"  # JRT-RNN names the shared token
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "mods")}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == expected
    assert "[y/N]" not in run.stdout + run.stderr


@pytest.mark.parametrize("name", FOLDERS)
def test_unknown_words_map_to_the_unknown_token(name):
    tokenizer = AutoTokenizer.from_pretrained(MODELS_DIR / name)
    assert tokenizer.unk_token == "<mask>" and tokenizer.unk_token_id == 0
    assert tokenizer("héllo t5 word").input_ids == [0, 5, 0]


def test_generate_with_an_unknown_word(capsys):
    """It failed with `WordLevel error: Missing [UNK] token from the vocabulary`. Now it runs, and says why nothing
    follows the prompt."""
    argv = ["generate", "--model", str(MODELS_DIR / "jrt-rnn-sd"), "--prompt", "héllo", "--max-new-tokens", "2"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("héllo")
    assert captured.err.splitlines() == [
        "note: the 2 generated token(s) print as nothing (<mask> <mask>: special or empty tokens).",
        "note: 1 of the prompt's 1 tokens are words the tokenizer does not know (read as '<mask>'): write the prompt "
        "in the model's vocabulary.",
    ]


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
