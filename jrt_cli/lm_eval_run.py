"""`jrt lm-eval ...`: lm-evaluation-harness's own command line, with jrt-rnn's model and recall tasks registered.

Everything after `lm-eval` is lm-eval's (`lm-eval run --help`). This front end only

- imports `jrt_eval.lm`, which registers the model `jrt` (`JRTLM`: leak-free JRT prefix scoring),
- uses `--model jrt` when no `--model` is given (any other lm-eval model still works),
- adds `jrt_eval.TASKS_DIR` (the recall tasks `jrt_swde`, `jrt_swde_twice`, ...) to `--include_path`,

then hands over to lm-eval (`lm_eval._cli.HarnessCLI`), which parses, evaluates and writes results as usual.
"""

from __future__ import annotations

import argparse
import sys

LM_EVAL_SUBCOMMANDS: tuple[str, ...] = ("run", "ls", "validate")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lm-eval",
        add_help=False,
        help="lm-evaluation-harness with the `jrt` model and the recall tasks (arguments: lm-eval's)",
        description=__doc__,
    )
    parser.set_defaults(func=run, passthrough=True)


def lm_eval_argv(extra: list[str]) -> list[str]:
    """The lm-eval argument list for `jrt lm-eval EXTRA`: `run` and `--model jrt` added when absent."""
    argv = list(extra)
    if not argv or argv[0] not in LM_EVAL_SUBCOMMANDS:
        argv.insert(0, "run")
    if argv[0] == "run" and not any(arg in ("--model", "-M") or arg.startswith("--model=") for arg in argv):
        if not any(arg in ("-h", "--help") for arg in argv):
            argv[1:1] = ["--model", "jrt"]
    return argv


def run(args: argparse.Namespace) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "`jrt lm-eval` needs lm-evaluation-harness, the optional `eval` extra: pip install 'jrt-rnn[eval]'"
        ) from None
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import jrt_eval.lm  # noqa: F401  (registers the lm-eval model "jrt")
    from jrt_eval import TASKS_DIR

    setup_logging()
    cli = HarnessCLI()
    saved_argv = sys.argv
    sys.argv = ["lm-eval", *lm_eval_argv(args.extra)]
    try:
        lm_eval_args = cli.parse_args()
    finally:
        sys.argv = saved_argv
    if hasattr(lm_eval_args, "include_path"):
        user_path = lm_eval_args.include_path
        lm_eval_args.include_path = [str(TASKS_DIR)] + ([user_path] if user_path else [])
    cli.execute(lm_eval_args)
    return 0
