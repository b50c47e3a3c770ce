"""`jrt convert` never loses data: destinations it refuses, SIGTERM / SIGKILL clean-up, damaged input, pre-flight
checks, and errors that name the file and the field."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import huggingface_hub.constants
import pytest
from huggingface_hub import HfApi
from reference_checkpoints import reference_config, reference_state_dict, write_reference_checkpoint

import jrt_convert.safety as safety
from jrt_cli.main import main as jrt_main
from jrt_convert import ConversionError, convert_checkpoint
from jrt_convert.hub import HUB_ERRORS

ROOT = Path(__file__).resolve().parents[2]


def _source(folder: Path, *, edit=None, config_edit=None) -> Path:
    config = reference_config("jrt")
    state_dict = reference_state_dict(reference_config("jrt"))
    if edit is not None:
        edit(state_dict)
    if config_edit is not None:
        config_edit(config)
    write_reference_checkpoint(folder, config, state_dict, lightning=False)
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# ------------------------------------------------------------------------------------------------ destinations


def test_destination_equal_to_the_source_is_refused(tmp_path):
    source = _source(tmp_path / "ckpt")
    before = _snapshot(tmp_path)
    with pytest.raises(ConversionError, match=r"is the source checkpoint or a folder containing it"):
        convert_checkpoint(source, source, overwrite=True)
    assert _snapshot(tmp_path) == before


def test_destination_containing_the_source_is_refused(tmp_path):
    parent = tmp_path / "parent"
    source = _source(parent / "ckpt")
    (parent / "notes.txt").write_text("unrelated")
    before = _snapshot(tmp_path)
    assert jrt_main(["convert", str(source), str(parent), "--overwrite"]) == 1
    assert _snapshot(tmp_path) == before
    with pytest.raises(ConversionError, match=r"a folder containing it"):
        convert_checkpoint(source / "pytorch_model.bin", parent, overwrite=True)


def test_destination_inside_the_source_folder_is_refused(tmp_path, capsys):
    """`jrt convert SRC SRC/inner-hf` wrote 18 files into the source folder, which is never written."""
    source = _source(tmp_path / "ckpt")
    before = _snapshot(tmp_path)
    assert jrt_main(["convert", str(source), str(source / "inner-hf")]) == 1
    assert "is inside the source folder" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before and not (source / "inner-hf").exists()


def test_overwrite_refuses_folders_a_conversion_did_not_write(tmp_path):
    source = _source(tmp_path / "src")
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_type": "jrt_rnn", "auto_map": {}}))
    with pytest.raises(ConversionError, match=r"was not written by `jrt convert`"):
        convert_checkpoint(source, other, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match=r"is not a folder"):
        convert_checkpoint(source, tmp_path / "file", overwrite=True)
    assert (other / "sub").is_dir() and (tmp_path / "file").read_text() == "x"


def test_destination_that_cannot_be_written_is_refused_before_reading(tmp_path):
    source = _source(tmp_path / "src")
    (tmp_path / "blocker").write_text("a file, not a folder")
    with pytest.raises(ConversionError, match=r"Cannot write next to the destination"):
        convert_checkpoint(source, tmp_path / "blocker" / "out")


def test_not_enough_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    source = _source(tmp_path / "src")
    monkeypatch.setattr(safety.shutil, "disk_usage", lambda path: mock.Mock(free=10 * 2**20))
    with pytest.raises(ConversionError, match=r"Not enough free space .* needs about 0\.\d\d GiB.* 0\.01 GiB free"):
        convert_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


# ---------------------------------------------------------------------------------------------------- signals

_SLOW_CONVERSION = """
import sys, time
from pathlib import Path
import jrt_convert.pipeline as pipeline

def slow_verify(folder, hashes, model):
    Path(sys.argv[3]).write_text(str(folder))
    time.sleep(120)

