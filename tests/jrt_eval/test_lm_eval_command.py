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


def _demo_model() -> str:
    from jrt_cli.choices import MODELS_DIR

    return str(MODELS_DIR / "jrt-rnn-sd")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", ""], "--tasks '' names no task"),
        (["--tasks", " , "], "names no task: give one or more task names"),
        (["--tasks", "jrt_swdee"], "unknown task(s) jrt_swdee (jrt_swdee: did you mean jrt_swde?): jrt-rnn's tasks"),
        (["--tasks", "jrt_swde,jrt_nq_4096,boolq"], "unknown task(s) jrt_nq_4096"),
        (["--tasks", "jrt_swde", "--limit", "-1"], "--limit -1: expected a number of examples per task (>= 1)"),
        (["--tasks", "jrt_swde", "--limit", "0"], "--limit 0: expected"),
        (["--tasks", "jrt_swde", "--limit", "nan"], "--limit nan: expected"),
        (["--tasks", "jrt_swde", "--batch_size", "0"], "--batch_size 0: expected a positive integer"),
        (["--tasks", "jrt_swde", "--model_args", "pretrained=MODEL,bogus_key=1"],
         "--model_args bogus_key=1: the `jrt` model takes no argument 'bogus_key'"),
        (["--tasks", "jrt_swde", "--model_args", "pretrained=MODEL,scorng=reference"],
         "takes no argument 'scorng' (did you mean scoring?)"),
        (["--tasks", "jrt_swde", "--model_args", "pretrained=MODEL,prefix_lenght=64"],
         "(did you mean prefix_length?)"),
        (["--tasks", "jrt_swde", "--model_args", "pretrained=MODEL,scoring=bogus"],
         "--model_args scoring=bogus is not one of leak_free, reference"),
        (["--tasks", "jrt_swde", "--model_args", "pretrained=MODEL,prefix_strategy=fill"],
         "--model_args prefix_strategy=fill is not one of pad, repeat, none"),
    ],
    ids=["tasks-empty", "tasks-blank", "jrt-typo", "jrt-unknown-among-others", "limit-negative", "limit-zero",
         "limit-nan", "batch-size-zero", "unknown-model-arg", "model-arg-typo", "config-field-typo", "scoring",
         "prefix-strategy"],
)
def test_usage_errors_answer_before_the_heavy_imports(extra, message):
    """Each took 14-30 s (torch, transformers and lm-eval's models imported, the task index built, or the model
    loaded: `bogus_key=1` was a 49-line TypeError traceback after 27 s; `--tasks ''` exited 1, `--limit -1` failed
    on the data set): now exit 2, one line, with nothing heavy imported, in a fraction of a second."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    from usage_error_timing import USAGE_ERROR_SECONDS, run_jrt

    if "--model_args" not in extra:
        extra = [*extra, "--model_args", "pretrained=MODEL"]
    extra = [arg.replace("MODEL", _demo_model()) for arg in extra]
    returncode, err, seconds, startup = run_jrt(["lm-eval", *extra])
    assert returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("jrt lm-eval: error: ") and message in err, err
    assert seconds < startup + USAGE_ERROR_SECONDS, (seconds, startup)


@pytest.mark.parametrize(
    "key, value",
    [
        ("dtype", "float32"), ("device", "cpu"), ("max_length", 512), ("batch_size", 2), ("scoring", "reference"),
        ("prefix_strategy", "repeat"), ("mixed_precision_dtype", "bfloat16"), ("trust_remote_code", True),
        ("attn_implementation", "eager"), ("low_cpu_mem_usage", True), ("prefix_length", 64),
        ("linear_attention_chunk_size", 16), ("output_hidden_states", False), ("eos_token_id", 0),
    ],
)
def test_model_args_the_jrt_model_takes_are_accepted(key, value):
    """HFLM's arguments, `jrt`'s, from_pretrained options and config fields (overrides) all pass the early check."""
    from jrt_cli.lm_eval_run import check_model_arg_names

    check_model_arg_names({"pretrained": _demo_model(), key: value})


def test_model_args_of_a_model_whose_config_is_not_at_hand_are_left_to_the_loader(tmp_path):
    """A Hub id that is not in the local cache (its config cannot be read without the network), a folder without
    a config.json, or a model type whose config class is not found: no early verdict on the keys."""
    from jrt_cli.lm_eval_run import check_model_arg_names

    check_model_arg_names({"pretrained": "nobody-xyz/not-cached-model", "anything": 1})
    check_model_arg_names({"pretrained": str(tmp_path), "anything": 1})
    (tmp_path / "config.json").write_text('{"model_type": "someone_elses_model"}')
    check_model_arg_names({"pretrained": str(tmp_path), "anything": 1})


def test_model_args_of_another_model_type_are_its_config_fields(tmp_path):
    """`--model jrt` loads any causal LM: for a GPT-2 folder, GPT-2's config fields (also those left out of its
    config.json) are overrides, and a key that is none of them is refused."""
    import json

    from jrt_cli.lm_eval_run import check_model_arg_names

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    check_model_arg_names({"pretrained": str(tmp_path), "n_positions": 2048, "attn_pdrop": 0.0, "dtype": "float32"})
    with pytest.raises(ValueError, match=r"takes no argument 'n_positons' \(did you mean n_positions\?\)"):
        check_model_arg_names({"pretrained": str(tmp_path), "n_positons": 2048})


def test_the_known_model_args_match_the_installed_lm_eval_and_the_config():
    """The lists the early check reads without importing torch are those of the code they stand for."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    import inspect

    from lm_eval.models.huggingface import HFLM

    from jrt_cli.lm_eval_run import HFLM_ARGUMENTS, JRT_MODEL_ARGUMENTS, config_fields
    from jrt_eval.lm import JRTLM

    hflm = [name for name in inspect.signature(HFLM.__init__).parameters if name not in ("self", "kwargs")]
    assert sorted(HFLM_ARGUMENTS) == sorted(hflm)
    jrtlm = [name for name in inspect.signature(JRTLM.__init__).parameters if name not in ("self", "kwargs")]
    assert set(jrtlm) <= {*HFLM_ARGUMENTS, *JRT_MODEL_ARGUMENTS}
    from transformers import GPT2Config, LlamaConfig

    for model_type, config in (("jrt_rnn", modeling_jrt.JRTRNNConfig()), ("gpt2", GPT2Config()),
                               ("llama", LlamaConfig())):
        fields = config_fields(model_type)
        assert set(config.to_dict()) - {"model_type", "_name_or_path"} <= fields, set(config.to_dict()) - fields
    assert "prefix_length" not in config_fields("llama")  # JRT-RNN's own fields only for its model type
    assert config_fields("no_such_model_type") is None and config_fields("../x") is None


