"""Prefill latency of prefix linear attention (JRT-RNN) side by side with causal softmax attention.

Times "ours" (the fused Triton kernel on CUDA, the chunked PyTorch path on CPU), the chunked path (on CUDA), the
O(N^2) reference while it fits in memory, causal SDPA (flash backend on CUDA) with the same B, H, N and head dim, and
fla's Based kernels when `fla` imports, with the ratios to SDPA, TFLOP/s and the fraction of the roofline floor
(`pla_flops` / `sdpa_flops`, `pla_bytes`). `--backward` (the CUDA default), `--train-step` and `--compile-lengths`
add columns and tables: docs/performance.md, "Prefill benchmark".

    python benchmarks/prefill.py                       # CPU: N = 1k..8k, B = 1, fp32, one thread
    python benchmarks/prefill.py --quick               # a few small shapes
    python benchmarks/prefill.py --json results.json   # also write every measurement as JSON
    python benchmarks/prefill.py --batch-sweep         # CUDA default: also B = 2..64 at N = 16k
    python benchmarks/prefill.py --compile-lengths 2048 8192 65536   # compile time of the chunked path

Defaults follow the paper's Table 5 harness: H = 16, feature dim 16, value/head dim 64, M = N / 2, bf16 on CUDA
(B = 16, N = 1k..32k). Methods are timed in interleaved rounds after warm-up (`time_methods`); allocating the inputs
is excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import pla_bytes, pla_flops, timed, training_step, triton_version  # noqa: E402

from modeling_jrt.linear_attention import (  # noqa: E402
    prefix_linear_attention_chunked, prefix_linear_attention_quadratic)

# Dense bf16 tensor-core peak and HBM bandwidth (datasheet) by device-name substring: the roofline floor.
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12), "L40S": (362e12, 0.864e12)}


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_flops(T: int, D: int) -> float:
    """Causal softmax attention FLOPs per (batch, head): QK^T and PV on half the (T, T) square."""
    return 4 * T * T * D / 2


def time_methods(methods: dict[str, Callable[[], object]], device: torch.device, args: argparse.Namespace
                 ) -> dict[str, float | str]:
    """Time each method in ms: `warmup` untimed calls each, then `repeats` rounds calling every method once (the
    rounds interleave the methods so that a change of machine load hits them alike). On CUDA each call is synchronised
    and timed on the wall clock; on a CPU with one thread the clock is the process CPU time, which excludes the time a
    shared machine makes it wait for a core. A method that fails gets its error message."""
    clock = time.process_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in methods}
    results: dict[str, float | str] = {}
    for round_index in range(-args.warmup, args.repeats):
        for name, fn in methods.items():
            if name in results:  # failed earlier
                continue
            try:
                grad = torch.enable_grad() if name.endswith("_fb") else torch.no_grad()
                with grad, sdpa_context(device) if name.startswith("sdpa") else contextlib.nullcontext():
                    elapsed = timed(fn, device, clock) * 1e3
            except Exception as error:  # noqa: BLE001 - report the failure of one method, keep measuring the rest
                results[name] = f"{type(error).__name__}: {error}"[:200]
                continue
            if round_index >= 0:
                samples[name].append(elapsed)
    for name, values in samples.items():
        if name not in results and values:
            results[name] = min(values) if args.stat == "min" else statistics.median(values)
    return results


PROGRESS_COLUMNS = ("ours", "chunked", "sdpa", "fla_chunk", "fla_parallel", "ours_fb", "sdpa_fb", "fla_chunk_fb")


def load_fla() -> dict[str, Callable]:
    """flash-linear-attention's Based kernels, if that optional package imports (any failure: not measured)."""
    try:
        from fla.ops.based import fused_chunk_based, parallel_based
    except Exception as error:  # noqa: BLE001 - an optional third-party baseline: any import failure skips it
        print(f"# fla not available ({type(error).__name__}: {error}); its columns are skipped", file=sys.stderr)
        return {}
    return {"fla_chunk": fused_chunk_based, "fla_parallel": parallel_based}


def load_kernel() -> Callable | None:
    try:
        from jrt_kernels import prefix_linear_attention_triton
    except ImportError as error:
        print(f"# jrt_kernels not available ({error})", file=sys.stderr)
        return None
    return prefix_linear_attention_triton


def sdpa_context(device: torch.device):
    """Force the flash backend on CUDA (the FlashAttention-2 proxy); the default elsewhere."""
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


