"""Checkpoints that cannot be converted stop with a message naming the problem, and leave nothing behind."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from reference_checkpoints import reference_config, reference_state_dict, write_reference_checkpoint

from jrt_cli.main import main as jrt_main
from jrt_convert import ConversionError, convert_checkpoint


def _source(tmp_path: Path, *, case: str = "jrt", edit=None, config_edit=None) -> Path:
    config = reference_config(case)
    if config_edit is not None:
        config_edit(config)
    state_dict = reference_state_dict(reference_config(case))
    if edit is not None:
        edit(state_dict)
    folder = tmp_path / "src"
    write_reference_checkpoint(folder, config, state_dict, lightning=False)
    return folder


def _assert_no_output(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*")), "a staging folder was left behind"


def test_missing_key(tmp_path):
    source = _source(tmp_path, edit=lambda sd: sd.pop("transformer.layers.1.mixer.proj_k_enc.weight"))
    message = r"1 reference keys missing[\s\S]*transformer\.layers\.1\.mixer\.proj_k_enc\.weight"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(source, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_extra_key(tmp_path):
    def edit(sd):
        sd["transformer.layers.0.mixer.conv.conv.bias"] = torch.zeros(128)
        sd["transformer.layers.2.mixer.rotary_emb.inv_freq"] = torch.zeros(8)

    message = r"2 reference keys that no key table[\s\S]*conv\.conv\.bias[\s\S]*inv_freq"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(_source(tmp_path, edit=edit), tmp_path / "out")
    _assert_no_output(tmp_path)


def test_wrong_shape(tmp_path):
    def edit(sd):
        sd["transformer.layers.2.mixer.Wqkv.weight"] = torch.zeros(3 * 64, 32)

    message = r"Wqkv\.weight \(192, 32\) -> model\.layers\.2\.mixer\.q_proj\.weight expects \(64, 64\)"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(_source(tmp_path, edit=edit), tmp_path / "out")
    _assert_no_output(tmp_path)


def test_untied_head_and_wrong_decay_buffer(tmp_path):
    def edit(sd):
        sd["lm_head.weight"] = sd["lm_head.weight"] + 1
        sd["transformer.decay.decay"] = torch.zeros(4)

    source = _source(tmp_path, case="based-decay", edit=edit)
    with pytest.raises(ConversionError, match=r"lm_head\.weight differs[\s\S]*transformer\.decay\.decay holds"):
        convert_checkpoint(source, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_unknown_family(tmp_path):
    def mamba_like(config):  # the Mamba / attention baselines have no mixer dicts
        for key in ("mixer", "alt_mixer", "alt_mixer_2"):
            config.pop(key)

    with pytest.raises(ConversionError, match=r"Unknown checkpoint family: config\.json has no 'mixer' dict"):
        convert_checkpoint(_source(tmp_path, config_edit=mamba_like), tmp_path / "out")

    def hedgehog(config):
        config["alt_mixer"]["feature_name"] = "hedgehog"

    with pytest.raises(ConversionError, match=r"Unsupported linear-attention feature map \(feature_name='hedgehog'"):
        convert_checkpoint(_source(tmp_path, config_edit=hedgehog), tmp_path / "out")
    _assert_no_output(tmp_path)


def test_family_that_does_not_fit(tmp_path):
    with pytest.raises(ConversionError, match=r"--family based-original does not fit.*'jrt' family"):
        convert_checkpoint(_source(tmp_path), tmp_path / "out", family="based-original")
    with pytest.raises(ConversionError, match=r"use_decay_proj=true, but the based-original family"):
        convert_checkpoint(_source(tmp_path, case="based-decay"), tmp_path / "out", family="based-original")
    _assert_no_output(tmp_path)


def test_unsupported_pickle_content(tmp_path):
    """A Lightning checkpoint whose hyper-parameters are arbitrary Python objects is refused, not unpickled."""
    folder = _source(tmp_path)
    (folder / "pytorch_model.bin").unlink()
    state_dict = {f"model.{k}": v for k, v in reference_state_dict(reference_config("jrt")).items()}
    torch.save({"state_dict": state_dict, "hyper_parameters": argparse.Namespace(lr=8e-4)}, folder / "last.ckpt")
    message = r"Refusing to load .*last\.ckpt.*arbitrary code[\s\S]*argparse\.Namespace"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(folder, tmp_path / "out")
    _assert_no_output(tmp_path)


class Payload:
    """A custom class pickled into a checkpoint (torch's weights-only unpickler refuses it)."""

    def __init__(self, value: int = 1):
        self.value = value


class RunsCode:
    """A pickle that would run a shell command when unpickled: `os.system` (torch blocks its module, `posix`/`nt`)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "make_object, names",
    [
        (lambda marker: Payload(), f"{__name__}.Payload"),
        (lambda marker: RunsCode(marker), "system"),
        (lambda marker: {"nested": [Payload(2)]}, f"{__name__}.Payload"),
    ],
    ids=["custom-class", "os-system", "nested-custom-class"],
)
@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
@pytest.mark.parametrize(
    "save_kwargs",
    [{}, {"_use_new_zipfile_serialization": False}, {"pickle_protocol": 4}],
    ids=["zip", "legacy", "protocol-4"],
)
def test_a_checkpoint_that_carries_code_is_refused_as_such_whatever_torch_calls_it(
    tmp_path, make_object, names, save_kwargs
):
    """A real checkpoint that pickles a custom class or a function call is refused as "contains Python objects", naming
    what it imports: decided by the pickle's GLOBAL / STACK_GLOBAL opcodes, not by the wording of one torch release
    (torch 2.13 says "Trying to load unsupported GLOBAL ... whose module ... is blocked" for `os.system`), and never
    as "truncated, damaged or not a checkpoint". Nothing in it runs."""
    folder = _source(tmp_path)
    marker = tmp_path / "code-ran"
    state_dict = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state_dict, "extra": make_object(marker)}, folder / "pytorch_model.bin", **save_kwargs)
    with pytest.raises(ConversionError) as raised:
        convert_checkpoint(folder, tmp_path / "out")
    message = str(raised.value)
    assert message.startswith(f"Refusing to load {str(folder / 'pytorch_model.bin')!r}: it contains Python objects")
    assert names in message and "arbitrary code" in message and "weights_only=False" in message
    assert "damaged" not in message and "\n" not in message
    assert not marker.exists()
    _assert_no_output(tmp_path)


def test_a_refused_object_is_recognised_whatever_torch_words_its_refusal(tmp_path, monkeypatch):
    """A future torch that words its refusal differently: the pickle's imports still say what happened."""
    import pickle

    folder = _source(tmp_path)
    state_dict = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state_dict, "extra": Payload()}, folder / "pytorch_model.bin")

    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError("Weights only load failed.\n\tsomething new happened\n")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(ConversionError, match=rf"Refusing to load .*Python objects .*\({__name__}\.Payload\)"):
        convert_checkpoint(folder, tmp_path / "out")
    _assert_no_output(tmp_path)


