"""Whole-model prefill: JRT-RNN against a Llama of the same width and depth, N = 2k ... 64k tokens.

Both models have random weights (`_common.model_configs`); one prefill is one forward with a fresh cache and
`logits_to_keep=1`, as `generate()` does it. Per N: time, peak memory the prefill adds to the loaded model, the
Llama / JRT ratio and the growth per doubling of N; on CPU each (model, N) point runs in a fresh process. What each
column measures: docs/performance.md, "Whole-model prefill against Llama".

    OMP_NUM_THREADS=1 python benchmarks/model_prefill.py                        # N = 2k .. 64k (long: tens of minutes)
    OMP_NUM_THREADS=1 python benchmarks/model_prefill.py --lengths 2048 4096    # a few points
    python benchmarks/model_prefill.py --compile 8192 --json out.json           # compiled column at 8k, save JSON
    OMP_NUM_THREADS=1 python benchmarks/model_prefill.py --profile 16384        # where JRT-RNN's time goes at 16k
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_arguments, model_configs, peak_rss, synchronize, timed  # noqa: E402

from modeling_jrt import JRTRNNForCausalLM  # noqa: E402

WARMUP_LENGTH = 256


def build_model(name: str, args: argparse.Namespace) -> torch.nn.Module:
    """`"jrt"` or `"llama"`, random weights (seed 0), eval mode, on `args.device`."""
    if name not in ("jrt", "llama"):
        raise ValueError(f"unknown model {name!r}; expected 'jrt' or 'llama'")
    jrt, llama = model_configs(args, jrt=dict(prefix_length=args.prefix_length, prefix_pad_token_id=0),
                               llama=dict(max_position_embeddings=1 << 17))
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(jrt) if name == "jrt" else LlamaForCausalLM(llama)
    return model.to(args.device, getattr(torch, args.dtype)).eval()


@torch.no_grad()
def prefill(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    model(input_ids, use_cache=True, logits_to_keep=1)  # a fresh cache of the model's own kind


@torch.no_grad()
def measure_point(name: str, length: int, args: argparse.Namespace, *, compiled: bool) -> dict:
    """Time and peak memory of one prefill of `length` tokens, in this process."""
    device = torch.device(args.device)
    model = build_model(name, args)
    if compiled:
        model = torch.compile(model)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab_size, (args.batch, length), generator=generator).to(device)
    # Warm-up: a short prompt (kernel selection, allocator) on the CPU; the same length under torch.compile (one
    # graph) and on CUDA, where the Triton prefill autotunes (and compiles) per power-of-two bucket of the length.
    prefill(model, input_ids if compiled or device.type == "cuda" else input_ids[:, :WARMUP_LENGTH])
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets this process's peak RSS (VmHWM), where Linux allows it
        with open("/proc/self/statm") as statm:  # the resident set size now
            baseline = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    repeats = args.repeats if length <= 8192 else 1
    timings = [timed(lambda: prefill(model, input_ids), device, clock) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss()
    return {"ms": min(timings) * 1e3, "peak_mib": max(peak - baseline, 0) / 2**20}


PROFILED = {  # module type -> profile row
    "JRTRNNLinearAttention": "linear attention", "JRTRNNSlidingWindowAttention": "sliding window", "JRTRNNMLP": "MLP",
    "JRTRNNShortConv": "short conv", "JRTRNNRMSNorm": "RMSNorm",
}


@torch.no_grad()
def profile_point(length: int, args: argparse.Namespace) -> dict:
    """Time (ms) per module type of one JRT-RNN prefill of `length` tokens, in this process: forward hooks read a
    clock around every call of the `PROFILED` modules; "other" is the rest of the forward. On CPU the clock is the
    process CPU time; on CUDA the wall time, with the device synchronised in every hook (each module's kernels
    finish inside its own row; the syncs add a little to the total). Times are exclusive: a profiled call made
    inside another (the norm that a linear-attention layer applies chunk by chunk on the way into its projections)
    counts for its own row only. Also the forward's user and system time and minor page faults from `getrusage`."""
    device = torch.device(args.device)
    model = build_model("jrt", args)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab_size, (1, length), generator=generator).to(device)
    prefill(model, input_ids)  # warm-up at the same length (allocator, kernel selection, autotuning)
    synchronize(device)
    totals = dict.fromkeys(PROFILED.values(), 0.0)
    started: list[list[float]] = []  # [start, time of the profiled calls inside] per open call

    def clock() -> float:
        synchronize(device)
        return time.process_time() if device.type == "cpu" else time.perf_counter()

    def before(module, inputs):
        started.append([clock(), 0.0])

    def after(module, inputs, output):
        start, inner = started.pop()
        elapsed = clock() - start
        totals[PROFILED[type(module).__name__]] += elapsed - inner
        if started:
            started[-1][1] += elapsed

    handles = [handle for module in model.modules() if type(module).__name__ in PROFILED
               for handle in (module.register_forward_pre_hook(before), module.register_forward_hook(after))]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = clock()  # (synchronised)
    prefill(model, input_ids)
    total = clock() - start
    end_usage = resource.getrusage(resource.RUSAGE_SELF)
    for handle in handles:
        handle.remove()
    shares = {name: seconds * 1e3 for name, seconds in totals.items()}
    shares["other"] = max(total * 1e3 - sum(shares.values()), 0.0)
    return {"length": length, "device": device.type, "total_ms": total * 1e3, "ms": shares,
            "user_ms": (end_usage.ru_utime - usage.ru_utime) * 1e3,
            "system_ms": (end_usage.ru_stime - usage.ru_stime) * 1e3,
            "minor_faults": end_usage.ru_minflt - usage.ru_minflt}


