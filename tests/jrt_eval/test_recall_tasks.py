"""The recall task YAMLs end to end through lm-eval's `simple_evaluate`, on tiny local data sets (no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

pytest.importorskip("lm_eval", reason="lm-eval is the optional `eval` extra: pip install -e '.[eval]'")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import modeling_jrt  # noqa: E402
from jrt_eval import TASKS_DIR, JRTLM  # noqa: E402
from jrt_eval.recall import default_prompt, load_recall_dataset, normalize_document, twice_prompt  # noqa: E402
from jrt_prompt import jrt_prompt, truncate_context  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, byte_bpe_tokenizer):
    path = tmp_path_factory.mktemp("tokenizer")
    byte_bpe_tokenizer.save_pretrained(path)
    return str(path)


def local_tasks(tmp_path: Path, family: str) -> Path:
    """Task YAMLs that include the shipped ones and read `tests/jrt_eval/data/<family>.jsonl`."""
    for suffix in ("", "_twice"):
        shipped = TASKS_DIR / f"jrt_{family}{suffix}.yaml"
        (tmp_path / f"local_{family}{suffix}.yaml").write_text(
            f"include: {shipped}\ntask: local_{family}{suffix}\n"
            f"dataset_kwargs:\n  family: {family}\n  data_files: {DATA / (family + '.jsonl')}\n",
            encoding="utf-8",
        )
    return tmp_path


def test_documents_map_to_the_shared_prompt_builders(byte_bpe_tokenizer):
    dataset = load_recall_dataset("swde", data_files=str(DATA / "swde.jsonl"), context_tokens=60, answer_tokens=10,
                                  tokenizer=byte_bpe_tokenizer)["validation"]
    raw = [json.loads(line) for line in (DATA / "swde.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(dataset) == len(raw)
    for doc, row in zip(dataset, raw):
        context = truncate_context(row["text"], byte_bpe_tokenizer, context_tokens=60, answer_tokens=10,
                                   answers=[row["value"], row["key"]])
        assert doc["context"] == context and doc["answers"] == [row["value"]]
        assert len(byte_bpe_tokenizer.encode(doc["context"])) <= 50
        assert default_prompt(doc) == jrt_prompt(context, row["key"], repeats=1, template="swde")
        assert twice_prompt(doc) == jrt_prompt(context, row["key"], repeats=2, template="swde")
        assert "Summary of information above" not in twice_prompt(doc)
    qa = normalize_document("drop", {"context": "c", "question": "q", "orig_question": "Q?", "answers": ["a", ""]})
    assert qa == {"context": "c", "question": "q", "header": "Q?", "answers": ["a"], "template": "drop", "id": "",
                  "line": 0}
    assert normalize_document("drop", {"context": "c", "question": "q", "answers": []}) is None


@pytest.mark.parametrize("family", ["swde", "drop"])
def test_recall_tasks_run_end_to_end_in_both_prompt_forms(tmp_path, family, byte_bpe_tokenizer, tokenizer_dir):
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(byte_bpe_tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         prefix_pad_token_id=0, prefix_length=32)
    lm = JRTLM(pretrained=modeling_jrt.JRTRNNForCausalLM(config).eval(), tokenizer=byte_bpe_tokenizer,
               device="cpu", batch_size=2)
    manager = TaskManager(include_path=[str(TASKS_DIR), str(local_tasks(tmp_path, family))], include_defaults=False,
                          metadata={"tokenizer": tokenizer_dir, "context_tokens": 80, "answer_tokens": 20})
    tasks = [f"local_{family}", f"local_{family}_twice"]
    gen_kwargs = {"max_gen_toks": 4}
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True, gen_kwargs=gen_kwargs)
    for task in tasks:
        assert 0.0 <= out["results"][task]["contains,none"] <= 1.0
        samples = out["samples"][task]
        assert len(samples) == 4
        for sample in samples:
            prompt = sample["arguments"][0][0]
            expected = jrt_prompt(sample["doc"]["context"], sample["doc"]["question"],
                                  repeats=2 if task.endswith("_twice") else 1, template=family,
                                  header=sample["doc"]["header"] or None)
            assert prompt == expected
            generation = sample["filtered_resps"][0]
            assert sample["contains"] == float(any(a.lower() in generation.lower() for a in sample["doc"]["answers"]))
    default_doc, twice_doc = (out["samples"][task][0]["doc"] for task in tasks)
    assert default_doc == twice_doc  # both forms see the same truncated document


def test_shipped_task_names_resolve():
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    names = set(manager.all_tasks)
    for family in ("swde", "fda", "squad", "drop", "triviaqa", "nq_512", "nq_1024", "nq_2048", "jsonl"):
        assert {f"jrt_{family}", f"jrt_{family}_twice"} <= names
    assert {"jrt_recall", "jrt_recall_twice"} <= names


def test_truncation_tokenizer_of_a_jrt_folder_loads_quietly_in_a_fresh_process():
    """AutoTokenizer reads config.json first: without `jrt_rnn` registered it printed "You are using a model of type
    `jrt_rnn` to instantiate a model of type ``" (and, for a folder with `auto_map`, asked "[y/N]")."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from jrt_cli.choices import MODELS_DIR

    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys; from jrt_eval.recall import truncation_tokenizer; "
        "print(truncation_tokenizer({'pretrained': sys.argv[1]})('<bos> t5').input_ids)"
    )
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script, str(MODELS_DIR / "jrt-rnn-sd")], env=env, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[1, 5]"
    assert "to instantiate a model of type" not in run.stderr and "[y/N]" not in run.stdout + run.stderr