def measure_shape(args, device, dtype, B: int, T: int, kernel, fla) -> dict:
    H, K, V = args.heads, args.feature_dim, args.head_dim
    M = T // 2 if args.prefix == "half" else min(int(args.prefix), T)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    # docs/prefill.md §5: the paper's inputs (q, k ~ randn / K^(1/2) keeps s small; the cost does not depend on it).
    q, k, v = randn(B, T, H, K, scale=K**-0.5), randn(B, T, H, K, scale=K**-0.5), randn(B, T, H, V)
    k_enc, v_enc = randn(B, M, H, K, scale=K**-0.5), randn(B, M, H, V)
    pla_inputs = (q, k, v, k_enc, v_enc)
    ours = kernel if args.impl == "triton" else prefix_linear_attention_chunked  # None: the kernel does not import
    row: dict = {"B": B, "T": T, "M": M, "H": H, "K": K, "V": V}
    chunked = prefix_linear_attention_chunked if args.impl == "triton" and args.chunked else None
    pla = {name: fn for name, fn in (("ours", ours), ("chunked", chunked)) if fn is not None}
    methods: dict[str, Callable] = {name: lambda fn=fn: fn(*pla_inputs) for name, fn in pla.items()}
    if args.quadratic and B * H * T * T * 4 * 3 <= args.quadratic_max_gib * 2**30:  # ~3 (B, H, N, N) fp32
        methods["quadratic"] = lambda: prefix_linear_attention_quadratic(*pla_inputs)
    sdpa_inputs = tuple(randn(B, H, T, V) for _ in range(3))  # SDPA at head dim V (64), as in the paper
    methods["sdpa"] = lambda: causal_sdpa(*sdpa_inputs)
    for name, fn in fla.items():
        methods[name] = lambda fn=fn: fn(q, k, v)
    if args.backward:  # `*_fb`: forward + backward of ours (the fused backward on CUDA), chunked, SDPA (flash), fla
        for name, fn in pla.items():
            methods[f"{name}_fb"] = _forward_backward(fn, pla_inputs)
        if ours is not None:
            row["ours_fb_saved_mib"] = saved_for_backward_mib(ours, pla_inputs)
        with sdpa_context(device):
            methods["sdpa_fb"] = _forward_backward(causal_sdpa, sdpa_inputs)
            row["sdpa_fb_saved_mib"] = saved_for_backward_mib(causal_sdpa, sdpa_inputs)
        for name, fn in fla.items():
            try:
                methods[f"{name}_fb"] = _forward_backward(fn, pla_inputs[:3])
            except Exception as error:  # noqa: BLE001 - an optional baseline without a backward is skipped
                print(f"# {name} forward+backward unavailable ({type(error).__name__})", file=sys.stderr)

    for name, result in time_methods(methods, device, args).items():
        if isinstance(result, str):
            row[name], row[f"{name}_error"] = None, result
            print(f"# {name} failed at B={B} T={T}: {result}", file=sys.stderr)
        else:
            row[name] = result
    if device.type == "cuda":
        torch.cuda.empty_cache()

    row["ours_impl"] = args.impl if "ours" in methods else None
    element_size = torch.finfo(dtype).bits // 8
    flops = B * H * pla_flops(T, M, K, V)
    traffic = B * H * pla_bytes(T, M, K, V, element_size)
    row.update(pla_gflop=flops / 1e9, pla_gbyte=traffic / 1e9)
    if row.get("ours"):
        row["ours_tflops"] = flops / (row["ours"] * 1e-3) / 1e12
        if args.peak_tflops and args.peak_gbps:
            floor_ms = max(flops / (args.peak_tflops * 1e12), traffic / (args.peak_gbps * 1e9)) * 1e3
            row["floor_ms"] = floor_ms
            row["ours_pct_floor"] = 100 * floor_ms / row["ours"]
    if row.get("sdpa"):
        row["sdpa_tflops"] = B * H * sdpa_flops(T, V) / (row["sdpa"] * 1e-3) / 1e12
        for name in ("ours", "chunked", "quadratic", "fla_chunk", "fla_parallel"):
            if row.get(name):
                row[f"sdpa_over_{name}"] = row["sdpa"] / row[name]
    if row.get("sdpa_fb") and row.get("ours_fb"):
        row["sdpa_fb_over_ours_fb"] = row["sdpa_fb"] / row["ours_fb"]
    return row