def test_shipped_task_names_are_the_yaml_files_tasks_and_groups():
    from jrt_cli.lm_eval_run import shipped_task_names
    from jrt_eval import TASKS_DIR

    names = set(shipped_task_names())
    assert {path.stem for path in TASKS_DIR.glob("*.yaml")} == names
    assert {"jrt_swde", "jrt_swde_twice", "jrt_recall", "jrt_recall_twice", "jrt_nq_1024"} <= names


def test_jrt_task_names_are_not_checked_early_with_a_users_include_path(tmp_path, monkeypatch):
    """The user's own tasks may be named jrt_* too: with --include_path, lm-eval's index decides (later)."""
    import argparse

    from jrt_cli.lm_eval_run import check_arguments_early

    args = argparse.Namespace(command="run", model="hf", tasks=["jrt_mine"], include_path=str(tmp_path),
                              limit=None, batch_size=None, model_args={})
    check_arguments_early(args)
    args.include_path = None
    with pytest.raises(ValueError, match="unknown task"):
        check_arguments_early(args)
    args.tasks = ["jrt_nq_*", "jrt_swde"]  # a glob over the shipped names
    check_arguments_early(args)


def test_the_early_checks_read_the_same_choices_as_the_model():
    """`scoring` and `prefix_strategy` are checked without importing torch, from the same constants."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    import jrt_eval
    import jrt_eval.lm
    from jrt_cli.choices import PREFIX_STRATEGIES as CHECKED_STRATEGIES
    from modeling_jrt.configuration_jrt import PREFIX_STRATEGIES

    assert CHECKED_STRATEGIES == PREFIX_STRATEGIES
    assert jrt_eval.lm.SCORING_MODES is jrt_eval.SCORING_MODES == ("leak_free", "reference")


@pytest.mark.parametrize("tasks, unknown", [("bogus", "bogus"), ("jrt_swde,hellaswagg", "hellaswagg"),
                                            ("hellaswag,mmlu_nosuch_*", "mmlu_nosuch_*")])
def test_an_unknown_lm_eval_task_answers_before_the_heavy_imports(tasks, unknown):
    """Other task names were checked against lm-eval's task index, which lm-eval takes about 15 s to build: the index
    of the pinned lm-eval release ships with jrt-rnn, so `--tasks bogus` is a usage error in a fraction of a second
    (lm-eval itself not imported); known names and globs over them pass this check."""
    pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
    from usage_error_timing import USAGE_ERROR_SECONDS, run_jrt

    returncode, err, seconds, startup = run_jrt(
        ["lm-eval", "--tasks", tasks, "--model_args", f"pretrained={_demo_model()}"],
        heavy=("torch", "transformers", "lm_eval.models"),
    )
    assert returncode == 2 and err.count("\n") == 1 and f"unknown task(s) {unknown}" in err, err
    assert seconds < startup + USAGE_ERROR_SECONDS, (seconds, startup)


def test_known_lm_eval_tasks_and_globs_pass_the_index_check():
    import argparse

    from jrt_cli.lm_eval_run import check_run_arguments, shipped_task_index

    pytest.importorskip("lm_eval")
    assert shipped_task_index() is not None and "hellaswag" in shipped_task_index()
    for tasks in ("hellaswag", "jrt_swde,arc_easy", "mmlu_*", "jrt_nq_*"):
        check_run_arguments(argparse.Namespace(command="run", tasks=tasks, include_path=None))


@pytest.mark.slow
def test_the_shipped_task_index_is_lm_evals_own():
    """The shipped index (`write_task_index`) equals what lm-eval's TaskManager builds for the installed release."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from jrt_cli.lm_eval_run import shipped_task_index

    index = shipped_task_index()
    assert index is not None, f"no task index shipped for lm-eval {lm_eval.__version__}: run write_task_index()"
    assert list(index) == sorted(set(TaskManager().all_tasks))