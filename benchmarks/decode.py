"""Decode cost vs sequence length: JRT-RNN's recurrent cache against a same-size Llama with its KV cache.

For each total length N (prompt + generated), both models (random weights, built from configs) prefill N - steps
tokens, then decode `steps` tokens one at a time from the cache. Reported per length: the median wall time of one
single-token forward with the cache (ms/token; on CUDA each step synchronised, the first steps warm-up), the bytes the
cache holds after the last step (cache MiB), and the Llama / JRT ratios. JRT-RNN's columns stay flat in N, Llama's
grow linearly. `--generate` times `generate()` instead, each model's default (eager) call and its compiled path
(`generate_seconds_per_token`; docs/performance.md, "Decoding through `generate()`").

    OMP_NUM_THREADS=1 python benchmarks/decode.py            # N = 512 .. 8192, hidden 256, 8 layers
    OMP_NUM_THREADS=1 python benchmarks/decode.py --quick    # a few seconds
    python benchmarks/decode.py --device cuda --dtype bfloat16 --batch 16 --lengths 2048 8192 32768
    python benchmarks/decode.py --device cuda --dtype bfloat16 --batch 16 --lengths 2048 8192 32768 --generate
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_arguments, build_models, synchronize, timed  # noqa: E402

from modeling_jrt.compat import output_cache  # noqa: E402


def cache_bytes(cache) -> int:
    """Bytes of every tensor the cache holds: a `JRTRNNCache`'s states (conv inputs, window keys/values/flags,
    linear-attention states) or a Llama cache's keys and values."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "tensors"):  # JRTRNNCache layer states
            tensors = layer.tensors()
        else:
            tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


WARMUP_STEPS = 3


@torch.no_grad()
def measure(model: torch.nn.Module, length: int, steps: int, vocab_size: int, batch: int = 1, step_forward=None
            ) -> tuple[float, int]:
    """(median seconds per decode step of `batch` rows, cache bytes) after prefilling `length - steps` tokens.
    `step_forward`: what runs each decode step (e.g. a compiled `model.forward`; the prefill stays eager)."""
    step_forward = step_forward or model
    device = model.device
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (batch, length - steps), generator=generator).to(device)
    output = model(prompt, use_cache=True, logits_to_keep=1)  # a fresh cache of the model's own kind
    cache, logits = output_cache(output), output.logits
    timings = []
    warmup = WARMUP_STEPS if device.type == "cuda" or step_forward is not model else 0
    for step in range(steps + warmup):
        token = logits[:, -1:].argmax(-1)
        synchronize(device)
        start = time.perf_counter()
        logits = step_forward(token, cache=cache).logits
        synchronize(device)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings[-steps:]), cache_bytes(cache)


@torch.no_grad()
def generate_seconds_per_token(model: torch.nn.Module, length: int, steps: int, vocab_size: int, batch: int,
                               static: bool) -> float:
    """Seconds per decoded token of `model.generate()` (greedy) from a `length - 2 * steps`-token prompt: the time of
    `2 * steps` new tokens less that of `steps` (the prefill and the first compile cancel out; the fastest of 3 runs
    of each). Where noise swamps the difference (a few steps on a loaded machine: not positive), the long call's
    time per new token, prefill included (an upper bound).
    `static`: transformers' compiled path (`cache_implementation="static"`), else its default eager call."""
    from transformers.generation import CompileConfig

    device = model.device
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (batch, length - 2 * steps), generator=generator).to(device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    if static:
        kwargs["cache_implementation"] = "static"
        if device.type != "cuda":
            compile_config = CompileConfig(fullgraph=False)
            compile_config._compile_all_devices = True  # transformers compiles on accelerators only by default
            kwargs["compile_config"] = compile_config

    def run(new_tokens: int) -> float:
        return timed(lambda: model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs),
                     device)

    run(steps)  # warm-up (and the compile of the static path)
    short, long = [], []
    for _ in range(3):  # alternating, the fastest of each: a shared machine's slow moments fall out
        short.append(run(steps))
        long.append(run(2 * steps))
    difference = (min(long) - min(short)) / steps
    return difference if difference > 0 else min(long) / (2 * steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per length")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--compile", action="store_true",
                        help="add a column: JRT-RNN's decode step under torch.compile(model.forward, fullgraph=True)")
    parser.add_argument("--generate", action="store_true", help="time generate() instead: each model's default "
                        "(eager) call and its compiled path (cache_implementation='static')")
    parser.add_argument("--quick", action="store_true", help="small model, N = 512 and 1024, 4 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.hidden_size, args.layers, args.heads, args.steps = [512, 1024], 128, 4, 4, 4

    jrt, llama = build_models(args)
    print(f"hidden {args.hidden_size}, {args.layers} layers ({', '.join(jrt.config.mixer_types)}), {args.heads} heads, "
          f"{args.dtype} on {args.device}, batch {args.batch}, torch threads {torch.get_num_threads()}, "
          f"{args.steps} decode steps per length")
    if args.generate:
        header = (f"{'N':>6} | {'JRT eager':>9} {'Llama eager':>11} {'JRT static':>10} {'Llama static':>12} "
                  f"(ms/token) | {'JRT eager / Llama eager':>23} {'JRT static / Llama eager':>24} "
                  f"{'JRT static / Llama static':>25} (speed ratios)")
        print(header)
        print("-" * len(header))
        for length in args.lengths:
            jrt_eager, llama_eager, jrt_static, llama_static = (
                generate_seconds_per_token(model, length, args.steps, args.vocab_size, args.batch, static)
                for static in (False, True) for model in (jrt, llama))
            print(f"{length:>6} | {jrt_eager * 1e3:>9.2f} {llama_eager * 1e3:>11.2f} {jrt_static * 1e3:>10.2f} "
                  f"{llama_static * 1e3:>12.2f}             | {llama_eager / jrt_eager:>23.2f} "
                  f"{llama_eager / jrt_static:>24.2f} {llama_static / jrt_static:>25.2f}", flush=True)
        return
    compiled = torch.compile(jrt.forward, fullgraph=True) if args.compile else None
    header = (f"{'N':>6} | {'JRT ms/tok':>10} {'Llama ms/tok':>12} {'Llama/JRT':>9} | "
              f"{'JRT cache MiB':>13} {'Llama cache MiB':>15} {'Llama/JRT':>9}"
              + (f" | {'JRT compiled ms/tok':>19} {'Llama/compiled':>14}" if compiled else ""))
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        jrt_time, jrt_bytes = measure(jrt, length, args.steps, args.vocab_size, args.batch)
        llama_time, llama_bytes = measure(llama, length, args.steps, args.vocab_size, args.batch)
        line = (f"{length:>6} | {jrt_time * 1e3:>10.2f} {llama_time * 1e3:>12.2f} {llama_time / jrt_time:>9.2f} | "
                f"{jrt_bytes / 2**20:>13.2f} {llama_bytes / 2**20:>15.2f} {llama_bytes / jrt_bytes:>9.2f}")
        if compiled:
            compiled_time, _ = measure(jrt, length, args.steps, args.vocab_size, args.batch, step_forward=compiled)
            line += f" | {compiled_time * 1e3:>19.2f} {llama_time / compiled_time:>14.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