def print_profile(result: dict) -> None:
    total = result["total_ms"]
    clock = "process CPU time" if result.get("device", "cpu") == "cpu" else "wall time, synchronised per module"
    print(f"JRT-RNN prefill of {result['length']} tokens: {total:.0f} ms {clock} "
          f"(user {result['user_ms']:.0f}, system {result['system_ms']:.0f}, minor faults {result['minor_faults']})")
    print("| module type | ms | share |")
    print("|---|---|---|")
    for name, ms in sorted(result["ms"].items(), key=lambda item: -item[1]):
        print(f"| {name} | {ms:.0f} | {100 * ms / total:.1f}% |")


FORWARDED = ("hidden_size", "layers", "heads", "vocab_size", "sliding_window", "prefix_length", "repeats", "device",
             "dtype", "batch")


def run_point(name: str, length: int, args: argparse.Namespace, *, compiled: bool = False, profile: bool = False
              ) -> dict | str:
    """One measurement (or `profile_point` with `profile`); on CPU in a fresh worker process. Returns the
    measurement or a short failure reason."""
    if args.device != "cpu":
        return profile_point(length, args) if profile else measure_point(name, length, args, compiled=compiled)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--lengths", str(length)]
    command += [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items() if key in FORWARDED]
    command += ["--worker-compiled"] if compiled else []
    command += ["--worker-profile"] if profile else []
    environment = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    if result.returncode != 0:
        return "OOM" if result.returncode in (-9, 137) else f"failed ({result.stderr.strip().splitlines()[-1:]})"
    return json.loads(result.stdout.strip().splitlines()[-1])


def ratio(numerator: dict | str | None, denominator: dict | str | None, key: str, suffix: str = "") -> str:
    """numerator[key] / denominator[key] of two measurements, or "-" (a failed or skipped point, or a 0 below)."""
    both = isinstance(numerator, dict) and isinstance(denominator, dict)
    return f"{numerator[key] / denominator[key]:.2f}{suffix}" if both and denominator[key] else "-"


def growth(values: list, index: int, key: str) -> str:
    """`x per 2N` cell: the ratio to the previous length ("-" when that one is 0, e.g. a peak memory too small to move
    the RSS)."""
    return ratio(values[index], values[index - 1], key) if index else "-"


