"""Synthetic recall harness: generator formats (docs/synthetics.md, section 1), equal state of the arms, training,
the command line and the export of demo models."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

# The harness is not an installed package: `python experiments/synthetic` puts its folder on sys.path, so do we.
HARNESS_DIR = Path(__file__).resolve().parents[2] / "experiments" / "synthetic"
sys.path.insert(0, str(HARNESS_DIR))

from jrt_synthetic.cli import DEFAULT_EXPORT_DIR, main  # noqa: E402
from jrt_synthetic.data import (  # noqa: E402
    IGNORE_INDEX,
    QMQAR_QSEP,
    QMQAR_SEP,
    multiquery_ar,
    prefix_query_mqar,
    render_tokens,
    sd_token_map,
    set_disjointness,
)
from jrt_synthetic.experiments import (  # noqa: E402
    E2_TRAINED_LOSS,
    e1_task,
    experiment_runs,
    run_directory_name,
    summarize,
)
from jrt_synthetic.train import (  # noqa: E402
    RunSpec,
    TaskSpec,
    build_model_config,
    evaluate,
    recurrent_state_size,
    train_run,
    warmup_cosine,
)
from jrt_cli.demo_models import MODELS_DIR  # noqa: E402
from jrt_cli.set_disjointness import sd_tokenizer  # noqa: E402
from modeling_jrt import JRTRNNForCausalLM  # noqa: E402


def rng(seed: int = 0) -> np.random.RandomState:
    return np.random.RandomState(seed)


# ---------------------------------------------------------------------------------------------------------------
# Set disjointness


@pytest.mark.parametrize("short_length, long_length", [(4, 16), (16, 4), (1, 30), (34, 1)])
def test_set_disjointness_format(short_length, long_length):
    vocab_size = 68
    batch = set_disjointness(rng(), 50, short_length, long_length, vocab_size)
    length = short_length + long_length + 3
    assert batch.input_ids.shape == batch.labels.shape == (50, length)
    assert batch.prefix_length == length
    for tokens, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        assert tokens[0] == 1 and tokens[short_length + 1] == 2 and tokens[-1] == 3
        first, second = tokens[1:short_length + 1], tokens[short_length + 2:-1]
        assert len(set(first)) == short_length and len(set(second)) == long_length  # sets: no repeats
        assert all(4 <= t < vocab_size for t in first + second)  # specials only at their places
        common = set(first) & set(second)
        assert len(common) == 1  # exactly one intersection
        assert labels[:-1] == [IGNORE_INDEX] * (length - 1) and labels[-1] == common.pop()


def test_set_disjointness_overlap_position_is_uniform_in_b():
    batch = set_disjointness(rng(), 2000, 4, 16)
    second = batch.input_ids[:, 6:-1]
    slots = (second == batch.labels[:, -1:]).float().argmax(-1)
    counts = torch.bincount(slots, minlength=16)
    assert counts.min() > 60  # 125 expected per slot


def test_set_disjointness_jrt_prompt_repeats_the_context_exactly():
    plain = set_disjointness(rng(3), 20, 16, 4)
    twice = set_disjointness(rng(3), 20, 16, 4, repeat=2)
    context = plain.input_ids[:, :-1]
    assert torch.equal(twice.input_ids, torch.cat([context, context, plain.input_ids[:, -1:]], dim=1))
    assert torch.equal(twice.labels[:, -1], plain.labels[:, -1])
    assert (twice.labels[:, :-1] == IGNORE_INDEX).all()
    assert twice.prefix_length == 2 * 22 + 1


def test_set_disjointness_is_deterministic_given_the_seed():
    a, b, c = (set_disjointness(rng(s), 8, 4, 16) for s in (5, 5, 6))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_set_disjointness_rejects_sets_larger_than_their_pool():
    # Algorithm 1 splits the 64 item ids of V = 68 into pools of V // 2 = 34 and 30 ids.
    with pytest.raises(ValueError, match=r"do not fit the pools of vocab_size=68 \(34 and 30 ids\)"):
        set_disjointness(rng(), 1, 4, 31)
    with pytest.raises(ValueError, match="`repeat` must be a positive integer, got 0"):
        set_disjointness(rng(), 1, 4, 4, repeat=0)


def test_token_map_renders_specials_and_items():
    token_map = sd_token_map(68)
    assert json.loads(json.dumps(token_map)) == token_map
    assert render_tokens([1, 4, 67, 2, 9, 3], token_map) == "<bos> t4 t67 | t9 ?"


# ---------------------------------------------------------------------------------------------------------------
# MQAR (zoology) and prefix-query MQAR


def test_multiquery_ar_format():
    vocab_size, seq_len, pairs = 64, 32, 4
    batch = multiquery_ar(rng(), 40, seq_len, pairs, vocab_size, random_non_queries=False)
    assert batch.input_ids.shape == batch.labels.shape == (40, seq_len)
    assert batch.prefix_length == 2 * pairs
    for tokens, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        keys, values = tokens[0:2 * pairs:2], tokens[1:2 * pairs:2]
        assert all(1 <= k < vocab_size // 2 for k in keys) and all(vocab_size // 2 <= v < vocab_size for v in values)
        assert len(set(keys)) == pairs and len(set(values)) == pairs
        assert labels[:2 * pairs] == [IGNORE_INDEX] * (2 * pairs)
        queried = [(tokens[t], label) for t, label in enumerate(labels) if label != IGNORE_INDEX]
        # Every key is queried exactly once, at an even offset of the query region, and labelled with its value.
        assert sorted(queried) == sorted(zip(keys, values))
        positions = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
        assert all((t - 2 * pairs) % 2 == 0 for t in positions)
        assert all(tokens[t] == 0 for t in range(2 * pairs, seq_len) if t not in positions)


def test_multiquery_ar_queries_are_near_the_context():
    batch = multiquery_ar(rng(), 500, 256, 4, 512, random_non_queries=False)
    positions = (batch.labels != IGNORE_INDEX).nonzero()[:, 1] - 8
    assert positions.float().median() < 60  # power law alpha = 0.01: short distances, long tail (uniform: ~124)


def test_multiquery_ar_random_non_queries_and_jrt_passes():
    plain = multiquery_ar(rng(1), 10, 32, 4, 64, random_non_queries=True)
    assert (plain.input_ids[:, 8:] != 0).float().mean() > 0.9  # the fill is random, 0 only by chance
    twice = multiquery_ar(rng(1), 10, 32, 4, 64, random_non_queries=True, num_passes=2)
    assert twice.prefix_length == 16 and twice.input_ids.shape == (10, 40)
    assert torch.equal(twice.input_ids[:, :8], plain.input_ids[:, :8])
    assert torch.equal(twice.input_ids[:, 8:16], plain.input_ids[:, :8])  # the context, exactly, again
    assert torch.equal(twice.input_ids[:, 16:], plain.input_ids[:, 8:])
    assert torch.equal(twice.labels[:, 16:], plain.labels[:, 8:])
    assert (twice.labels[:, :16] == IGNORE_INDEX).all()


def test_multiquery_ar_errors():
    with pytest.raises(ValueError, match="`input_seq_len` must be even, got 31"):
        multiquery_ar(rng(), 1, 31, 4, 64)
    with pytest.raises(ValueError, match=r"`4 \* num_kv_pairs` \(40\) must be <= `input_seq_len` \(32\)"):
        multiquery_ar(rng(), 1, 32, 10, 64)


def _prompt_parts(tokens: list[int], prompt_length: int):
    return tokens[:prompt_length], tokens[prompt_length:]


@pytest.mark.parametrize("order", ["CQ", "QC", "CQC"])
def test_prefix_query_mqar_format(order):
    pairs, queries = 8, 3
    batch = prefix_query_mqar(rng(2), 30, pairs, queries, 132, order)
    context_length = 2 * pairs
    prompt_length = {"CQ": context_length + queries + 2, "QC": context_length + queries + 2,
                     "CQC": 2 * context_length + queries + 3}[order]
    assert batch.prefix_length == prompt_length
    assert batch.input_ids.shape == (30, prompt_length + 2 * queries - 1)
    for tokens, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        prompt, decode = _prompt_parts(tokens, prompt_length)
        if order == "QC":
            asked, context = prompt[:queries], prompt[queries + 1:-1]
            assert prompt[queries] == QMQAR_SEP and prompt[-1] == QMQAR_QSEP
        else:
            context, asked = prompt[:context_length], prompt[context_length + 1:context_length + 1 + queries]
            assert prompt[context_length] == QMQAR_SEP and prompt[context_length + 1 + queries] == QMQAR_QSEP
            if order == "CQC":  # JRT-Prompt: the same context again, then SEP
                assert prompt[context_length + queries + 2:-1] == context and prompt[-1] == QMQAR_SEP
        pairs_of = dict(zip(context[0::2], context[1::2]))
        assert len(pairs_of) == pairs and all(4 <= k < 68 <= pairs_of[k] < 132 for k in pairs_of)
        assert set(asked) <= set(pairs_of) and len(set(asked)) == queries  # every query key is in the context
        assert labels[:prompt_length] == [IGNORE_INDEX] * prompt_length
        decode_labels = labels[prompt_length:]
        assert sorted(decode[0::2]) == sorted(asked)  # the questions again, in some order
        assert decode_labels[0::2] == [pairs_of[k] for k in decode[0::2]]
        assert decode_labels[1::2] == [IGNORE_INDEX] * (queries - 1)
        assert decode[1::2] == [pairs_of[k] for k in decode[0::2]][:-1]  # teacher-forced values


def test_prefix_query_mqar_orders_ask_the_same_questions_for_a_seed():
    batches = {order: prefix_query_mqar(rng(4), 5, 4, 2, 132, order) for order in ("CQ", "QC", "CQC")}
    for order in ("QC", "CQC"):
        decode = batches[order].input_ids[:, batches[order].prefix_length:]
        assert torch.equal(decode, batches["CQ"].input_ids[:, batches["CQ"].prefix_length:])
    again = prefix_query_mqar(rng(4), 5, 4, 2, 132, "CQ")
    assert torch.equal(again.input_ids, batches["CQ"].input_ids)


def test_prefix_query_mqar_errors():
    with pytest.raises(ValueError, match="`order` must be one of"):
        prefix_query_mqar(rng(), 1, 4, order="QQ")
    with pytest.raises(ValueError, match=r"`num_queries` \(5\) must be <= `num_kv_pairs` \(4\)"):
        prefix_query_mqar(rng(), 1, 4, num_queries=5)


# ---------------------------------------------------------------------------------------------------------------
# Models and training


def _sd_task(eval_examples: int = 100) -> TaskSpec:
    return TaskSpec("sd", 68, [(4, 16), (16, 4)], [(4, 16), (16, 4)], eval_examples=eval_examples)


@pytest.mark.parametrize("task", [_sd_task(), TaskSpec("qmqar", 132, [(8,)], [(8,)], order="CQ")],
                         ids=["sd", "qmqar"])
def test_arms_have_equal_recurrent_state_measured_from_the_cache(task):
    batch = next(iter(task.eval_sets().values()))
    sizes, params = {}, {}
    for kind in ("causal", "prefix"):
        spec = RunSpec("arm", task, kind)
        model = JRTRNNForCausalLM(build_model_config(spec, batch.prefix_length)).eval()
        sizes[kind] = recurrent_state_size(model, batch)
        params[kind] = sum(p.numel() for p in model.parameters())
    assert sizes["causal"] == sizes["prefix"]
    # 2 linear-attention layers x 2 heads x (1 + f + f^2 = 7) features x (head dim 32 + normaliser 1),
    # 2 conv layers x width 64 x kernel 3.
    assert sizes["causal"] == {"linear_attention": 924, "conv": 256, "total": 1180}
    assert params["prefix"] > params["causal"]  # the encoder projections k_enc, v_enc


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 100, 5) == pytest.approx(0.2)
    assert warmup_cosine(4, 100, 5) == pytest.approx(1.0)
    assert warmup_cosine(5, 100, 5) == pytest.approx(1.0)
    assert warmup_cosine(52, 100, 5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 47 / 95)))
    assert warmup_cosine(100, 100, 5) == pytest.approx(0.0)


@pytest.mark.slow
def test_training_lowers_the_loss_and_saves_a_reloadable_model(tmp_path):
    spec = RunSpec("JRT-RNN", _sd_task(eval_examples=64), "prefix", seed=0, steps=100, batch_size=32,
                   eval_every=50, log_every=20)
    results = train_run(spec, tmp_path, show_progress=False)
    losses = [point["loss"] for point in results["loss_curve"]]
    assert len(losses) == 5
    assert losses[-1] < losses[0] - 0.25  # starts at ~ln(68) = 4.2
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["accuracy"] == results["accuracy"] and set(saved["accuracy"]) == {"4_16", "16_4"}
    assert [p["step"] for p in saved["eval_curve"]] == [50, 100]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.linear_attention_type == "prefix" and model.config.prefix_length == 23
    assert evaluate(model, spec.task.eval_sets()) == results["accuracy"]


def test_half_state_experiment_has_462_floats_of_linear_attention_state():
    spec = experiment_runs("e1-small", [0])[0]
    assert (spec.hidden_size, spec.num_attention_heads, spec.steps) == (32, 1, 8000)
    batch = spec.task.sample(rng(), 1, (4, 24))
    sizes = recurrent_state_size(JRTRNNForCausalLM(build_model_config(spec, batch.prefix_length)), batch)
    assert sizes["linear_attention"] == 462  # 2 layers x 1 head x 7 features x (32 + 1)


def test_experiment_runs_and_directory_names():
    runs = experiment_runs("e2", [0, 1], steps=10)
    assert [(r.name, r.seed, r.task.order, r.linear_attention_type) for r in runs] == [
        ("causal Based, CQ", 0, "CQ", "causal"), ("causal Based, CQC (JRT-Prompt)", 0, "CQC", "causal"),
        ("causal Based, CQ", 1, "CQ", "causal"), ("causal Based, CQC (JRT-Prompt)", 1, "CQC", "causal"),
    ]
    assert run_directory_name("causal Based, CQC (JRT-Prompt)", 2) == "causal-based-cqc-jrt-prompt_seed2"
    with pytest.raises(ValueError, match="Unknown experiment 'e9'"):
        experiment_runs("e9", [0])


def _fake_run(name: str, seed: int, acc16: float, loss: float) -> dict:
    accuracy = {"D=8": 0.5, "D=16": acc16}
    return {"name": name, "seed": seed, "spec": {"steps": 10}, "accuracy": accuracy,
            "eval_curve": [{"step": 10, "accuracy": accuracy}],
            "final_train_loss": loss, "ms_per_step": 1.0, "train_seconds": 1.0, "num_parameters": 1,
            "recurrent_state_floats": {"linear_attention": 1, "conv": 1, "total": 2}}


def test_e2_verdict_sets_aside_seeds_where_an_arm_did_not_train():
    plain, jrt = "causal Based, CQ", "causal Based, CQC (JRT-Prompt)"
    trained, stuck = E2_TRAINED_LOSS - 0.5, E2_TRAINED_LOSS + 0.5
    runs = [_fake_run(plain, 0, 0.40, trained), _fake_run(jrt, 0, 0.46, trained),
            _fake_run(plain, 1, 0.42, trained), _fake_run(jrt, 1, 0.47, trained),
            _fake_run(plain, 2, 0.05, stuck), _fake_run(jrt, 2, 0.50, trained)]
    summary = summarize("e2", runs)
    assert summary["arms"][plain]["curve"] == {"10": {"D=8": 0.5, "D=16": pytest.approx(0.29)}}
    verdict = summary["verdict"]
    assert verdict["gap_D16_per_trained_seed"] == pytest.approx([0.06, 0.05])
    assert verdict["seeds_with_an_untrained_arm"] == {2: [plain]}
    assert verdict["reproduced"] is False  # only 2 seeds where both arms trained
    runs += [_fake_run(plain, 3, 0.40, trained), _fake_run(jrt, 3, 0.45, trained)]
    assert summarize("e2", runs)["verdict"]["reproduced"] is True


@pytest.mark.slow
def test_synthetic_command_runs_an_experiment_end_to_end(tmp_path, capsys, monkeypatch):
    out = tmp_path / "e1"
    assert main(["e1", "--seeds", "0", "--steps", "10", "--jobs", "1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| causal Based | 10 | 0 |" in table and "| JRT-RNN | 10 | 0 |" in table and "Not reproduced" in table
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"causal Based", "JRT-RNN"}
    assert (out / "accuracy.png").stat().st_size > 1000
    assert (out / "jrt-rnn_seed0" / "model" / "model.safetensors").exists()
    # Saved models evaluated on longer sets than in training.
    assert main(["evaluate", str(out), "--slices", "8,24", "--examples", "20"]) == 0
    assert "| JRT-RNN | **" in capsys.readouterr().out
    extra = json.loads((out / "extra_eval.json").read_text())
    assert set(extra) == {"causal Based", "JRT-RNN"} and len(extra["JRT-RNN"]["8_24"]) == 1

    # Export: by default into ./runs/demo-models (never into the installed package), loadable by `jrt demo`.
    monkeypatch.chdir(tmp_path)
    shipped = {p: p.stat().st_mtime_ns for p in MODELS_DIR.rglob("*")}
    assert main(["export", str(out), "--seed", "0"]) == 0
    assert {p: p.stat().st_mtime_ns for p in MODELS_DIR.rglob("*")} == shipped
    exported = tmp_path / DEFAULT_EXPORT_DIR
    for name in ("jrt-rnn-sd", "based-sd"):
        files = {p.name for p in (exported / name).iterdir()}
        assert {"config.json", "model.safetensors", "token_map.json", "training.json", "tokenizer.json"} <= files
    from jrt_cli.main import main as jrt_main

    capsys.readouterr()
    assert jrt_main(["demo", "--models-dir", str(exported), "--examples", "8"]) == 0
    assert "(10 steps, seed 0;" in capsys.readouterr().out


def test_export_reports_a_missing_run(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing")]) == 1
    assert "run the e1 experiment first" in capsys.readouterr().err


def test_harness_runs_as_a_script_from_the_repository_root():
    """`python experiments/synthetic --help` works, and the repository root gains no `experiments` package."""
    root = HARNESS_DIR.parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.run([sys.executable, "experiments/synthetic", "--help"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "export" in process.stdout and "e1-small" in process.stdout
    assert not (root / "experiments" / "__init__.py").exists()
    assert not (HARNESS_DIR / "__init__.py").exists()


def test_shipped_demo_models_reproduce_their_recorded_accuracy():
    """The `jrt demo` models are the E1 seed-0 models of the recorded runs: their held-out accuracy is recorded."""
    eval_sets = e1_task().eval_sets()
    for name in ("jrt-rnn-sd", "based-sd"):
        recorded = json.loads((MODELS_DIR / name / "training.json").read_text())["accuracy"]
        model = AutoModelForCausalLM.from_pretrained(MODELS_DIR / name).eval()
        # Up to 2 of 1 000 argmaxes may flip on another CPU (near-ties); wrong weights would move far more.
        assert evaluate(model, eval_sets) == pytest.approx(recorded, abs=2e-3)


def test_export_tokenizer_matches_the_token_map():
    tokenizer = sd_tokenizer(sd_token_map(68))
    batch = set_disjointness(rng(), 3, 4, 16)
    for row in batch.input_ids:
        text = render_tokens(row, sd_token_map(68))
        assert tokenizer(text)["input_ids"] == row.tolist()
        assert tokenizer.decode(row.tolist()) == text
