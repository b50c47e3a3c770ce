"""Everything is checked before the work, in one line that names what is wrong: options (usage errors, exit 2), sizes in
config.json (bounded, and held against the weights), files that are not checkpoints, tensors that are not real
floating point or do not fit the chosen dtype, and a disk that fills up while writing."""

from __future__ import annotations

import os
import random
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference_checkpoints import reference_config, reference_state_dict, write_reference_checkpoint

import jrt_convert.checkpoint as checkpoint
import jrt_convert.pipeline as pipeline
from jrt_cli.main import main as jrt_main
from jrt_convert import ConversionError, OptionError, convert_checkpoint

ROOT = Path(__file__).resolve().parents[2]
FC2 = "transformer.layers.0.mlp.fc2.weight"


def _source(folder: Path, *, edit=None, config_edit=None, legacy: bool = False) -> Path:
    config = reference_config("jrt")
    state_dict = reference_state_dict(reference_config("jrt"))
    if edit is not None:
        edit(state_dict)
    if config_edit is not None:
        config_edit(config)
    write_reference_checkpoint(folder, config, state_dict, lightning=False)
    if legacy:  # the pre-zip format of torch < 1.6
        weights = folder / "pytorch_model.bin"
        torch.save(torch.load(weights, weights_only=True), weights, _use_new_zipfile_serialization=False)
    return folder


def _assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if the weights are read (the checks under test must come first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before the check")

    monkeypatch.setattr(checkpoint.torch, "load", refuse)


# ----------------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--max-shard-size", "abc"], "--max-shard-size: 'abc' is not a size: write a number with one of the units"),
        (["--max-shard-size", "0GB"], "--max-shard-size: '0GB' is not a positive size"),
        (["--tokenizer", "/nonexistent/tok"], "--tokenizer '/nonexistent/tok' is not an existing folder"),
        (["--prefix-pad-token-id", "-1"], "--prefix-pad-token-id must be a token id (an integer >= 0), got -1"),
    ],
    ids=["shard-size", "zero-shard-size", "tokenizer", "negative-pad"],
)
def test_bad_options_are_usage_errors_before_anything_is_read(tmp_path, capsys, no_weights_read, arguments, message):
    source = tmp_path / "does-not-exist"  # not even the source is looked at first
    assert jrt_main(["convert", str(source), str(tmp_path / "out"), *arguments]) == 2
    err = capsys.readouterr().err
    assert err == f"jrt convert: error: {message}" + err.split(message, 1)[1] and err.count("\n") == 1
    _assert_nothing_written(tmp_path)


def test_option_errors_are_typed_in_python(tmp_path):
    with pytest.raises(OptionError, match=r"dtype must be one of \['float32', 'bfloat16', 'float16'\], got 'fp8'"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype="fp8")
    with pytest.raises(OptionError, match=r"is the filesystem root"):
        convert_checkpoint(tmp_path / "src", "/", overwrite=True)


def test_prefix_pad_outside_the_vocabulary_is_a_usage_error(tmp_path, capsys):
    source = _source(tmp_path / "src")
    assert jrt_main(["convert", str(source), str(tmp_path / "out"), "--prefix-pad-token-id", "264"]) == 2
    assert "--prefix-pad-token-id 264 is outside this checkpoint's vocabulary (264 embedding rows)" in (
        capsys.readouterr().err
    )
    _assert_nothing_written(tmp_path)


# ------------------------------------------------------------------------------------------------ config sizes


