"""Command line of the synthetic harness: run the recall experiments, rebuild their report, export demo models.

`python experiments/synthetic ACTION ...` from a checkout (or `python -m jrt_synthetic ACTION ...` with
`experiments/synthetic` on `PYTHONPATH`). Actions: `e1`, `e2`, `e1-small`, `report`, `evaluate`, `export`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .experiments import (ARMS, DEFAULT_STEPS, evaluate_saved_models, load_runs, run_directory_name, run_experiment,
                          summarize, write_summary)

# `export` writes here unless told otherwise: never into an installed package.
DEFAULT_EXPORT_DIR = Path("runs") / "demo-models"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python experiments/synthetic",
        description="Train tiny JRT-RNN and Based models on synthetic recall tasks (docs/synthetics.md): "
                    "E1 = JRT-RNN vs causal Based on set disjointness, E2 = JRT-Prompt vs standard prompt on "
                    "prefix-query MQAR. Each run is single-threaded; --jobs runs arms in parallel processes.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for experiment in ARMS:
        run = actions.add_parser(experiment, help=f"Run experiment {experiment.upper()} "
                                                  f"({' vs '.join(ARMS[experiment])}).")
        run.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
        run.add_argument("--steps", type=int, default=DEFAULT_STEPS[experiment],
                         help=f"training steps per run (default {DEFAULT_STEPS[experiment]})")
        run.add_argument("--jobs", type=int, default=2, help="parallel single-thread processes (default 2)")
        run.add_argument("--out", type=Path, default=Path("runs") / experiment, help="output folder")
        run.add_argument("--embedding-init-std", type=_init_std, default=1.0, metavar="STD|model",
                         help="std of the N(0, std^2) token-embedding init (default 1.0, PyTorch's nn.Embedding "
                              "default); 'model' keeps the model's initializer_range (0.02)")
        run.set_defaults(func=_run, experiment=experiment)
    report = actions.add_parser("report", help="Rebuild summary.json, results.md and accuracy.png of a run folder.")
    report.add_argument("experiment", choices=list(ARMS))
    report.add_argument("out", type=Path, help="folder written by an experiment (e1, e2, e1-small)")
    report.set_defaults(func=_report)
    extra = actions.add_parser("evaluate", help="Evaluate the saved models of a run folder on other slices "
                                                "(e.g. longer sets than in training).")
    extra.add_argument("out", type=Path, help="folder written by an experiment (e1, e2, e1-small)")
    extra.add_argument("--slices", type=_slice, nargs="+", required=True, metavar="A,B|D",
                       help="SD: set sizes `|A|,|B|` (e.g. 8,24 24,8); qmqar: number of pairs D")
    extra.add_argument("--examples", type=int, default=1000, help="examples per slice (default 1000)")
    extra.set_defaults(func=_evaluate)
    export = actions.add_parser(
        "export", help="Copy one seed's E1 models into a folder in the layout of the `jrt demo` models "
                       "(with token map and tokenizer); `jrt demo --models-dir DEST` runs them.")
    export.add_argument("out", type=Path, help="folder written by the e1 experiment")
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("--dest", type=Path, default=DEFAULT_EXPORT_DIR,
                        help=f"destination folder (default {DEFAULT_EXPORT_DIR}; to refresh the models shipped with "
                             "jrt-rnn, pass jrt_cli/assets/models of a checkout explicitly)")
    export.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the action; bad input gives a one-line error and exit code 1."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"synthetic {args.action}: error: {error}", file=sys.stderr)
        return 1


def _slice(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {value!r}") from None


def _evaluate(args: argparse.Namespace) -> int:
    from .report import extra_eval_table

    if not load_runs(args.out):
        raise FileNotFoundError(f"No */results.json under {args.out}: run an experiment first.")
    sys.stdout.write(extra_eval_table(evaluate_saved_models(args.out, args.slices, args.examples)))
    return 0


def _init_std(value: str) -> float | None:
    if value == "model":
        return None
    try:
        std = float(value)
    except ValueError:
        std = 0.0  # rejected below
    if std <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive float or 'model', got {value!r}")
    return std


def _run(args: argparse.Namespace) -> int:
    summary = run_experiment(args.experiment, args.seeds, args.out, steps=args.steps, jobs=args.jobs,
                             embedding_init_std=args.embedding_init_std)
    sys.stdout.write((args.out / "results.md").read_text())
    return 0 if summary["verdict"].get("reproduced") is not None else 1


def _report(args: argparse.Namespace) -> int:
    runs = load_runs(args.out)
    if not runs:
        raise FileNotFoundError(f"No */results.json under {args.out}: run the {args.experiment} experiment first.")
    previous = args.out / "summary.json"
    summary = summarize(args.experiment, runs)
    if previous.exists():  # keep the wall time and machine of the original run
        old = json.loads(previous.read_text())
        summary.update({k: old[k] for k in ("wall_seconds", "jobs", "machine") if k in old})
    write_summary(summary, args.out)
    sys.stdout.write((args.out / "results.md").read_text())
    return 0


def _export(args: argparse.Namespace) -> int:
    from jrt_cli.demo_models import DEMO_MODELS
    from jrt_cli.set_disjointness import sd_token_map, sd_tokenizer

    for arm, name in DEMO_MODELS.items():
        source = args.out / run_directory_name(arm, args.seed)
        if not (source / "model" / "config.json").exists():
            raise FileNotFoundError(f"No trained model in {source / 'model'}: run the e1 experiment first.")
        results = json.loads((source / "results.json").read_text())
        target = args.dest / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source / "model", target)
        token_map = sd_token_map(results["spec"]["task"]["vocab_size"])
        (target / "token_map.json").write_text(json.dumps(token_map, indent=2))
        sd_tokenizer(token_map).save_pretrained(target)
        (target / "training.json").write_text(json.dumps(
            {k: results[k] for k in ("name", "seed", "spec", "accuracy", "recurrent_state_floats",
                                     "num_parameters", "train_seconds")}, indent=2))
        print(f"{arm}: {source / 'model'} -> {target}")
    return 0
