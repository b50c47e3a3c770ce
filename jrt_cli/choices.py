"""What the `jrt` parsers show (choices, defaults, the demo models' folder), without importing torch or transformers.

Building the parser (`jrt --help`, every usage error) imports only this module and the standard library; a subcommand
imports the library inside its `run`. The tuples below repeat constants of the library (which imports torch);
tests/jrt_cli/test_cli_help.py checks that each equals its source.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

PREFIX_STRATEGIES: tuple[str, ...] = ("pad", "repeat", "none")  # modeling_jrt.configuration_jrt.PREFIX_STRATEGIES
PREFIX_PAD_MASKINGS: tuple[str, ...] = ("strict", "reference")  # modeling_jrt.configuration_jrt.PREFIX_PAD_MASKINGS
FAMILIES: tuple[str, ...] = ("jrt", "based-jrt-release", "based-original")  # jrt_convert.FAMILIES
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # the keys of jrt_convert.DTYPES
PROMPT_KINDS: tuple[str, ...] = ("default", "jrt")  # jrt_eval.jsonl_recall.PROMPT_KINDS

# The shipped demo models (`jrt demo`), defined here and re-exported by `jrt_cli.demo_models`.
MODELS_DIR = Path(__file__).resolve().parent / "assets" / "models"
DEMO_SEED = 2024

# Modules a parser must not import; checked by the tests.
HEAVY_MODULES: tuple[str, ...] = ("torch", "transformers", "lm_eval", "numpy", "datasets", "safetensors")

__all__ = ["DEMO_SEED", "DTYPES", "FAMILIES", "HEAVY_MODULES", "MODELS_DIR", "PREFIX_PAD_MASKINGS",
           "PREFIX_STRATEGIES", "PROMPT_KINDS"]


def integer_type(minimum: int, maximum: int | None = None, expected: str | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer in [minimum, maximum] (no maximum: at least `minimum`), a usage error while the
    arguments are parsed. `expected` words the range in the message ("a positive integer" / "an integer >= N")."""
    if expected is None:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse

