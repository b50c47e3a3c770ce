"""Conversion of the released HazyResearch JRT-RNN / Based checkpoints to HF folders (installed as `jrt_convert`).

    from jrt_convert import convert_checkpoint, push_to_hub
    result = convert_checkpoint("hazyresearch/JRT-360M-30B", "JRT-360M-30B-hf")
    push_to_hub(result.destination, "me/JRT-360M-30B-hf")

The command line is `jrt convert SRC DST [options]`.

The names below are imported on first use (PEP 562), so that `import jrt_convert.source_files` (the CLI's first
checks) does not import torch or transformers.
"""

from __future__ import annotations

import importlib

# Public name -> the module of this package that defines it.
_EXPORTS = {
    "ConversionError": "source_files", "FAMILIES": "families",
    "KNOWN_CHECKPOINTS": "families", "detect_family": "families", "read_architecture": "families",
    "download_reference_checkpoint": "hub", "push_to_hub": "hub", "DTYPES": "pipeline", "ConversionResult": "pipeline",
    "OptionError": "pipeline", "convert_checkpoint": "pipeline",
}


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
