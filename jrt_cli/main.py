"""`jrt`: the command line of jrt-rnn. Each subcommand is a thin argparse front end over library code.

Subcommand modules live beside this file and expose `add_parser(subparsers)`, which registers the subcommand
and sets `func(args) -> int` as its handler. Results go to stdout, diagnostics to stderr; bad input gives a
one-line error and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules of this package that define a subcommand, in the order `jrt --help` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = ("demo", "generate", "eval_recall", "lm_eval_run", "convert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jrt", description="JRT-RNN and Based models for HuggingFace Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"jrt_cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # A pass-through subcommand (`jrt lm-eval`) receives the arguments it does not define in `args.extra`.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"jrt {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