@pytest.mark.parametrize(
    "config_edit, message",
    [
        (lambda c: c.update(n_layer=1_000_000_000),
         r"field 'n_layer' must be between 1 and 10000, got 1000000000: fix config\.json"),
        (lambda c: c.update(enc_length=1e15), r"field 'enc_length' must be between 1 and 1048576, got 1e\+15"),
        (lambda c: c["alt_mixer"].update(enc_length=1e15), r"'enc_length' must be between 1 and 1048576"),
        (lambda c: c.update(pad_vocab_size_multiple=0), r"field 'pad_vocab_size_multiple' must be between 1 and"),
        (lambda c: c.update(rotary_emb_base=[1, 2]),
         r"field 'rotary_emb_base' must be a positive number, got \[1, 2\]"),
        (lambda c: c.update(layer_norm_epsilon="1e-5"), r"field 'layer_norm_epsilon' must be a positive number"),
        (lambda c: c.update(vocab_size=10**12), r"field 'vocab_size' must be between 1 and 16777216"),
        # A negative eos id was reported as `pad_token_id` (the converted config's pad is the reference's eos).
        (lambda c: c.update(eos_token_id=-7),
         r"^config\.json field 'eos_token_id' must be a token id \(an integer >= 0\), got -7: fix config\.json"),
        (lambda c: c.update(bos_token_id=-1), r"^config\.json field 'bos_token_id' must be a token id"),
        (lambda c: c.update(mask_token_id=-2), r"^config\.json field 'mask_token_id' must be a token id .* got -2"),
        (lambda c: c.update(eos_token_id="50256"), r"field 'eos_token_id' must be an integer, got '50256'"),
    ],
    ids=["n_layer", "enc_length", "alt_mixer-enc_length", "pad-multiple-0", "rotary-list", "eps-string", "vocab",
         "eos-negative", "bos-negative", "mask-negative", "eos-string"],
)
def test_config_sizes_are_bounded_before_the_weights_are_read(tmp_path, monkeypatch, config_edit, message):
    source = _source(tmp_path / "src", config_edit=config_edit)
    monkeypatch.setattr(checkpoint.torch, "load", lambda *a, **k: pytest.fail("the weights were read first"))
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(source, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_layer_count_is_held_against_the_weights(tmp_path):
    source = _source(tmp_path / "src", config_edit=lambda c: c.update(n_layer=5000))
    message = r"config\.json n_layer=5000, but the weights hold layers 0-3 \(4 layers\): use the config\.json"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(source, tmp_path / "out")
    _assert_nothing_written(tmp_path)


# --------------------------------------------------------------------------------------- files that are not weights


def test_git_lfs_pointer_says_to_download_the_real_file(tmp_path):
    source = _source(tmp_path / "src")
    (source / "pytorch_model.bin").write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a2146b8ab0b3b1a5d8e7cd2d2ac31b7f16a4f6ee2f3d1f8f3f0a0c6e3b9a1\nsize 1426034567\n"
    )
    message = r"pytorch_model\.bin' is a Git LFS pointer file \(\d+ bytes\), not the weights: download the real file"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(source, tmp_path / "out")


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    source = _source(tmp_path / "src")
    generator = random.Random(0)
    for _ in range(50):
        (source / "pytorch_model.bin").write_bytes(bytes(generator.randrange(256) for _ in range(256)))
        with pytest.raises(ConversionError, match=r"is not a PyTorch checkpoint: .* damaged or not a checkpoint"):
            convert_checkpoint(source, tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_damaged_legacy_pickles_give_one_clear_error(tmp_path):
    """Truncated or corrupted pre-zip pickles (no checksum) fail with a ConversionError, never a raw traceback."""
    source = _source(tmp_path / "src", legacy=True)
    weights = source / "pytorch_model.bin"
    data = weights.read_bytes()
    generator = random.Random(0)
    truncations = sorted(generator.sample(range(32, len(data) - 1), 20))
    for length in truncations:
        weights.write_bytes(data[:length])
        with pytest.raises(ConversionError, match=r"the legacy torch\.save pickle is truncated, damaged or not a"):
            convert_checkpoint(source, tmp_path / "out")
    pickle_end = data.index(b"val_metrics") + 200  # the pickled dict (keys, storages) precedes the data
    for _ in range(40):
        damaged = bytearray(data)
        for _ in range(4):
            damaged[generator.randrange(32, pickle_end)] = generator.randrange(256)
        weights.write_bytes(bytes(damaged))
        try:
            convert_checkpoint(source, tmp_path / "out")
        except ConversionError:
            pass
        if (tmp_path / "out").exists():  # a harmless flip (a digit of a size): converted; start again
            for path in (tmp_path / "out").iterdir():
                path.unlink()
            (tmp_path / "out").rmdir()
    _assert_nothing_written(tmp_path)


def test_legacy_and_zip_checkpoints_convert_to_the_same_bytes(tmp_path):
    convert_checkpoint(_source(tmp_path / "zip"), tmp_path / "from-zip")
    convert_checkpoint(_source(tmp_path / "legacy", legacy=True), tmp_path / "from-legacy")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "from-zip" / name).read_bytes() == (tmp_path / "from-legacy" / name).read_bytes()


