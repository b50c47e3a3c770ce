"""Token ids: the converter writes them explicitly (GPT-2's for the released checkpoints) and takes the JRT prefix pad
from `--prefix-pad-token-id` or the tokenizer, so that a small-vocabulary checkpoint (97 tokens) converts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference_checkpoints import reference_config, reference_forward, reference_state_dict, write_reference_checkpoint
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from jrt_cli.main import main as jrt_main
from jrt_convert import ConversionError, convert_checkpoint
from jrt_convert.families import FAMILY_SPECS, read_architecture, translate_config

SMALL_VOCAB = 97  # padded to 104 embedding rows
SMALL_EOS = 96


def _small_source(folder: Path, *, eos: int = SMALL_EOS) -> tuple[Path, dict, dict]:
    """A JRT checkpoint of a 97-token model, as the reference code would train and save it."""
    config = reference_config("jrt")
    config.update(vocab_size=SMALL_VOCAB, bos_token_id=eos, eos_token_id=eos)
    state_dict = reference_state_dict(reference_config("jrt"))
    embedding = state_dict["transformer.embeddings.word_embeddings.weight"][:104].clone()
    state_dict["transformer.embeddings.word_embeddings.weight"] = state_dict["lm_head.weight"] = embedding
    write_reference_checkpoint(folder, config, state_dict, lightning=False)
    return folder, config, state_dict


def _small_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer of 97 tokens: newline, space ('Ġ' = 1), the 94 printable ASCII characters, eos = 96."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = ["Ċ", "Ġ"] + [chr(c) for c in range(33, 127)] + ["<|endoftext|>"]
    backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    ).save_pretrained(folder)
    return folder


def test_small_vocabulary_without_a_prefix_pad_says_how_to_set_it(tmp_path, capsys):
    source, _, _ = _small_source(tmp_path / "src")
    assert jrt_main(["convert", str(source), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "jrt convert: error: The JRT prefix pad token defaults to GPT-2's \" \" (the reference's prefix pad) = 220, "
        "but this checkpoint's vocabulary has only 104 rows: pass --prefix-pad-token-id ID"
    )
    assert "--tokenizer" in err and not (tmp_path / "out").exists()


def test_small_vocabulary_converts_with_prefix_pad_token_id(tmp_path):
    source, config, state_dict = _small_source(tmp_path / "src")
    assert jrt_main(["convert", str(source), str(tmp_path / "out"), "--prefix-pad-token-id", "1"]) == 0
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["vocab_size"] == 104 and saved["generation_vocab_size"] == SMALL_VOCAB
    assert (saved["prefix_pad_token_id"], saved["mask_token_id"]) == (1, 103)
    assert saved["bos_token_id"] == saved["eos_token_id"] == saved["pad_token_id"] == SMALL_EOS

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    input_ids = torch.randint(0, SMALL_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids).logits.double()
    torch.testing.assert_close(logits, reference_forward(config, state_dict, input_ids), rtol=1e-5, atol=1e-4)
    generated = model.generate(input_ids[:1, :3], attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=4)
    assert generated.shape == (1, 7) and (generated < SMALL_VOCAB).all()


def test_prefix_pad_is_taken_from_the_tokenizer(tmp_path):
    source, _, _ = _small_source(tmp_path / "src")
    tokenizer = _small_tokenizer(tmp_path / "tok")
    result = convert_checkpoint(source, tmp_path / "out", tokenizer=str(tokenizer))
    assert result.config.prefix_pad_token_id == 1  # the tokenizer's " "
    assert 'prefix pad token 1: the tokenizer\'s " "' in result.notes
    assert json.loads((tmp_path / "out" / "config.json").read_text())["prefix_pad_token_id"] == 1
    # An explicit id wins over the tokenizer's.
    explicit = convert_checkpoint(source, tmp_path / "explicit", tokenizer=str(tokenizer), prefix_pad_token_id=5)
    assert explicit.config.prefix_pad_token_id == 5


def test_gpt2_defaults_left_in_a_small_config_become_none_with_a_note(tmp_path):
    """A GPT2Config dump keeps bos/eos 50256 even for a 97-token model: outside the vocabulary, written as None."""
    source, _, _ = _small_source(tmp_path / "src", eos=50256)
    result = convert_checkpoint(source, tmp_path / "out", prefix_pad_token_id=1)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["bos_token_id"] is None and saved["eos_token_id"] is None and saved["pad_token_id"] is None
    assert any("eos_token_id=50256 is outside the 104-row vocabulary" in note for note in result.notes)


def test_released_checkpoints_get_gpt2_ids_written_explicitly():
    """bos = eos = pad = 50256 and prefix pad 220, stated in the config (never left to JRTRNNConfig's defaults)."""
    config = reference_config("jrt")
    config.update(vocab_size=50257)
    for key in ("bos_token_id", "eos_token_id"):
        config.pop(key)  # absent from the dump: GPT-2's are used, as GPT2Config does
    kwargs, _ = translate_config(
        read_architecture(config), FAMILY_SPECS["jrt"], prefix_pad_masking="reference", dtype=torch.float32
    )
    assert (kwargs["bos_token_id"], kwargs["eos_token_id"], kwargs["pad_token_id"]) == (50256, 50256, 50256)
    assert kwargs["prefix_pad_token_id"] == 220 and kwargs["vocab_size"] == 50264


def test_converted_config_states_every_token_id(tmp_path):
    config = reference_config("jrt")
    write_reference_checkpoint(tmp_path / "src", config, reference_state_dict(config), lightning=False)
    convert_checkpoint(tmp_path / "src", tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    eos = config["eos_token_id"]
    assert {k: saved[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "prefix_pad_token_id")} == {
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "prefix_pad_token_id": 220,
    }
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["pad_token_id"] == eos


def test_prefix_pad_error_in_python_names_the_keyword(tmp_path):
    source, _, _ = _small_source(tmp_path / "src")
    with pytest.raises(ConversionError, match=r"prefix_pad_token_id= in Python"):
        convert_checkpoint(source, tmp_path / "out")