def _forward_backward(fn: Callable, inputs: tuple) -> Callable[[], None]:
    """A method that runs `fn` on leaf copies of `inputs` and back-propagates a fixed output gradient."""
    leaves = tuple(None if t is None else t.detach().clone().requires_grad_() for t in inputs)
    first = fn(*leaves)
    output = first[0] if isinstance(first, tuple) else first
    grad = torch.randn_like(output)

    def run() -> None:
        result = fn(*leaves)
        (result[0] if isinstance(result, tuple) else result).backward(grad)
        for leaf in leaves:
            if leaf is not None:
                leaf.grad = None

    return run


def saved_for_backward_mib(fn: Callable, inputs: tuple) -> float:
    """MiB that autograd keeps from a forward of `fn` until its backward, beyond the inputs themselves: the distinct
    storages of every tensor saved for backward (`torch.autograd.graph.saved_tensors_hooks`), leaves excluded."""
    leaves = tuple(None if t is None else t.detach().clone().requires_grad_() for t in inputs)
    leaf_storages = {t.untyped_storage().data_ptr() for t in leaves if t is not None}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in leaf_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*leaves)  # the result is freed at once: only what autograd saved was counted
    return sum(storages.values()) / 2**20


def train_step_benchmark(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Tokens per second of a training step (forward, backward, AdamW) of a small JRT-RNN, per implementation."""
    import modeling_jrt

    implementations = ["chunked", "triton"] if device.type == "cuda" else ["chunked"]
    rows = []
    for implementation in implementations:
        torch.manual_seed(0)
        shape = dict(
            vocab_size=50304, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16,
            mixer_types=["conv", "linear_attention", "sliding_attention", "linear_attention"], feature_dim=16,
            prefix_length=args.train_length // 2, sliding_window=64,
        ) if args.train_length > 64 else dict(  # a tiny model for smoke tests
            vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            mixer_types=["linear_attention", "conv"], feature_dim=4, prefix_length=8, sliding_window=5, bos_token_id=1,
            eos_token_id=2, prefix_pad_token_id=3,
        )
        config = modeling_jrt.JRTRNNConfig(**shape, linear_attention_implementation=implementation)
        model = modeling_jrt.JRTRNNForCausalLM(config).to(device=device, dtype=dtype).train()
        length = args.train_length
        input_ids = torch.randint(4, config.vocab_size, (args.train_batch, length), device=device)
        step = training_step(model, input_ids)
        result = time_methods({f"train_{implementation}_fb": step}, device, args)[f"train_{implementation}_fb"]
        row = {"implementation": implementation, "B": args.train_batch, "T": length}
        if isinstance(result, str):
            row["error"] = result
        else:
            row["ms"] = result
            row["tokens_per_s"] = args.train_batch * length / (result * 1e-3)
        rows.append(row)
        print(f"# train step {implementation}: {row}", flush=True)
    return rows


def compile_point(args: argparse.Namespace, T: int) -> dict:
    """In this (fresh) process: compile the chunked path with dynamic shapes and call it at T, then at T / 2.
    compile_s is the first call's wall time minus a compiled call's (tracing, inductor, C++ compilation),
    compile_cpu_s the same in CPU time (worker processes included); recompiled: whether the call at T / 2 traced a
    second graph (it must not with dynamic=True)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True  # a cold compile, whatever an earlier run left on disk
    torch._dynamo.reset()
    torch.set_num_threads(args.threads)
    compiled = torch.compile(prefix_linear_attention_chunked, dynamic=True)
    generator = torch.Generator().manual_seed(0)
    H, K, V = args.heads, args.feature_dim, args.head_dim

    def inputs(length: int) -> tuple:
        M = length // 2
        shapes = [(1, length, H, K), (1, length, H, K), (1, length, H, V), (1, M, H, K), (1, M, H, V)]
        return tuple(torch.randn(*shape, generator=generator) for shape in shapes)

    def cpu_seconds() -> float:  # this process's and its finished children's (inductor compiles C++ in workers)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def seconds(fn: Callable[[], object]) -> tuple[float, float]:
        """Wall and CPU seconds of `fn()`."""
        start_wall, start_cpu = time.perf_counter(), cpu_seconds()
        fn()
        return time.perf_counter() - start_wall, cpu_seconds() - start_cpu

    row: dict = {"T": T}
    with torch.no_grad():
        tensors = inputs(T)
        first_wall, first_cpu = seconds(lambda: compiled(*tensors))
        wall, cpu = seconds(lambda: compiled(*tensors))
        row["compiled_ms"] = wall * 1e3
        row["compile_s"] = first_wall - wall
        row["compile_cpu_s"] = first_cpu - cpu
        row["eager_ms"] = seconds(lambda: prefix_linear_attention_chunked(*tensors))[0] * 1e3
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled(*inputs(max(T // 2, 1)))
        row["recompiled"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs
    return row


def compile_table(args: argparse.Namespace) -> list[dict]:
    """One fresh process per length (`compile_point`); prints the compile-time table."""
    rows = []
    for T in args.compile_lengths:
        command = [sys.executable, str(os.path.abspath(__file__)), "--compile-worker", str(T),
                   "--heads", str(args.heads), "--feature-dim", str(args.feature_dim), "--head-dim",
                   str(args.head_dim), "--threads", str(args.threads)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.compile_timeout,
                                env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if result.returncode != 0:
            rows.append({"T": T, "error": (result.stderr.strip().splitlines() or ["failed"])[-1][:200]})
        else:
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(f"# compiled N={T}: {rows[-1]}", file=sys.stderr, flush=True)
    print("| N | compile s (wall) | compile s (CPU, with workers) | compiled ms | eager ms | recompiled at N/2 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['T']} | {row['error']} | | | | |")
            continue
        print(f"| {row['T']} | {row['compile_s']:.1f} | {row['compile_cpu_s']:.1f} | {row['compiled_ms']:.1f} "
              f"| {row['eager_ms']:.1f} | {'yes' if row['recompiled'] else 'no'} |")
    return rows


def format_table(rows: list[dict]) -> str:
    columns = [
        ("B", "B", "{:d}"), ("T", "N", "{:d}"), ("M", "M", "{:d}"),
        ("ours", "ours ms", "{:.2f}"), ("chunked", "chunked ms", "{:.2f}"), ("quadratic", "quadratic ms", "{:.1f}"),
        ("sdpa", "sdpa ms", "{:.2f}"), ("fla_chunk", "fla chunk ms", "{:.2f}"),
        ("fla_parallel", "fla parallel ms", "{:.2f}"), ("sdpa_over_ours", "sdpa/ours", "{:.2f}x"),
        ("ours_tflops", "ours TFLOP/s", "{:.3f}"), ("sdpa_tflops", "sdpa TFLOP/s", "{:.3f}"),
        ("ours_pct_floor", "% floor", "{:.1f}"), ("growth", "ours x per 2N", "{:.2f}"),
        ("ours_fb", "ours fwd+bwd ms", "{:.2f}"), ("chunked_fb", "chunked fwd+bwd ms", "{:.2f}"),
        ("sdpa_fb", "sdpa fwd+bwd ms", "{:.2f}"), ("fla_chunk_fb", "fla chunk fwd+bwd ms", "{:.2f}"),
        ("sdpa_fb_over_ours_fb", "sdpa/ours fwd+bwd", "{:.2f}x"),
        ("ours_fb_saved_mib", "ours saved MiB", "{:.1f}"), ("sdpa_fb_saved_mib", "sdpa saved MiB", "{:.1f}"),
    ]
    columns = [c for c in columns if any(row.get(c[0]) is not None for row in rows)]
    header = "| " + " | ".join(title for _, title, _ in columns) + " |"
    lines = [header, "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = ["-" if row.get(key) is None else fmt.format(row[key]) for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_growth(rows: list[dict]) -> None:
    """Cost of each doubling of N at a fixed batch: linear time gives 2.0."""
    by_length = {(row["B"], row["T"]): row for row in rows}
    for row in rows:
        previous = by_length.get((row["B"], row["T"] // 2))
        if previous and previous.get("ours") and row.get("ours") and row["T"] % 2 == 0:
            row["growth"] = row["ours"] / previous["ours"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", choices=["triton", "chunked"], default=None,
                        help="'ours': default triton on CUDA, chunked on CPU (triton on CPU needs TRITON_INTERPRET=1)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="batch of the N sweep (default: 16 CUDA, 1 CPU)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default: 1k..32k on CUDA, 1k..8k on CPU")
    parser.add_argument("--batch-sweep", action="store_true", help="also sweep B = 2..64 at --batch-sweep-len")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--batch-sweep-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--feature-dim", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64, help="value dim of PLA and head dim of SDPA")
    parser.add_argument("--prefix", default="half", help="encoder length M: 'half' (N / 2) or a number")
    parser.add_argument("--no-quadratic", dest="quadratic", action="store_false", help="skip the O(N^2) reference")
    parser.add_argument("--quadratic-max-gib", type=float, default=None,
                        help="skip the quadratic reference above this working set (default: 8 CUDA, 2 CPU)")
    parser.add_argument("--no-chunked", dest="chunked", action="store_false", help="on CUDA, skip the chunked path")
    parser.add_argument("--no-fla", dest="fla", action="store_false", help="skip flash-linear-attention")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default: 20 CUDA, 3 CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default: 5 CUDA, 1 CPU)")
    parser.add_argument("--stat", choices=["median", "min"], default=None,
                        help="statistic of the timed calls (default: median on CUDA, min on a shared CPU)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="roofline compute peak (default by GPU)")
    parser.add_argument("--peak-gbps", type=float, default=None, help="roofline bandwidth in GB/s (default by GPU)")
    parser.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                        help="also time forward + backward (default: on for CUDA, off on CPU)")
    parser.add_argument("--train-step", action="store_true",
                        help="also time a training step of a small model, chunked vs Triton (tokens/s)")
    parser.add_argument("--train-batch", type=int, default=4)
    parser.add_argument("--train-length", type=int, default=2048, help="tokens per row (<= 64: a tiny model)")
    parser.add_argument("--compile-lengths", type=int, nargs="*", default=None, metavar="N",
                        help="also time torch.compile of the chunked path (dynamic=True) at these lengths")
    parser.add_argument("--compile-only", action="store_true", help="only the compile-time table")
    parser.add_argument("--compile-timeout", type=float, default=1800.0, help="seconds per compile point")
    parser.add_argument("--compile-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="two short lengths, fewer repeats")
    parser.add_argument("--json", default=None, help="write the environment and every row to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.compile_worker is not None:  # one compile point, in this fresh process: print its JSON line
        print(json.dumps(compile_point(args, args.compile_worker)))
        return []
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.batch = args.batch or (16 if cuda else 1)
    args.backward = cuda if args.backward is None else args.backward
    args.repeats = args.repeats or (20 if cuda else 3)
    args.stat = args.stat or ("median" if cuda else "min")
    args.quadratic_max_gib = args.quadratic_max_gib or (8 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if args.seq_lens is None:
        args.seq_lens = [1024, 2048, 4096, 8192, 16384, 32768] if cuda else [1024, 2048, 4096, 8192]
    if args.quick:
        args.seq_lens = [2048, 8192] if cuda else [512, 1024]
        args.batch_sizes = [4, 16]
        args.repeats = min(args.repeats, 5 if cuda else 2)
    environment = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(), "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "triton": triton_version(),
    }
    if cuda:
        peak = next((value for name, value in PEAKS.items() if name in environment["device"]), (None, None))
        args.peak_tflops = args.peak_tflops or (peak[0] and peak[0] / 1e12)
        args.peak_gbps = args.peak_gbps or (peak[1] and peak[1] / 1e9)
    args.impl = args.impl or ("triton" if cuda else "chunked")
    kernel = load_kernel() if args.impl == "triton" else None
    fla = load_fla() if args.fla else {}
    print("# " + ", ".join(f"{key} {value}" for key, value in environment.items()))
    clock = "process CPU time" if not cuda and torch.get_num_threads() == 1 else "wall time"
    print(f"# H={args.heads} K={args.feature_dim} V=head_dim={args.head_dim} M={args.prefix}; ours = "
          f"{'Triton kernel' if args.impl == 'triton' else 'chunked PyTorch'}; {args.stat} {clock} of "
          f"{args.repeats} rounds, ms")

    compile_rows = compile_table(args) if args.compile_lengths else []
    if args.compile_only:
        return []
    shapes = [(args.batch, T) for T in args.seq_lens]
    if args.batch_sweep:
        shapes += [(B, args.batch_sweep_len) for B in args.batch_sizes if (B, args.batch_sweep_len) not in shapes]
    rows = []
    for B, T in shapes:
        rows.append(measure_shape(args, device, dtype, B, T, kernel, fla))
        # each shape's times as soon as they are measured (the table comes after the last shape)
        times = ", ".join(f"{name} {rows[-1][name]:.2f}" for name in PROGRESS_COLUMNS if rows[-1].get(name))
        print(f"# done B={B} N={T}: {times} ms", file=sys.stderr, flush=True)
    add_growth(rows)
    print(format_table(rows))
    train_rows = train_step_benchmark(args, device, dtype) if args.train_step else []
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump({"environment": environment, "arguments": vars(args), "rows": rows, "train_steps": train_rows,
                       "compile": compile_rows}, handle, indent=2)
        print(f"# wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
