"""Conversion of the released HazyResearch JRT-RNN / Based checkpoints to HF folders (installed as `jrt_convert`).

    from jrt_convert import convert_checkpoint, push_to_hub
    result = convert_checkpoint("hazyresearch/JRT-360M-30B", "JRT-360M-30B-hf")
    push_to_hub(result.destination, "me/JRT-360M-30B-hf")

The command line is `jrt convert SRC DST [options]`.
"""

from .checkpoint import ConversionError, read_reference_checkpoint
from .families import FAMILIES, KNOWN_CHECKPOINTS, detect_family, read_architecture
from .hub import download_reference_checkpoint, push_to_hub
from .pipeline import DTYPES, ConversionResult, OptionError, convert_checkpoint

__all__ = [
    "DTYPES",
    "FAMILIES",
    "KNOWN_CHECKPOINTS",
    "ConversionError",
    "ConversionResult",
    "OptionError",
    "convert_checkpoint",
    "detect_family",
    "download_reference_checkpoint",
    "push_to_hub",
    "read_architecture",
    "read_reference_checkpoint",
]