pipeline.verify_folder = slow_verify
from jrt_cli.main import main
sys.exit(main(["convert", sys.argv[1], sys.argv[2]]))
"""


def test_sigterm_removes_the_staging_folder(tmp_path):
    source = _source(tmp_path / "src")
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERSION, str(source), str(tmp_path / "out"), str(ready)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists(), process.stderr.read().decode()
    staging = Path(ready.read_text())
    assert staging.is_dir() and staging.name.startswith(f".out.tmp-{process.pid}-")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    assert not staging.exists() and not (tmp_path / "out").exists()


def test_next_run_removes_what_a_killed_run_left(tmp_path):
    """SIGKILL cannot be caught: the staging and backup folders of the dead process are settled by the next run."""
    source = _source(tmp_path / "src")
    dead = _dead_pid()
    stale = tmp_path / f".out.tmp-{dead}-abcd1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    live = tmp_path / f".out.tmp-{os.getppid()}-live0000"  # a running process's staging is left alone
    live.mkdir()
    result = convert_checkpoint(source, tmp_path / "out")
    assert not stale.exists() and live.is_dir()
    assert any(f"removed {stale.name}" in note for note in result.notes)


def test_killed_overwrite_swap_is_restored(tmp_path):
    """Killed between the two renames of --overwrite: the previous conversion is moved back, nothing is lost."""
    source = _source(tmp_path / "src")
    convert_checkpoint(source, tmp_path / "first")
    backup = tmp_path / f".out.old-{_dead_pid()}-abcd1234"
    (tmp_path / "first").rename(backup)
    before = _snapshot(backup)
    notes = safety.remove_stale_staging(tmp_path / "out")
    assert _snapshot(tmp_path / "out") == before and not backup.exists()
    assert notes == [f"restored {tmp_path / 'out'} from the backup {backup.name} of an interrupted --overwrite"]


# ------------------------------------------------------------------------------------------------ input integrity


def test_damaged_download_is_refused(tmp_path):
    source = _source(tmp_path / "src")
    weights = source / "pytorch_model.bin"
    data = bytearray(weights.read_bytes())
    offset = data.find(b"/data/0") + 400  # inside the first tensor's bytes
    data[offset] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin' is damaged: its record .* fails the CRC-32 check"):
        convert_checkpoint(source, tmp_path / "out")
    weights.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ConversionError, match=r"Cannot read .*pytorch_model\.bin.* truncated or damaged"):
        convert_checkpoint(source, tmp_path / "out")
    weights.write_bytes(b"")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin' is empty \(0 bytes\)"):
        convert_checkpoint(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_tensor_is_named(tmp_path, value):
    def edit(state_dict):
        state_dict["transformer.layers.0.mlp.fc2.weight"][3, 5] = value

    message = r"NaN or Inf values: \['model\.transformer\.layers\.0\.mlp\.fc2\.weight'\]"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(_source(tmp_path / "src", edit=edit), tmp_path / "out")


def _write_config(folder: Path, text: str) -> Path:
    (folder / "config.json").write_text(text)
    return folder


@pytest.mark.parametrize(
    "config_edit, message",
    [
        (lambda c: c.update(n_head="four"), r"config\.json field 'n_head' must be an integer, got 'four'"),
        (lambda c: c.update(n_layer=4.5), r"config\.json field 'n_layer' must be an integer, got 4\.5"),
        (lambda c: c["alt_mixer"].update(feature_dim="4"), r"'alt_mixer\.feature_dim' must be an integer"),
        (lambda c: c.update(layer_norm_epsilon="abc"), r"field 'layer_norm_epsilon' must be a positive number, got 'abc'"),
        (lambda c: c.update(alt_mixer_layers="1"), r"'alt_mixer_layers' must be a list of layer indices, got '1'"),
        (lambda c: c.update(alt_mixer_layers=[1, 2], alt_mixer_2_layers=[2]),
         r"lists layers \[2\] in both alt_mixer_layers \(linear attention\) and alt_mixer_2_layers"),
        (lambda c: c.update(alt_mixer_layers=[2], alt_mixer_2_layers=[2]),
         r"lists layers \[2\] in both alt_mixer_layers"),
    ],
)
def test_config_errors_name_the_field(tmp_path, config_edit, message):
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(_source(tmp_path / "src", config_edit=config_edit), tmp_path / "out")


def test_invalid_json_names_the_file_and_position(tmp_path):
    source = _source(tmp_path / "src")
    _write_config(source, '{"n_layer": 4,\n "n_head": }')
    with pytest.raises(ConversionError, match=r"config\.json' is not valid JSON: Expecting value at line 2, column 12"):
        convert_checkpoint(source, tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------- hub


def test_offline_push_to_hub_fails_before_converting_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    source = _source(tmp_path / "src")
    assert jrt_main(["convert", str(source), str(tmp_path / "out"), "--push-to-hub", "me/jrt-hf"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jrt convert: error: Cannot upload to 'me/jrt-hf'")
    assert "nothing was converted" in err and not (tmp_path / "out").exists()


def test_connection_refused_is_one_line(tmp_path, capsys):
    transport_error = HUB_ERRORS[-1]
    source = _source(tmp_path / "src")
    with mock.patch.object(HfApi, "create_repo", side_effect=transport_error("[Errno 111] Connection refused")):
        assert jrt_main(["convert", str(source), str(tmp_path / "out"), "--push-to-hub", "me/jrt-hf"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Connection refused" in err and "hf auth login" in err



def test_sigterm_between_the_overwrite_renames_puts_the_previous_folder_back(tmp_path, monkeypatch):
    import jrt_convert.pipeline as pipeline

    source = _source(tmp_path / "src")
    convert_checkpoint(source, tmp_path / "out")
    before = _snapshot(tmp_path / "out")
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".out.tmp-"):  # the second rename: staging -> destination
            raise safety.Terminated(143)
        real_replace(src, dst)

    monkeypatch.setattr(pipeline.os, "replace", replace)
    with pytest.raises(safety.Terminated):
        convert_checkpoint(source, tmp_path / "out", overwrite=True)
    assert _snapshot(tmp_path / "out") == before and not list(tmp_path.glob(".out*"))
