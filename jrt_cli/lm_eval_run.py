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
from pathlib import Path

from .main import UsageError, quiet_transformers
from .sources import check_model_source, go_offline, hub_unreachable

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


def build_lm_eval_cli():
    """lm-eval's `HarnessCLI` with `run --model` documented as defaulting to `jrt` (lm-eval's own says `hf`).

    Only lm-eval's argument parser is imported here (about 1 s): `--help` and usage errors never load torch.
    """
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    run_parser = cli._subparsers.choices["run"]
    for action in run_parser._actions:
        if "--model" in action.option_strings:
            action.default = "jrt"
            action.help = "Model name (default: jrt, jrt-rnn's leak-free JRT model; any lm-eval model works)"
    return cli


def check_model_args(lm_eval_args: argparse.Namespace) -> None:
    """`--model jrt` needs `pretrained=` in `--model_args`: a usage error before anything is loaded."""
    if getattr(lm_eval_args, "command", None) != "run" or getattr(lm_eval_args, "model", None) != "jrt":
        return
    model_args = lm_eval_args.model_args or {}
    if not isinstance(model_args, dict) or not model_args.get("pretrained"):
        raise UsageError(
            "the `jrt` model needs the checkpoint: --model_args pretrained=PATH_OR_HUB_ID[,key=value ...] "
            f"(got {model_args or 'none'!r})."
        )


def run(args: argparse.Namespace) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "`jrt lm-eval` needs lm-evaluation-harness, the optional `eval` extra: "
            "pip install -e '.[eval]' in a checkout"
        ) from None
    cli = build_lm_eval_cli()
    saved_argv = sys.argv
    sys.argv = ["jrt lm-eval", *lm_eval_argv(args.extra)]
    try:
        lm_eval_args = cli.parse_args()  # exits for --help (code 0) and for lm-eval's own usage errors (code 2)
    finally:
        sys.argv = saved_argv
    check_model_args(lm_eval_args)
    if getattr(lm_eval_args, "model", None) == "jrt":  # before the seconds of importing torch and transformers
        for key in ("pretrained", "tokenizer"):
            name = (lm_eval_args.model_args or {}).get(key)
            if isinstance(name, str):
                check_model_source(name, f"--model_args {key}")
    from lm_eval.utils import setup_logging

    import jrt_eval.lm  # noqa: F401  (registers the lm-eval model "jrt")
    from jrt_eval import TASKS_DIR

    setup_logging()
    quiet_transformers()
    if hasattr(lm_eval_args, "include_path"):
        user_path = lm_eval_args.include_path
        lm_eval_args.include_path = [str(TASKS_DIR)] + ([user_path] if user_path else [])
    check_run_arguments(lm_eval_args)
    offline_when_the_hub_is_unreachable(lm_eval_args)
    cli.execute(lm_eval_args)
    return 0


def offline_when_the_hub_is_unreachable(lm_eval_args: argparse.Namespace) -> None:
    """The tasks' data sets come from the Hub: when it cannot be reached (a few seconds' probe), read the local cache
    only, at once, instead of through a minute of retries per file, and say so (the model's source was checked the
    same way)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or not getattr(lm_eval_args, "tasks", None):
        return
    problem = hub_unreachable()
    if problem is None:
        return
    go_offline()
    import datasets.config

    datasets.config.HF_HUB_OFFLINE = True  # read once at import: tell the data set loader too
    print(
        f"note: the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached ({problem}): data sets are read from "
        "the local cache only (as with HF_HUB_OFFLINE=1).",
        file=sys.stderr,
    )


def check_run_arguments(lm_eval_args: argparse.Namespace) -> None:
    """What lm-eval would only find after loading the model and the data sets (minutes): the `jrt` model's
    `scoring=` and `prefix_strategy=`, `--batch_size`, and the task names. Usage errors, in a few seconds."""
    if getattr(lm_eval_args, "command", None) != "run":
        return
    if getattr(lm_eval_args, "model", None) == "jrt":
        from jrt_eval.lm import SCORING_MODES
        from modeling_jrt.configuration_jrt import PREFIX_STRATEGIES

        model_args = lm_eval_args.model_args or {}
        for key, allowed in (("scoring", SCORING_MODES), ("prefix_strategy", PREFIX_STRATEGIES)):
            if key in model_args and model_args[key] not in allowed:
                raise UsageError(
                    f"--model_args {key}={model_args[key]} is not one of {', '.join(allowed)} (the `jrt` model's)."
                )
    batch_size = getattr(lm_eval_args, "batch_size", None)
    if batch_size is not None and not _is_batch_size(str(batch_size)):
        raise UsageError(f"--batch_size {batch_size}: expected a positive integer, 'auto' or 'auto:N'.")
    tasks = getattr(lm_eval_args, "tasks", None)
    if tasks:
        from lm_eval.tasks import TaskManager

        names = [name for name in (tasks.split(",") if isinstance(tasks, str) else tasks) if name]
        manager = TaskManager(include_path=lm_eval_args.include_path)
        unknown = [name for name in names if not Path(name).exists() and not manager.match_tasks([name])]
        if unknown:
            raise UsageError(
                f"unknown task(s) {', '.join(unknown)}: `jrt lm-eval ls tasks` lists them (jrt-rnn's recall tasks "
                "are jrt_swde, jrt_fda, ..., see docs/evaluation.md)."
            )


def _is_batch_size(text: str) -> bool:
    if text == "auto":
        return True
    if text.startswith("auto:"):
        text = text[len("auto:"):]
    return text.isdigit() and int(text) > 0
