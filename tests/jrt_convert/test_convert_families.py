"""Every released family converts from both checkpoint formats and matches an independent reference forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from isolated_python import BLOCK_LOCAL_PACKAGES
from reference_checkpoints import (
    EOS,
    PADDED_VOCAB,
    VOCAB,
    reference_config,
    reference_forward,
    reference_state_dict,
    write_reference_checkpoint,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from jrt_cli.main import main as jrt_main
from jrt_convert import convert_checkpoint

# (test-config family, released name used as the folder name, expected converted family)
CASES = [
    ("jrt", "JRT-360M-30B", "jrt"),
    ("based-decay", "based-360M-30B", "based-jrt-release"),
    ("based-1b-50b", "based-1b-50b", "based-jrt-release"),
    ("based-original", "based-1b", "based-original"),
]


def _make_source(tmp_path: Path, case: str, name: str, *, lightning: bool) -> tuple[Path, dict, dict]:
    config = reference_config(case)
    # based-360M-30B's training code names the depthwise conv `conv1` (BaseConvWithSiLU4); the JRT loader renames it.
    state_dict = reference_state_dict(config, conv_key="conv.conv1" if case == "based-decay" else "conv.conv")
    write_reference_checkpoint(tmp_path / "src" / name, config, state_dict, lightning=lightning)
    return tmp_path / "src" / name, config, state_dict


def _input_ids(length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("lightning", [False, True], ids=["bin", "ckpt"])
@pytest.mark.parametrize(("case", "name", "family"), CASES, ids=[c[0] for c in CASES])
def test_family_converts_and_matches_reference(tmp_path, case, name, family, lightning):
    source, config, state_dict = _make_source(tmp_path, case, name, lightning=lightning)
    result = convert_checkpoint(source, tmp_path / "out")
    assert result.family == family

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "JRTRNNForCausalLM"
    assert model.config.vocab_size == PADDED_VOCAB
    assert model.config.sliding_window == config["alt_mixer_2"]["window_size"] // 2 + 1
    assert model.config.use_decay_proj == model.config.linear_attention_decay == (case == "based-decay")
    for length in (9, 3):  # longer and shorter than the JRT prefix (5); the reference's forward never fills it
        input_ids = _input_ids(length)
        with torch.no_grad():
            logits = model(input_ids, prefix_strategy="none").logits.double()
        expected = reference_forward(config, state_dict, input_ids)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)


def test_based_without_markers_or_released_name(tmp_path):
    """A based-1b-50b-like checkpoint under an unknown name is `based-original`, with an identical conversion."""
    source, _, _ = _make_source(tmp_path, "based-1b-50b", "based-1b-50b", lightning=False)
    anonymous = source.rename(tmp_path / "src" / "my-checkpoint")
    result = convert_checkpoint(anonymous, tmp_path / "anonymous")
    assert result.family == "based-original" and "convert identically" in result.evidence
    named = convert_checkpoint(anonymous, tmp_path / "named", family="based-jrt-release")
    assert named.family == "based-jrt-release"
    assert named.config.to_dict() == result.config.to_dict()


def test_jrt_reference_pad_masking_matches_reference(tmp_path):
    """Default `prefix_pad_masking="reference"` reproduces the reference's masked prefix (keys zeroed before phi)."""
    source, config, state_dict = _make_source(tmp_path, "jrt", "JRT-360M-30B", lightning=False)
    convert_checkpoint(source, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.prefix_pad_masking == "reference"
    input_ids = _input_ids()
    mask = torch.ones(2, 9)
    mask[0, :3] = 0  # left pads inside the 5-token prefix, as custom_enc_dec_encode builds them
    mask[1, :1] = 0
    with torch.no_grad():
        logits = model(input_ids, linear_attention_mask=mask.long()).logits.double()
    expected = reference_forward(config, state_dict, input_ids, mask=mask.double())
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    unmasked = reference_forward(config, state_dict, input_ids)
    assert (expected - unmasked).abs().max() > 1e-2  # the mask matters in this test


_REMOTE_LOAD = BLOCK_LOCAL_PACKAGES + textwrap.dedent(
    """
    try:
        import modeling_jrt
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("modeling_jrt is importable")
    import torch
    from transformers import AutoModelForCausalLM
    ids_path, *folders = sys.argv[1:]
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        input_ids = torch.load(ids_path)
        with torch.no_grad():
            logits = model(input_ids).logits
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4)
        torch.save({"logits": logits, "generated": generated}, folder + ".out.pt")
    """
)


@pytest.mark.slow
def test_converted_folders_load_without_the_package(tmp_path):
    cases = {"jrt": "JRT-360M-30B", "based-decay": "based-360M-30B"}
    sources = {case: _make_source(tmp_path, case, name, lightning=False) for case, name in cases.items()}
    for case, (source, _, _) in sources.items():
        convert_checkpoint(source, tmp_path / f"out-{case}")
    input_ids = _input_ids()
    torch.save(input_ids, tmp_path / "ids.pt")
    script = tmp_path / "load.py"
    script.write_text(_REMOTE_LOAD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    # This venv's own interpreter in isolated mode (no cwd, no PYTHONPATH, no user site); the Block finder in the
    # script makes the package unimportable even though the venv has it installed (editable or not).
    interpreter = sys.executable
    folders = [str(tmp_path / f"out-{case}") for case in cases]
    process = subprocess.run(
        [interpreter, "-I", str(script), str(tmp_path / "ids.pt"), *folders],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    for case, (_, config, state_dict) in sources.items():
        folder = tmp_path / f"out-{case}"
        remote = torch.load(f"{folder}.out.pt")
        remote_logits = remote["logits"]
        local = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            torch.testing.assert_close(remote_logits, local(input_ids).logits, rtol=0, atol=0)
        local_generated = local.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4)
        assert torch.equal(remote["generated"], local_generated)
        torch.testing.assert_close(
            remote_logits.double(), reference_forward(config, state_dict, input_ids), rtol=1e-5, atol=1e-4
        )
        shipped = {p.name for p in folder.glob("*.py")}
        assert {"configuration_jrt.py", "modeling_jrt.py", "linear_attention.py"} <= shipped


def _tiny_gpt2_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer with GPT-2's alphabet and no merges: 256 bytes + <|endoftext|> = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = EOS
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(folder)
    return folder


def test_cli_convert_with_tokenizer_shards_and_dtype(tmp_path, capsys):
    source, config, _ = _make_source(tmp_path, "jrt", "JRT-360M-30B", lightning=True)
    tokenizer_dir = _tiny_gpt2_tokenizer(tmp_path / "tok")
    code = jrt_main([
        "convert", str(source), str(tmp_path / "out"), "--dtype", "bfloat16", "--tokenizer", str(tokenizer_dir),
        "--max-shard-size", "200KB", "--prefix-pad-masking", "strict",
    ])
    assert code == 0
    captured = capsys.readouterr()
    assert "family: jrt" in captured.out and str(tmp_path / "out") in captured.out

    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / shard).is_file() for shard in shards)
    saved = json.loads((out / "config.json").read_text())
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_jrt.JRTRNNConfig",
        "AutoModel": "modeling_jrt.JRTRNNModel",
        "AutoModelForCausalLM": "modeling_jrt.JRTRNNForCausalLM",
    }
    assert saved["prefix_pad_masking"] == "strict" and saved["dtype"] == "bfloat16"
    assert saved["mask_token_id"] == PADDED_VOCAB - 1 and saved["prefix_length"] == config["enc_length"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["do_sample"] is False and generation["eos_token_id"] == EOS
    assert generation["suppress_tokens"] == list(range(VOCAB, PADDED_VOCAB))  # padding rows, [MASK] the last one
    assert saved["generation_vocab_size"] == VOCAB and saved["pad_token_id"] == EOS
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "JRT-360M-30B" in card.text and "`jrt`" in card.text

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == EOS
    batch = tokenizer(["hi", "hello"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == EOS and batch["attention_mask"][0, 0].item() == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    generated = model.generate(**batch, max_new_tokens=6)
    assert generated.shape == (2, batch["input_ids"].shape[1] + 6) and (generated < VOCAB).all()
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left behind
