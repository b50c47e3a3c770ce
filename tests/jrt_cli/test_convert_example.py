"""`jrt convert --example DIR`: a tiny checkpoint in the released format, to try `jrt convert` offline."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jrt_cli.main import main


def test_example_checkpoint_converts_and_loads(tmp_path, capsys):
    example, converted = tmp_path / "JRT-tiny", tmp_path / "JRT-tiny-hf"
    assert main(["convert", "--example", str(example)]) == 0
    assert f"jrt convert {example} {example}-hf --tokenizer {example / 'tokenizer'}" in capsys.readouterr().out
    assert sorted(path.name for path in example.iterdir()) == ["config.json", "pytorch_model.bin", "tokenizer"]
    assert json.loads((example / "config.json").read_text())["model_type"] == "gpt2"  # as the released files
    assert main(["convert", str(example), str(converted)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("family: jrt (prefix linear attention")
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert model.config.linear_attention_type == "prefix" and model.config.vocab_size == 50264
    assert model.config.prefix_pad_token_id == 220 and model.config.eos_token_id == 50256  # GPT-2's, explicit
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[40, 101, 220, 84]])).logits).all()


def test_example_tokenizer_fits_the_checkpoint_and_generates_text(tmp_path, capsys):
    """Offline there was no converted folder with a tokenizer to run the README's "Generate" examples on. The
    example's tokenizer converts along (the converter checks its size and EOS) and encodes text byte by byte with
    GPT-2's byte ids; `jrt generate` prints the prompt and a continuation, with no note about the tokenizer."""
    example, converted = tmp_path / "JRT-tiny", tmp_path / "JRT-tiny-hf"
    assert main(["convert", "--example", str(example)]) == 0
    assert main(["convert", str(example), str(converted), "--tokenizer", str(example / "tokenizer")]) == 0
    capsys.readouterr()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256 and tokenizer.padding_side == "left"
    assert tokenizer("Hi there\n").input_ids == [39, 72, 220, 83, 71, 68, 81, 68, 198]  # GPT-2's byte ids
    assert tokenizer.decode(tokenizer(" naïve 日本").input_ids) == " naïve 日本"
    argv = ["generate", "--model", str(converted), "--prompt", "The capital of France is", "--max-new-tokens", "4"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The capital of France is") and len(captured.out) > len("The capital of France is\n")
    assert captured.err == ""


def test_example_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["convert", "--example", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder that is not empty" in err
    assert (tmp_path / "keep.txt").read_text() == "mine"
