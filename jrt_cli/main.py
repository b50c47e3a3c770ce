"""`jrt`: the command line of jrt-rnn. Each subcommand is a thin argparse front end over library code.

Subcommand modules live beside this file and expose `add_parser(subparsers)`, which registers the subcommand
and sets `func(args) -> int` as its handler. Results go to stdout, diagnostics to stderr.

Exit codes and errors, the same for every subcommand:

    0   success
    1   a runtime error the user can act on (missing file, unreadable checkpoint, no network, bad data): one line
        `jrt COMMAND: error: ...` on stderr, no traceback
    2   a usage error (bad or conflicting arguments, raised as `UsageError` or by argparse): one line, no traceback
    130 interrupted (Ctrl-C); SIGTERM exits with 143 where a subcommand handles it (`jrt convert`)

`--debug` (before or after the subcommand) shows the full traceback of an expected error instead. Anything else (a
TypeError, an AttributeError, ...) is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules of this package that define a subcommand, in the order `jrt --help` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = ("demo", "generate", "eval_recall", "lm_eval_run", "convert")
# Errors that describe bad input or an unavailable resource, not a bug: reported in one line.
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError, ImportError)


class UsageError(ValueError):
    """Arguments that cannot work together or are out of range: exit code 2, like argparse's own errors."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jrt", description="JRT-RNN and Based models for HuggingFace Transformers.")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"jrt_cli.{name}").add_parser(subparsers)
    for subparser in subparsers.choices.values():
        # SUPPRESS keeps `jrt --debug COMMAND` working: the subcommand's default does not overwrite it.
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                               help="show the full traceback of errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # A pass-through subcommand (`jrt lm-eval`) receives the arguments it does not define in `args.extra`.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"jrt {args.command}: interrupted", file=sys.stderr)
        return 130
    except EXPECTED_ERRORS as error:
        if args.debug:
            raise
        print(f"jrt {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1


def quiet_transformers() -> None:
    """No "Loading weights" / "Writing model shards" progress bars from transformers in the `jrt` commands' output
    (imports transformers: call it in a subcommand's `run`, never while building the parser)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def require_lm_eval(command: str) -> None:
    """A one-line RuntimeError when lm-evaluation-harness, the optional `eval` extra `command` needs, is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RuntimeError(f"{command} lm-evaluation-harness, the optional "
                           "`eval` extra: pip install -e '.[eval]' in a checkout") from None


def one_line(error: BaseException) -> str:
    """The message of `error` on one line (a library's multi-line message is joined; empty ones get the type)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, KeyError) or not text:
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text


if __name__ == "__main__":
    sys.exit(main())
