"""`--overwrite` replaces only what `jrt convert` wrote, file for file and unchanged (its manifest); anything a user
saved or edited is refused by name and kept byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reference_checkpoints import reference_config, reference_state_dict, write_reference_checkpoint
from transformers import AutoModelForCausalLM

import jrt_convert.pipeline as pipeline
from jrt_cli.main import main as jrt_main
from jrt_convert import ConversionError, convert_checkpoint
from jrt_convert.safety import MANIFEST_NAME, check_manifest, sha256_of_file


def _source(folder: Path) -> Path:
    config = reference_config("jrt")
    write_reference_checkpoint(folder, config, reference_state_dict(config), lightning=False)
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """A source checkpoint and one conversion of it (copied per test)."""
    root = tmp_path_factory.mktemp("overwrite")
    source = _source(root / "src")
    convert_checkpoint(source, root / "first")
    return source, root / "first"


def _copy(folder: Path, destination: Path) -> Path:
    destination.mkdir()
    for name, data in _snapshot(folder).items():
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        (destination / name).write_bytes(data)
    return destination


def test_manifest_lists_every_file_with_its_hash(converted):
    _, out = converted
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    files = {p.name for p in out.iterdir() if p.name != MANIFEST_NAME}
    assert set(manifest["files"]) == files
    for name, record in manifest["files"].items():
        assert record == {"size": (out / name).stat().st_size, "sha256": sha256_of_file(out / name)}
    assert check_manifest(out)[0].replaceable


def test_overwrite_replaces_an_unchanged_conversion(converted, tmp_path):
    source, first = converted
    out = _copy(first, tmp_path / "out")
    assert jrt_main(["convert", str(source), str(out), "--overwrite", "--prefix-pad-masking", "strict"]) == 0
    assert json.loads((out / "config.json").read_text())["prefix_pad_masking"] == "strict"
    assert not list(tmp_path.glob(".out*"))


def test_overwrite_refuses_a_fine_tuned_model_saved_with_save_pretrained(converted, tmp_path, capsys):
    """A model saved by the user (a jrt_rnn config.json with auto_map, as a conversion has) has no manifest: kept."""
    source, first = converted
    model = AutoModelForCausalLM.from_pretrained(first)
    model.save_pretrained(tmp_path / "finetuned")
    before = _snapshot(tmp_path / "finetuned")
    assert "auto_map" in json.loads((tmp_path / "finetuned" / "config.json").read_text())
    capsys.readouterr()  # the loading progress bars
    assert jrt_main(["convert", str(source), str(tmp_path / "finetuned"), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"was not written by `jrt convert` (no {MANIFEST_NAME}; it holds " in err and "model.safetensors" in err
    assert _snapshot(tmp_path / "finetuned") == before


def test_overwrite_refuses_added_and_edited_files_and_names_them(converted, tmp_path):
    source, first = converted
    out = _copy(first, tmp_path / "out")
    (out / "my_analysis.py").write_text("print(1)\n")
    (out / "README.md").write_text((out / "README.md").read_text() + "\nMy notes.\n")
    (out / "runs").mkdir()
    before = _snapshot(out)
    message = (
        r"holds files the conversion did not write: my_analysis\.py, runs/; and files changed since the conversion: "
        r"README\.md\. --overwrite replaces only what `jrt convert` wrote, unchanged, so nothing was touched"
    )
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(source, out, overwrite=True)
    assert _snapshot(out) == before and (out / "runs").is_dir()
    assert not list(tmp_path.glob(".out*"))


def test_a_file_added_during_the_conversion_stops_the_swap(converted, tmp_path, monkeypatch):
    """The destination is checked again right before it is replaced: a file saved there meanwhile is kept."""
    source, first = converted
    out = _copy(first, tmp_path / "out")
    real_verify = pipeline.verify_folder

    def verify_then_save(folder, hashes, model):
        real_verify(folder, hashes, model)
        (out / "checkpoint-100.txt").write_text("saved while converting")

    monkeypatch.setattr(pipeline, "verify_folder", verify_then_save)
    with pytest.raises(ConversionError, match=r"changed during the conversion \(\['checkpoint-100\.txt'\]\)"):
        convert_checkpoint(source, out, overwrite=True)
    assert (out / "checkpoint-100.txt").read_text() == "saved while converting"
    assert _snapshot(out) == {**_snapshot(first), "checkpoint-100.txt": b"saved while converting"}
    assert not list(tmp_path.glob(".out*"))


def test_overwrite_of_dot_is_checked_like_any_folder(converted, tmp_path, monkeypatch, capsys):
    """`jrt convert SRC . --overwrite` names the current folder's files instead of failing on an empty name."""
    source, _ = converted
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    assert jrt_main(["convert", str(source), ".", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert f"'{work}' was not written by `jrt convert`" in err and "notes.txt" in err
    assert (work / "notes.txt").read_text() == "mine" and sorted(p.name for p in work.iterdir()) == ["notes.txt"]
