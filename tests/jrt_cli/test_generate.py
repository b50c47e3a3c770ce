"""`jrt generate` end to end on a tiny model and tokenizer saved to a temporary folder."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jrt_cli.main import main
from modeling_jrt import JRTRNNForCausalLM


@pytest.fixture
def checkpoint(make_config, tmp_path):
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<sp>": 3}
    vocab.update({f"w{i}": i for i in range(4, 99)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    model = JRTRNNForCausalLM(make_config(initializer_range=0.3, eos_token_id=None)).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, model, tokenizer


def expected_text(model, tokenizer, prompt: str, new_tokens: int, **kwargs) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    return tokenizer.decode(out[0], skip_special_tokens=True)


@pytest.mark.parametrize("strategy", [None, "repeat"])
def test_generate_streams_the_continuation(checkpoint, capsys, strategy):
    folder, model, tokenizer = checkpoint
    argv = ["generate", "--model", str(folder), "--prompt", "w5 w6 w7", "--max-new-tokens", "6"]
    if strategy is not None:
        argv += ["--prefix-strategy", strategy]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    expected = expected_text(model, tokenizer, "w5 w6 w7", 6, **({"prefix_strategy": strategy} if strategy else {}))
    assert printed.split() == expected.split()
    assert printed.split()[:3] == ["w5", "w6", "w7"]


def test_jrt_prompt_reads_the_prompt_twice(checkpoint, capsys):
    folder, model, tokenizer = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "w5 w6", "--max-new-tokens", "4", "--jrt-prompt"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == expected_text(model, tokenizer, "w5 w6\nw5 w6", 4).split()
    assert printed[:4] == ["w5", "w6", "w5", "w6"]


def test_bad_arguments_fail_with_one_line(checkpoint, capsys):
    folder, _, _ = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "w5", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder / "missing"), "--prompt", "w5"]) == 1
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(folder), "--prompt", "w5", "--prefix-strategy", "twice"])


def test_tokenizer_option_for_a_folder_without_one(checkpoint, capsys, tmp_path):
    """A converted folder may ship no tokenizer: the error says to pass --tokenizer, which then works."""
    folder, model, tokenizer = checkpoint
    model_only = tmp_path / "model-only"
    model.save_pretrained(model_only)
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert main(["generate", "--model", str(model_only), "--prompt", "w5 w6"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no tokenizer" in err and "--tokenizer" in err
    assert main(["generate", "--model", str(model_only), "--tokenizer", str(folder), "--prompt", "w5 w6",
                 "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.split() == expected_text(model, tokenizer, "w5 w6", 3).split()


def test_empty_prompt_is_a_usage_error(checkpoint, capsys):
    folder, _, _ = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", ""]) == 2
    assert capsys.readouterr().err == "jrt generate: error: --prompt is empty: give some text to continue.\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(checkpoint, capsys):
    folder, _, _ = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "w5", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "jrt generate: error: --device cuda: CUDA is not available on this machine; use --device cpu.\n"
    )


def test_unknown_device_and_missing_folder_are_one_line(checkpoint, capsys, tmp_path):
    folder, _, _ = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "w5", "--device", "gpu0"]) == 2
    assert "--device 'gpu0' is not a torch device" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "w5"]) == 1
    assert capsys.readouterr().err == f"jrt generate: error: --model '{tmp_path / 'nowhere'}': no such folder.\n"
