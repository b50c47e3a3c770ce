"""`jrt lm-eval`: lm-eval's CLI with the `jrt` model and the recall tasks registered, on a saved tiny checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

import modeling_jrt
from jrt_cli.lm_eval_run import lm_eval_argv
from jrt_cli.main import main

DATA = Path(__file__).resolve().parent / "data"

BOOLQ_YAML = """task: local_boolq
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}\\nQuestion: {{{{question}}}}?\\nAnswer:"
doc_to_target: label
doc_to_choice: ["no", "yes"]
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def test_argv_defaults_to_run_with_the_jrt_model():
    assert lm_eval_argv(["--tasks", "boolq"]) == ["run", "--model", "jrt", "--tasks", "boolq"]
    assert lm_eval_argv(["run", "--model", "hf"]) == ["run", "--model", "hf"]
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks"]
    assert lm_eval_argv([]) == ["run", "--model", "jrt"]


def test_unknown_arguments_of_other_subcommands_are_still_refused(capsys):
    with pytest.raises(SystemExit) as error:
        main(["demo", "--bogus"])
    assert error.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.slow
def test_recall_and_loglikelihood_tasks_through_the_command(tmp_path, byte_bpe_tokenizer):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    from jrt_eval import TASKS_DIR

    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(byte_bpe_tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         prefix_pad_token_id=0, prefix_length=32)
    model_dir = tmp_path / "tiny-jrt"
    modeling_jrt.JRTRNNForCausalLM(config).save_pretrained(model_dir)
    byte_bpe_tokenizer.save_pretrained(model_dir)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "boolq.yaml").write_text(BOOLQ_YAML.format(data=DATA / "boolq.jsonl"), encoding="utf-8")
    for suffix in ("", "_twice"):
        (tasks_dir / f"swde{suffix}.yaml").write_text(
            f"include: {TASKS_DIR / f'jrt_swde{suffix}.yaml'}\ntask: local_swde{suffix}\n"
            f"dataset_kwargs:\n  family: swde\n  data_files: {DATA / 'swde.jsonl'}\n",
            encoding="utf-8",
        )
    output = tmp_path / "results"
    code = main([
        "lm-eval", "--model_args", f"pretrained={model_dir},dtype=float32", "--device", "cpu", "--batch_size", "2",
        "--tasks", "local_swde,local_swde_twice,local_boolq", "--include_path", str(tasks_dir),
        "--metadata", json.dumps({"context_tokens": 80, "answer_tokens": 20}),
        "--gen_kwargs", "max_gen_toks=4", "--output_path", str(output), "--log_samples",
    ])
    assert code == 0
    (results_file,) = output.rglob("results_*.json")
    results = json.loads(results_file.read_text(encoding="utf-8"))
    assert results["config"]["model"] == "jrt"
    assert set(results["results"]) == {"local_swde", "local_swde_twice", "local_boolq"}
    assert 0.0 <= results["results"]["local_swde_twice"]["contains,none"] <= 1.0
    assert 0.0 <= results["results"]["local_boolq"]["acc,none"] <= 1.0
    (samples_file,) = output.rglob("samples_local_swde_twice_*.jsonl")
    for line in samples_file.read_text(encoding="utf-8").splitlines():
        # --metadata reached the task: documents cut to 80 - 20 tokens with the checkpoint's tokenizer
        assert len(byte_bpe_tokenizer.encode(json.loads(line)["doc"]["context"])) <= 60


@pytest.mark.parametrize(
    "model_args", [[], ["--model_args", "==="], ["--model_args", "dtype=float32"], ["--model_args", "pretrained="]]
)
def test_jrt_model_without_pretrained_is_a_usage_error(capsys, model_args):
    """It failed with `TypeError: JRTLM.__init__() missing 1 required positional argument`."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    assert main(["lm-eval", "--tasks", "jrt_swde", *model_args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "jrt lm-eval: error: the `jrt` model needs the checkpoint: --model_args pretrained=PATH_OR_HUB_ID"
    ), err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model_args", "pretrained=MODEL,scoring=bogus"], "--model_args scoring=bogus is not one of leak_free"),
        (["--model_args", "pretrained=MODEL,prefix_strategy=bogus"], "prefix_strategy=bogus is not one of pad"),
        (["--model_args", "pretrained=MODEL", "--batch_size", "abc"], "--batch_size abc: expected a positive integer"),
        (["--model_args", "pretrained=MODEL", "--tasks", "jrt_swde,no_such_task"], "unknown task(s) no_such_task"),
    ],
)
def test_arguments_lm_eval_would_find_late_are_usage_errors(capsys, extra, message):
    """They used to give no answer in 150 s (or exit 1 after 113 s): now exit 2 before any model or data set loads."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    from jrt_cli.choices import MODELS_DIR

    extra = [arg.replace("MODEL", str(MODELS_DIR / "jrt-rnn-sd")) for arg in extra]
    tasks = [] if "--tasks" in extra else ["--tasks", "jrt_swde"]
    assert main(["lm-eval", *tasks, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_garbage_model_args_are_an_argparse_error(capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", "--tasks", "jrt_swde", "--model_args", "abc"])
    assert exit_info.value.code == 2
    assert "expected `key=value`, got 'abc'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["lm-eval", "--tasks", "boolq"], ["eval-recall", "--model", "m", "--data", "d"]])
def test_without_lm_eval_the_commands_say_how_to_install_it(monkeypatch, capsys, tmp_path, command):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    if command[0] == "eval-recall":
        data = tmp_path / "d.jsonl"
        data.write_text('{"context": "doc", "question": "q", "answers": "a"}\n', encoding="utf-8")
        command = [*command[:-1], str(data)]
    assert main(command) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.endswith("pip install -e '.[eval]' in a checkout")


def test_tasks_read_the_local_cache_at_once_when_the_hub_is_unreachable(monkeypatch, capsys):
    """Offline, lm-eval waited through five retries per data set file (about a minute) before its error: the Hub is
    probed once (a few seconds) and the run goes offline, saying so."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    import argparse

    import datasets.config
    from huggingface_hub import constants

    from jrt_cli import lm_eval_run

    went_offline = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(lm_eval_run, "hub_unreachable", lambda: "Name or service not known")
    monkeypatch.setattr(lm_eval_run, "go_offline", lambda: went_offline.append(True))
    lm_eval_run.offline_when_the_hub_is_unreachable(argparse.Namespace(tasks="jrt_swde"))
    assert went_offline and datasets.config.HF_HUB_OFFLINE is True
    assert "cannot be reached (Name or service not known): data sets are read from the local cache only" in (
        capsys.readouterr().err
    )
    went_offline.clear()  # reachable, or no task: nothing changes
    monkeypatch.setattr(lm_eval_run, "hub_unreachable", lambda: None)
    lm_eval_run.offline_when_the_hub_is_unreachable(argparse.Namespace(tasks="jrt_swde"))
    lm_eval_run.offline_when_the_hub_is_unreachable(argparse.Namespace(tasks=None))
    assert not went_offline