def cell(value: dict | str | None, key: str, fmt: str = ".0f") -> str:
    if value is None:
        return "-"
    return format(value[key], fmt) if isinstance(value, dict) else value


def print_table(lengths: list[int], results: dict[str, list], compiled: bool) -> None:
    jrt, llama = results["jrt"], results["llama"]
    header = ("| N | JRT ms | Llama ms | Llama/JRT | JRT x per 2N | Llama x per 2N "
              "| JRT peak MiB | Llama peak MiB | JRT mem x per 2N | Llama mem x per 2N |")
    if compiled:
        header += " JRT compiled ms | eager/compiled |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for i, length in enumerate(lengths):
        row = (f"| {length} | {cell(jrt[i], 'ms')} | {cell(llama[i], 'ms')} | {ratio(llama[i], jrt[i], 'ms', 'x')} "
               f"| {growth(jrt, i, 'ms')} | {growth(llama, i, 'ms')} | {cell(jrt[i], 'peak_mib')} "
               f"| {cell(llama[i], 'peak_mib')} | {growth(jrt, i, 'peak_mib')} | {growth(llama, i, 'peak_mib')} |")
        if compiled:
            fast = results["jrt_compiled"][i]
            row += f" {cell(fast, 'ms')} | {ratio(jrt[i], fast, 'ms', 'x')} |"
        print(row, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--llama-max-length", type=int, default=32768, help="longest N Llama runs at")
    parser.add_argument("--compile", type=int, nargs="*", metavar="N", help="add a torch.compile column for JRT-RNN "
                        "at these lengths (all of --lengths when none are given)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each CPU worker")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per point up to 8k (1 beyond)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per CPU point")
    parser.add_argument("--batch", type=int, default=1, help="prompts prefilled together")
    add_model_arguments(parser, device="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefix-length", type=int, default=1024)
    parser.add_argument("--profile", type=int, metavar="N", help="instead of the table: the share of JRT-RNN's "
                        "process CPU time per module type in a prefill of N tokens")
    parser.add_argument("--json", type=Path, help="also write every measurement to this file")
    parser.add_argument("--worker", choices=("jrt", "llama"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-profile", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:  # one point, in this (fresh) process: print its JSON line
        torch.set_num_threads(args.threads)
        point = (profile_point(args.lengths[0], args) if args.worker_profile
                 else measure_point(args.worker, args.lengths[0], args, compiled=args.worker_compiled))
        print(json.dumps(point))
        return
    environment = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "threads": args.threads if args.device == "cpu" else None, "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": f"hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads, window {args.sliding_window}, "
        f"prefix {args.prefix_length}, {args.dtype}, batch {args.batch}, logits_to_keep=1",
    }
    print(", ".join(f"{key} {value}" for key, value in environment.items() if value is not None))
    if args.profile:
        result = run_point("jrt", args.profile, args, profile=True)
        if not isinstance(result, dict):
            raise SystemExit(f"profile at N={args.profile}: {result}")
        print_profile(result)
        if args.json:
            args.json.write_text(json.dumps({"environment": environment, "profile": result}, indent=1))
        return
    results: dict[str, list] = {"jrt": [], "llama": [], "jrt_compiled": []}
    for length in args.lengths:
        results["jrt"].append(run_point("jrt", length, args))
        results["llama"].append(run_point("llama", length, args) if length <= args.llama_max_length else None)
        if args.compile is not None:
            compiled = not args.compile or length in args.compile
            results["jrt_compiled"].append(run_point("jrt", length, args, compiled=True) if compiled else None)
        print(f"N={length}: " + ", ".join(f"{k} {v[-1]}" for k, v in results.items() if v), file=sys.stderr, flush=True)
    print_table(args.lengths, results, args.compile is not None)
    if args.json:
        args.json.write_text(json.dumps({"environment": environment, "lengths": args.lengths, **results}, indent=1))


if __name__ == "__main__":
    main()
