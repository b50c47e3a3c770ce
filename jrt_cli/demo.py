"""`jrt demo`: the shipped tiny JRT-RNN and Based models answer set-disjointness questions (no network, seconds)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .choices import DEMO_SEED, MODELS_DIR, integer_type
from .main import UsageError, quiet_transformers

NUM_SHOWN = 4
NUM_SCORED = 200
MAX_SEED = 2**32 - 1  # numpy's seeds


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Run the shipped tiny JRT-RNN / Based models on fresh set-disjointness prompts (offline, seconds).",
        description="Set disjointness (JRT paper, Algorithm 1): the prompt lists two sets A | B that share exactly "
                    "one token; after '?' the model must name it. Compares JRT-RNN, causal Based and Based with "
                    "JRT-Prompt (the prompt given twice) at the same recurrent state size.",
    )
    parser.add_argument("--seed", type=integer_type(0, MAX_SEED, f"an integer from 0 to 2**32 - 1 ({MAX_SEED})"),
                        default=DEMO_SEED, help=f"seed of the fresh prompts, 0 to 2**32 - 1 (default {DEMO_SEED})")
    parser.add_argument("--examples", type=int, default=NUM_SCORED,
                        help=f"examples scored for the accuracy (default {NUM_SCORED})")
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR,
                        help="folder holding jrt-rnn-sd/ and based-sd/ (default: the models shipped with the package; "
                             "`python experiments/synthetic export` writes such a folder)")
    parser.add_argument("--export", type=Path, metavar="DIR",
                        help="write the demo models as Hub-ready folders under DIR (weights, config, tokenizer, a "
                             "model card and the model's code: a copy loads with trust_remote_code=True without "
                             "jrt-rnn) and exit")
    parser.set_defaults(func=run)


def _export(args: argparse.Namespace) -> int:
    from .demo_models import export_demo_models

    quiet_transformers()
    try:
        folders = export_demo_models(args.export, args.models_dir)
    except FileExistsError as error:
        raise UsageError(str(error)) from error
    for folder in folders:
        print(f"wrote {folder}")
    return 0


def _accuracy(answers, batch) -> float:
    return (answers == batch.labels[:, -1]).float().mean().item()


def run(args: argparse.Namespace) -> int:
    if args.export is not None:
        return _export(args)
    if args.examples < NUM_SHOWN:
        raise UsageError(f"`--examples` must be >= {NUM_SHOWN}, got {args.examples}.")
    from .demo_models import (
        DEMO_ARMS, DEMO_SLICES, LONGER_SLICES, demo_batch, generate_answers, load_demo_model, recurrent_state_size,
    )
    from .set_disjointness import render_tokens

    start = time.perf_counter()
    quiet_transformers()  # no "Loading weights" bars in the output
    names = dict.fromkeys(arm.model_dir for arm in DEMO_ARMS)
    models = {name: load_demo_model(name, args.models_dir) for name in names}
    token_map = next(iter(models.values()))[1]
    training = json.loads((args.models_dir / DEMO_ARMS[0].model_dir / "training.json").read_text())

    print("jrt demo: set disjointness (JRT paper, Algorithm 1) with tiny models trained on CPU "
          "(synthetic experiment E1)")
    print(f"  ({training['spec']['steps']} steps, seed {training['seed']}; vocabulary {token_map['vocab_size']} ids, "
          f"sets of sizes {' and '.join(str(s).replace(' ', '') for s in DEMO_SLICES)}).")
    print("  Prompt: <bos> A | B ?   A and B share exactly one token; after '?' the model names it.")
    print("  JRT-Prompt gives the causal model the context twice: <bos> A | B <bos> A | B ?\n")

    scored, shown = {}, {}
    for arm in DEMO_ARMS:
        model = models[arm.model_dir][0]
        batch = demo_batch(args.examples, repeat=arm.repeat, seed=args.seed)
        answers = generate_answers(model, batch)
        longer_batch = demo_batch(args.examples, arm.repeat, args.seed, slices=LONGER_SLICES)
        scored[arm.label] = {
            "accuracy": _accuracy(answers, batch),
            "longer": _accuracy(generate_answers(model, longer_batch), longer_batch),
            "state": recurrent_state_size(model, batch),
            "prompt_tokens": batch.input_ids.shape[1],
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        shown[arm.label] = (batch, answers)

    # A few prompts, two from each slice.
    first_batch = shown[DEMO_ARMS[0].label][0]
    half = args.examples // len(DEMO_SLICES) + (args.examples % len(DEMO_SLICES) > 0)
    rows = [0, 1, half, half + 1]
    width = max(len(arm.label) for arm in DEMO_ARMS)
    for number, row in enumerate(rows, 1):
        target = int(first_batch.labels[row, -1])
        print(f"Example {number}: {render_tokens(first_batch.input_ids[row], token_map)}")
        print(f"  expected: {render_tokens([target], token_map)}")
        for arm in DEMO_ARMS:
            answer = int(shown[arm.label][1][row])
            verdict = "correct" if answer == target else "wrong"
            print(f"  {arm.label:<{width}}  -> {render_tokens([answer], token_map):<4} {verdict}")
        print()

    longer = " and ".join(str(s).replace(" ", "") for s in LONGER_SLICES)
    print(f"Accuracy on {args.examples} fresh examples (seed {args.seed}) of the trained set sizes, and recurrent "
          "state per sequence after the prefill, read from the cache:")
    for arm in DEMO_ARMS:
        info = scored[arm.label]
        state = info["state"]
        print(f"  {arm.label:<{width}}  accuracy {info['accuracy']:.3f}   state {state['total']} floats "
              f"(linear attention {state['linear_attention']} + conv {state['conv']})   "
              f"prompt {info['prompt_tokens']} tokens   {info['parameters']} parameters")
    print(f"\nAccuracy on {args.examples} fresh examples with longer sets than in training, {longer}:")
    for arm in DEMO_ARMS:
        print(f"  {arm.label:<{width}}  longer-set accuracy {scored[arm.label]['longer']:.3f}")
    print(f"\n({time.perf_counter() - start:.1f} s. Train them yourself: `python experiments/synthetic e1`; "
          "see experiments/synthetic/README.md.)")
    return 0
