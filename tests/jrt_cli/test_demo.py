"""`jrt demo` and the tiny models it ships (trained by the synthetic harness, experiment E1)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import modeling_jrt  # noqa: F401  (registers "jrt_rnn" with the Auto classes)
from jrt_cli.main import main
from jrt_cli.demo_models import DEMO_ARMS, DEMO_SEED, MODELS_DIR, recurrent_state_size
from jrt_cli.set_disjointness import render_tokens, sd_token_map, sd_tokenizer, set_disjointness

MODEL_DIRS = ("jrt-rnn-sd", "based-sd")


def _load(name: str):
    return AutoModelForCausalLM.from_pretrained(MODELS_DIR / name).eval()


@pytest.mark.parametrize("name, kind", [("jrt-rnn-sd", "prefix"), ("based-sd", "causal")])
def test_shipped_model_files(name, kind):
    path = MODELS_DIR / name
    assert {"config.json", "model.safetensors", "token_map.json", "training.json"} <= {p.name for p in path.iterdir()}
    assert sum(p.stat().st_size for p in path.iterdir()) < 1_000_000
    assert json.loads((path / "token_map.json").read_text()) == sd_token_map(68)
    config = _load(name).config
    assert (config.linear_attention_type, config.vocab_size, config.prefix_length) == (kind, 68, 23)
    assert config.mixer_types == ["conv", "linear_attention", "conv", "linear_attention"]


def test_shipped_models_have_equal_recurrent_state():
    batch = set_disjointness(np.random.RandomState(0), 2, 4, 16)
    sizes = [recurrent_state_size(_load(name), batch) for name in MODEL_DIRS]
    assert sizes[0] == sizes[1] == {"linear_attention": 924, "conv": 256, "total": 1180}


def _reference_accuracy(name: str, repeat: int, slices=((4, 16), (16, 4)), num_examples: int = 200) -> float:
    """Parallel forward (no cache) over the demo's prompts: 100 of the first slice, then 100 of the second."""
    rng = np.random.RandomState(DEMO_SEED)
    parts = [set_disjointness(rng, num_examples // 2, a, b, 68, repeat) for a, b in slices]
    input_ids = torch.cat([p.input_ids for p in parts])
    targets = torch.cat([p.labels[:, -1] for p in parts])
    with torch.no_grad():
        logits = _load(name)(input_ids, prefix_length=input_ids.shape[1], use_cache=False).logits[:, -1]
    return (logits.argmax(-1) == targets).float().mean().item()


def test_demo_runs_and_its_accuracy_matches_a_recomputation(capsys):
    assert main(["demo"]) == 0
    output = capsys.readouterr().out
    assert output.count("Example ") == 4 and output.count("expected: t") == 4
    for arm in DEMO_ARMS:
        line = next(line for line in output.splitlines() if line.strip().startswith(arm.label) and "accuracy" in line)
        printed = float(re.search(r"accuracy (\d\.\d{3})", line).group(1))
        assert printed == pytest.approx(_reference_accuracy(arm.model_dir, arm.repeat), abs=5e-4), arm.label
        assert "state 1180 floats (linear attention 924 + conv 256)" in line
        line = next(line for line in output.splitlines() if line.strip().startswith(arm.label) and "longer" in line)
        printed = float(re.search(r"longer-set accuracy (\d\.\d{3})", line).group(1))
        assert printed == pytest.approx(_reference_accuracy(arm.model_dir, arm.repeat, ((8, 24), (24, 8))), abs=5e-4)
    # The per-example verdicts agree with the printed answers.
    for block in output.split("Example ")[1:]:
        expected = re.search(r"expected: (t\d+)", block).group(1)
        for answer, verdict in re.findall(r"-> (t\d+)\s+(correct|wrong)", block):
            assert (answer == expected) == (verdict == "correct")


def test_demo_rejects_too_few_examples(capsys):
    assert main(["demo", "--examples", "2"]) == 2  # a usage error
    assert "`--examples` must be >= 4, got 2" in capsys.readouterr().err


@pytest.mark.parametrize("name", MODEL_DIRS)
def test_shipped_tokenizer_is_built_from_the_token_map(name):
    from transformers import AutoTokenizer

    path = MODELS_DIR / name
    token_map = json.loads((path / "token_map.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == token_map["vocab_size"] == 68
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (1, _load(name).config.pad_token_id)
    assert tokenizer.eos_token == "<bos>"  # also the end of an example: TRL appends it to each completion
    batch = set_disjointness(np.random.RandomState(3), 2, 4, 16)
    for row in batch.input_ids:
        text = render_tokens(row, token_map)
        assert tokenizer(text)["input_ids"] == row.tolist()
        assert tokenizer.decode(row) == text
    # The shipped files are exactly what the builder writes.
    assert json.loads((path / "tokenizer.json").read_text()) == json.loads(sd_tokenizer(token_map)._tokenizer.to_str())


def test_sft_trainer_scores_a_demo_completion_and_its_end(tmp_path):
    """TRL's `SFTTrainer` needs an EOS to end each completion ("endswith first arg must be str ... not NoneType" with
    the demo tokenizers before): the answer and the `<bos>` that ends the example are the scored targets."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    path = MODELS_DIR / "jrt-rnn-sd"
    data = datasets.Dataset.from_list([{"prompt": "<bos> t5 t9 | t7 t5 ?", "completion": " t5"}] * 2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = SFTTrainer(model=_load("jrt-rnn-sd"), train_dataset=data, processing_class=tokenizer,
                         args=SFTConfig(output_dir=str(tmp_path), completion_only_loss=True, report_to="none",
                                        bf16=False))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"].tolist() == [[1, 5, 9, 2, 7, 5, 3, 5, 1]]
    assert batch["labels"].tolist() == [[-100] * 7 + [5, 1]]


@pytest.mark.parametrize("name", MODEL_DIRS)
def test_text_generation_pipeline_answers_like_the_demo(name):
    from transformers import pipeline

    token_map = json.loads((MODELS_DIR / name / "token_map.json").read_text())
    batch = set_disjointness(np.random.RandomState(DEMO_SEED), 4, 4, 16)
    generator = pipeline("text-generation", model=str(MODELS_DIR / name))
    answers = _load(name)(batch.input_ids, prefix_length=batch.input_ids.shape[1], use_cache=False).logits[:, -1]
    for row, answer in zip(batch.input_ids, answers.argmax(-1).tolist()):
        prompt = render_tokens(row, token_map)
        out = generator(prompt, max_new_tokens=1, do_sample=False, return_full_text=False)
        assert out[0]["generated_text"].strip() == render_tokens([answer], token_map)
