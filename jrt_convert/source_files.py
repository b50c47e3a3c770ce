"""The files of a reference checkpoint, found and read without torch: the checks `jrt convert` runs first.

A wrong SRC (a folder without weights, a folder that is already converted, a config.json that is not JSON) or an
`--example` folder that is not empty is found here, by the standard library alone, so the command line answers at once
instead of after the seconds of importing torch and transformers (`jrt_cli/convert.py` calls these before
`jrt_convert.pipeline`, which calls them again for the Python API).
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "pytorch_model.bin"
LIGHTNING_SUFFIX = ".ckpt"
# The `model_type` of a folder written by `jrt convert` or by `save_pretrained` of a JRT-RNN model.
CONVERTED_MODEL_TYPE = "jrt_rnn"


class ConversionError(ValueError):
    """A checkpoint that cannot be converted as asked; the message says what is wrong and what to do."""


class NotACheckpointError(ConversionError):
    """SRC is not a released checkpoint (no weights in the folder, or a folder that is already converted): the
    command line's usage error (exit 2)."""


def find_weights_file(source: Path) -> Path:
    """`source` itself when it is a file, else `pytorch_model.bin` or the single `*.ckpt` inside the folder.

    Raises `NotACheckpointError` for a folder that is already converted (its config.json has model_type `jrt_rnn`),
    or a file in one, and for a folder that holds no weights, or several Lightning checkpoints."""
    if source.is_file():
        check_not_converted(source.parent)  # e.g. the model.safetensors of a converted folder
        return source
    if not source.is_dir():
        raise FileNotFoundError(f"Source checkpoint {str(source)!r} does not exist.")
    check_not_converted(source)
    weights = source / WEIGHTS_NAME
    if weights.is_file():
        return weights
    lightning = sorted(source.glob(f"*{LIGHTNING_SUFFIX}"))
    if len(lightning) == 1:
        return lightning[0]
    found = sorted(p.name for p in source.iterdir())
    if not lightning:
        listing = f"found {_short_listing(found)}" if found else "the folder is empty"
        raise NotACheckpointError(f"No weights in {str(source)!r}: expected {WEIGHTS_NAME!r} or one Lightning "
                                  f"'*{LIGHTNING_SUFFIX}' file next to {CONFIG_NAME!r}; {listing}. Give the folder "
                                  "of a released checkpoint (or a Hub id such as hazyresearch/JRT-360M-30B) as SRC.")
    raise NotACheckpointError(f"{str(source)!r} holds several Lightning checkpoints {[p.name for p in lightning]}: "
                              "pass the one to convert as SRC (its folder must also hold the reference config.json).")


def check_not_converted(folder: Path) -> None:
    """Refuse a folder that `jrt convert` (or `save_pretrained` of a JRT-RNN model) already wrote: its config.json
    has model_type `jrt_rnn`. Converting it again cannot work; it loads as it is."""
    config_file = folder / CONFIG_NAME
    try:
        config = json.loads(config_file.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return  # no config, or an unreadable one: `load_reference_config` says which
    if isinstance(config, dict) and config.get("model_type") == CONVERTED_MODEL_TYPE:
        weights = sorted(p.name for p in folder.glob("*.safetensors")) or sorted(p.name for p in folder.glob("*.bin"))
        holding = f"{_short_listing(weights)} and " if weights else ""
        raise NotACheckpointError(f"{str(folder)!r} is already a converted folder ({holding}a "
                                  f"config.json with model_type {CONVERTED_MODEL_TYPE!r}): it loads as "
                                  f"it is, with from_pretrained or `jrt generate --model {folder}`. `jrt "
                                  "convert` reads a released HazyResearch checkpoint (its config.json and "
                                  f"{WEIGHTS_NAME} or a Lightning '*{LIGHTNING_SUFFIX}').")


def load_reference_config(folder: Path) -> dict:
    """The reference `config.json` next to the weights, as a dict: a missing file, text that is not UTF-8 or not JSON,
    and JSON that is not an object are `ConversionError`s naming the file."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ConversionError(f"No {CONFIG_NAME!r} in {str(folder)!r}: the reference config (a "
                              "GPT2Config dump with the mixer dicts) must sit next to the weights.")
    try:
        config = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as error:
        raise ConversionError(f"{str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from error
    except json.JSONDecodeError as error:
        raise ConversionError(f"{str(path)!r} is not valid JSON: {error.msg} "
                              f"at line {error.lineno}, column {error.colno}.") from error
    if not isinstance(config, dict):
        raise ConversionError(f"{str(path)!r} must hold a JSON object, got {type(config).__name__}.")
    return config


def check_example_folder(folder: Path) -> None:
    """`jrt convert --example DIR` writes into a new or empty folder only, so that nothing is overwritten."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        what = "a file" if not folder.is_dir() else "a folder that is not empty"
        raise FileExistsError(f"{folder} is {what}: the example is written into a new (or empty) "
                              "folder only, so that nothing is overwritten; choose another DIR.")


def _short_listing(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return "[" + ", ".join(repr(name) for name in names[:limit]) + "]" + more


__all__ = ["CONFIG_NAME", "CONVERTED_MODEL_TYPE", "LIGHTNING_SUFFIX", "WEIGHTS_NAME", "ConversionError",
           "NotACheckpointError", "check_example_folder", "check_not_converted", "find_weights_file",
           "load_reference_config"]