def test_a_checkpoint_that_carries_code_is_one_line_exit_1_from_the_command_line(tmp_path, capsys):
    folder = _source(tmp_path)
    state_dict = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state_dict, "extra": RunsCode(tmp_path / "code-ran")}, folder / "pytorch_model.bin")
    assert jrt_main(["convert", str(folder), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "contains Python objects other than tensors" in err and "system" in err
    assert "is blocked" in err  # torch's own reason is quoted at the end
    assert not (tmp_path / "code-ran").exists()


def test_a_weights_only_failure_that_names_no_object_says_both_causes(tmp_path, monkeypatch):
    """torch's weights-only unpickler can stop on an operand it does not name (damaged bytes, or an object it has no
    rule for): the message gives both causes and the recipe for a trusted file, not "damaged" alone."""
    import pickle

    source = _source(tmp_path)

    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError(
            "Weights only load failed. ...\n\tWeightsUnpickler error: Unsupported operand 149\n\nCheck the docs"
        )

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(ConversionError) as raised:
        convert_checkpoint(source, tmp_path / "out")
    message = str(raised.value)
    assert "Unsupported operand 149" in message and "holds Python objects other than tensors" in message
    assert "weights_only=False" in message and "download or copy it again" in message
    _assert_no_output(tmp_path)


def test_existing_destination_is_kept(tmp_path):
    source = _source(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match=r"already exists.*--overwrite"):
        convert_checkpoint(source, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"

    # --overwrite replaces only a previous conversion (see test_convert_safety.py), never a folder of other files.
    with pytest.raises(ConversionError, match=r"was not written by `jrt convert`"):
        convert_checkpoint(source, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "out" / "keep.txt").unlink()
    convert_checkpoint(source, tmp_path / "out", overwrite=True)  # an empty folder may be replaced
    convert_checkpoint(source, tmp_path / "out", overwrite=True)  # and so may a previous conversion
    assert (tmp_path / "out" / "config.json").is_file()
    assert not list(tmp_path.glob(".out*"))


def test_failure_after_staging_leaves_nothing(tmp_path, monkeypatch):
    """An error while writing or verifying (here: during verification) removes the half-written folder."""
    import jrt_convert.pipeline as pipeline

    def broken_verify(folder, hashes, model):
        assert any(folder.iterdir())  # the staging folder was being written
        raise ConversionError("Verification failed: simulated")

    monkeypatch.setattr(pipeline, "verify_folder", broken_verify)
    with pytest.raises(ConversionError, match="simulated"):
        convert_checkpoint(_source(tmp_path), tmp_path / "out")
    _assert_no_output(tmp_path)


def test_cli_reports_one_line_error(tmp_path, capsys):
    source = _source(tmp_path)
    (tmp_path / "out").mkdir()
    assert jrt_main(["convert", str(source), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jrt convert: error: Destination") and "--overwrite" in err


def test_source_not_found_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConversionError, match=r"Could not download 'hazyresearch/JRT-360M-30B'.*copy config\.json"):
        convert_checkpoint("hazyresearch/JRT-360M-30B", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="neither an existing file or folder nor a Hub repo id"):
        convert_checkpoint(str(tmp_path / "no" / "such" / "dir"), tmp_path / "out")
    _assert_no_output(tmp_path)
