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


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--do-sample", "--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
        (["--do-sample", "--temperature", "nan"], "--temperature must be a finite number > 0, got nan"),
        (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--temperature", "0.8"], "--temperature and --top-p set how to sample: add --do-sample"),
        (["--device", "meta"], "--device meta holds no data and cannot generate: use --device cpu or cuda."),
    ],
)
def test_usage_errors_exit_2_before_any_output(checkpoint, capsys, extra, message):
    """They exited 1 after printing the prompt (temperature 0), or failed deep inside torch (meta)."""
    folder, _, _ = checkpoint
    assert main(["generate", "--model", str(folder), "--prompt", "w5 w6", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("jrt generate: error: ")
    assert message in captured.err


@pytest.mark.parametrize("seed", [str(2**70), "-1", "x"])
def test_seed_out_of_range_is_an_argparse_error(checkpoint, capsys, seed):
    folder, _, _ = checkpoint
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(folder), "--prompt", "w5", "--seed", seed])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "argument --seed: expected an integer in [0, 2**64 - 1]" in captured.err


def test_largest_seed_samples(checkpoint, capsys):
    folder, _, _ = checkpoint
    argv = ["generate", "--model", str(folder), "--prompt", "w5", "--max-new-tokens", "2", "--do-sample"]
    assert main([*argv, "--seed", str(2**64 - 1)]) == 0
    assert capsys.readouterr().out.split()[0] == "w5"


def test_echoed_prompt_keeps_special_tokens(capsys):
    """The echo is the prompt as given: `<bos>` (a special token of the demo tokenizer) stays; the continuation is
    printed without special tokens."""
    from jrt_cli.choices import MODELS_DIR

    prompt = "<bos> t5 t9 t12 t40 | t44 t47 t50 t52 t55 t57 t59 t60 t61 t62 t63 t64 t65 t66 t67 t12 ?"
    argv = ["generate", "--model", str(MODELS_DIR / "jrt-rnn-sd"), "--prompt", prompt, "--max-new-tokens", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == prompt + " t12\n"
    assert captured.err == ""  # no "Loading weights" progress bar


def test_a_tokenizer_smaller_than_the_model_is_named(tmp_path, capsys):
    """The demo tokenizer (68 words) on a model of 99 ids printed nothing after the prompt without saying why."""
    from conftest import tiny_config

    from jrt_cli.choices import MODELS_DIR

    torch.manual_seed(0)
    JRTRNNForCausalLM(tiny_config()).save_pretrained(tmp_path / "model")
    argv = ["generate", "--model", str(tmp_path / "model"), "--tokenizer", str(MODELS_DIR / "jrt-rnn-sd"),
            "--prompt", "t5 t6", "--max-new-tokens", "2"]
    assert main(argv) == 0
    assert "note: the tokenizer has 68 tokens but the model generates ids up to 98" in capsys.readouterr().err


def test_a_continuation_that_prints_as_nothing_says_why(capsys):
    """Words outside the demo tokenizer's vocabulary are read as `<mask>`, and the demo model answers with special
    tokens: the command printed the prompt and nothing else. It now says both on stderr."""
    from jrt_cli.choices import MODELS_DIR

    argv = ["generate", "--model", str(MODELS_DIR / "jrt-rnn-sd"), "--prompt", "hello there", "--max-new-tokens", "3"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "hello there"
    assert "note: the 3 generated token(s) print as nothing (<mask> <mask> <mask>" in captured.err
    assert "note: 2 of the prompt's 2 tokens are words the tokenizer does not know (read as '<mask>')" in captured.err


def test_a_printed_continuation_has_no_note(capsys):
    from jrt_cli.choices import MODELS_DIR

    prompt = "<bos> t5 t9 t12 | t44 t12 ?"
    argv = ["generate", "--model", str(MODELS_DIR / "jrt-rnn-sd"), "--prompt", prompt, "--max-new-tokens", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(prompt + " t") and captured.err == ""
