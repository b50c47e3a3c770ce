"""Training throughput, JRT-RNN against a same-size Llama: tokens per second of a full training step.

A step (`_common.training_step`) runs on `batch` rows of `length` tokens; JRT-RNN reads the first half of each row as
its prefix (the paper's M = N / 2; the loss scores the second half), Llama scores every token. Both models come from
`_common.build_models`; each model's figure is its fastest of `repeats` steps after `warmup` ones.

    OMP_NUM_THREADS=1 python benchmarks/train_step.py --quick                  # seconds, on CPU
    python benchmarks/train_step.py --device cuda --dtype bfloat16 --lengths 2048 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_arguments, build_models, timed, training_step  # noqa: E402


def step_seconds(model: torch.nn.Module, batch: int, length: int, vocab: int, warmup: int, repeats: int) -> float:
    """The fastest of `repeats` training steps (forward with labels, backward, AdamW, zero_grad) after `warmup`."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (batch, length), generator=generator).to(device)
    model.train()
    jrt = {"prefix_length": length // 2} if hasattr(model.config, "prefix_length") else {}
    step = training_step(model, input_ids, **jrt)
    times = [timed(step, device) for _ in range(warmup + repeats)]
    return min(times[warmup:])


def main(argv: list[str] | None = None) -> dict[int, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=4)
    add_model_arguments(parser)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="hidden 64, 2 layers, N = 128, batch 2, 1 + 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.batch, args.hidden_size, args.layers, args.heads = [128], 2, 64, 2, 4
        args.sliding_window, args.warmup, args.repeats = 17, 1, 2
    jrt, llama = build_models(args)
    print(f"training step (forward with labels, backward, AdamW): hidden {args.hidden_size}, {args.layers} layers, "
          f"{args.dtype} on {args.device}, batch {args.batch}, best of {args.repeats} after {args.warmup}")
    print(f"{'N':>6} | {'JRT-RNN tok/s':>13} {'Llama tok/s':>12} {'JRT / Llama':>12}")
    results = {}
    for length in args.lengths:
        tokens = args.batch * length
        jrt_time = step_seconds(jrt, args.batch, length, args.vocab_size, args.warmup, args.repeats)
        llama_time = step_seconds(llama, args.batch, length, args.vocab_size, args.warmup, args.repeats)
        results[length] = (tokens / jrt_time, tokens / llama_time)
        print(f"{length:>6} | {tokens / jrt_time:>13.0f} {tokens / llama_time:>12.0f} {llama_time / jrt_time:>12.2f}",
              flush=True)
    return results


if __name__ == "__main__":
    main()