# ---------------------------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize(
    "make, shown",
    [
        (lambda t: t.to(torch.complex64), "(torch.complex64)"),
        (lambda t: (t * 100).to(torch.int64), "(torch.int64)"),
        (lambda t: t > 0, "(torch.bool)"),
        (lambda t: t.to_sparse(), "(sparse_coo torch.float32)"),
    ],
    ids=["complex", "int", "bool", "sparse"],
)
def test_tensors_that_are_not_real_floating_point_are_named(tmp_path, make, shown):
    def edit(state_dict):
        state_dict[FC2] = make(state_dict[FC2])

    message = (
        rf"these tensors are not dense real floating point, as model weights are: \['model\.{FC2}' "
        rf"{re.escape(shown)}\]\. Only float32, float64, float16 and bfloat16"
    )
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(_source(tmp_path / "src", edit=edit), tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_value_that_overflows_float16_is_named_before_writing(tmp_path):
    def edit(state_dict):
        state_dict[FC2][3, 5] = 1e5

    source = _source(tmp_path / "src", edit=edit)
    message = (
        r"these tensors hold values beyond float16's range \(\+-6\.55e\+04; largest magnitude found 1e\+05\): "
        rf"\['model\.{FC2}'\]\. They would become Inf: convert with --dtype bfloat16 or float32"
    )
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(source, tmp_path / "out", dtype="float16")
    _assert_nothing_written(tmp_path)
    convert_checkpoint(source, tmp_path / "out", dtype="bfloat16")  # bfloat16 holds it


def test_float64_checkpoint_converts_and_an_overflow_is_named(tmp_path):
    def as_float64(state_dict):
        for key in list(state_dict):
            state_dict[key] = state_dict[key].double()
        state_dict["lm_head.weight"] = state_dict["transformer.embeddings.word_embeddings.weight"]

    convert_checkpoint(_source(tmp_path / "ok", edit=as_float64), tmp_path / "converted")

    def huge(state_dict):
        as_float64(state_dict)
        state_dict[FC2][0, 0] = 1e300

    message = rf"beyond float32's range \(\+-3\.403e\+38; largest magnitude found 1e\+300\): \['model\.{FC2}'\]\. "
    with pytest.raises(ConversionError, match=message + r"They would become Inf: the checkpoint is damaged"):
        convert_checkpoint(_source(tmp_path / "src", edit=huge), tmp_path / "out")
    _assert_nothing_written(tmp_path)


# -------------------------------------------------------------------------------------------------- disk full


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # `ulimit -f`: the weights need about 1.4 MB


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs RLIMIT_FSIZE (ulimit -f)")
def test_disk_full_while_writing_is_one_line_naming_the_destination_and_the_bytes(tmp_path):
    source = _source(tmp_path / "src")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    process = subprocess.run(
        [sys.executable, "-m", "jrt_cli", "convert", str(source), str(tmp_path / "out")],
        env=env, capture_output=True, text=True, preexec_fn=_limit_file_size, timeout=300,
    )
    assert process.returncode == 1, process.stderr[-2000:]
    error = process.stderr.strip().splitlines()[-1]
    assert error.startswith(
        f"jrt convert: error: Cannot write the converted folder for '{tmp_path / 'out'}': File too large (it needs "
        "about 1,"
    ), error
    assert "bytes for the weights). Free some space" in error and "Traceback" not in process.stderr
    _assert_nothing_written(tmp_path)


def test_no_space_left_is_reported_the_same_way(tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "write_shards", full)
    with pytest.raises(ConversionError, match=r"for '.*out': No space left on device \(it needs about [\d,]+ bytes"):
        convert_checkpoint(_source(tmp_path / "src"), tmp_path / "out")
    _assert_nothing_written(tmp_path)


def test_a_negative_eos_id_names_its_field_from_the_command_line_with_or_without_a_tokenizer(tmp_path, capsys):
    """With a tokenizer the eos check compared it with the tokenizer's ("the checkpoint's -7"); without one the
    converted config refused `pad_token_id`. Both now name eos_token_id, before the weights are read."""
    from jrt_cli.main import main

    source = _source(tmp_path / "src", config_edit=lambda c: c.update(eos_token_id=-7))
    tokenizer = tmp_path / "tokenizer"
    from jrt_convert.example import example_tokenizer

    example_tokenizer().save_pretrained(tokenizer)
    for extra in ([], ["--tokenizer", str(tokenizer)]):
        assert main(["convert", str(source), str(tmp_path / "out"), *extra]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "field 'eos_token_id' must be a token id" in err and "pad_token_id" not in err
    _assert_nothing_written(tmp_path)
