"""Kernel launches of a decode step and of a prefill, JRT-RNN against a same-size Llama, side by side.

An eager decode step on a GPU is bound by its kernel launches (a few microseconds of host time each, for kernels that
run for less), and so is a short prefill. On CUDA this counts the kernels `torch.profiler` records (the Triton ones
included); on CPU the operators the dispatcher runs (`DispatchCounter`) on the code path a GPU runs (`gpu_code_path`).
The decode step is the one `generate()` runs by default (eager, no attention mask: the cache keeps the padding flags),
from a cache that read `--context` tokens; the JRT-RNN / Llama ratio is what the issue's goal (at most 0.7 for a
decode step, 1.5 for a prefill) is measured against.

    OMP_NUM_THREADS=1 python benchmarks/launches.py      # hidden 256, 8 layers; decode B=16, prefill 4096 at B=1, 8
    OMP_NUM_THREADS=1 python benchmarks/launches.py --quick      # seconds
    python benchmarks/launches.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_model_arguments, build_models  # noqa: E402

from modeling_jrt import inference_chunking  # noqa: E402
from modeling_jrt import modeling_jrt as jrt_modeling  # noqa: E402
from modeling_jrt.compat import output_cache  # noqa: E402


class DispatchCounter(TorchDispatchMode):
    """Counts the operators that reach the dispatcher's backend, by name; views and metadata-only ops are left out
    (they launch nothing). `paused()` stops counting for a call whose launches are counted by hand."""

    SKIPPED = {
        "aten.detach.default", "aten.alias.default", "aten.lift_fresh.default", "aten._local_scalar_dense.default",
        "aten._unsafe_view.default",  # a reshape that returns a new tensor header over the same data
    }

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.extra = 0
        self.active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.active and not func.is_view and name not in self.SKIPPED:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self):
        self.active = False
        try:
            yield
        finally:
            self.active = True

    @property
    def total(self) -> int:
        return sum(self.ops.values()) + self.extra


@contextlib.contextmanager
def gpu_code_path(counter: DispatchCounter):
    """On CPU, the code path of a GPU: the accelerator's chunk budget, the linear attention's prefill counted as the
    fused Triton kernel's one launch (its one-pass prefill below `SEGMENTED_FROM` tokens, 4k by default; its few
    host-side allocations are not counted), its eager decode step as the fused step's one, and each RMSNorm (without
    autograd) as the fused norm kernel's one."""
    budget = inference_chunking.INFERENCE_CHUNK_ELEMENTS
    saved = {name: getattr(jrt_modeling, name)
             for name in ("prefix_linear_attention", "linear_attention_step", "fused_rms_norm")}

    def one_launch(fn):
        def launch(*args, **kwargs):
            counter.extra += 1
            with counter.paused():
                return fn(*args, **kwargs)
        return launch

    def fused_norm(hidden_states, weight, eps, choice, out=None):  # the fused RMSNorm kernel: one launch
        if torch.is_grad_enabled():
            return None
        counter.extra += 1
        with counter.paused():
            x = hidden_states.float()
            y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)
            return y if out is None else out.copy_(y)

    inference_chunking.INFERENCE_CHUNK_ELEMENTS = inference_chunking.ACCELERATOR_CHUNK_ELEMENTS
    # the eager decode step takes no slots (row b is state b): the fused step's one launch
    jrt_modeling.prefix_linear_attention = one_launch(saved["prefix_linear_attention"])
    jrt_modeling.linear_attention_step = one_launch(saved["linear_attention_step"])
    jrt_modeling.fused_rms_norm = fused_norm
    try:
        yield
    finally:
        inference_chunking.INFERENCE_CHUNK_ELEMENTS = budget
        for name, fn in saved.items():
            setattr(jrt_modeling, name, fn)


def count_launches(run, device: torch.device) -> int:
    """Kernels (CUDA) or dispatched operators on the GPU's code path (CPU) of `run()`."""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        run()  # warm: allocator, cuBLAS handles, Triton compilation
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
        return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    counter = DispatchCounter()
    with gpu_code_path(counter), counter:
        run()
    return counter.total


@torch.no_grad()
def measure(model, vocab: int, batch: int, context: int, prefill: int, prefill_batch: int, device: torch.device
            ) -> dict[str, int]:
    """Launches of one decode step of `batch` rows after `context` tokens, and of a `prefill`-token prompt at batch 1
    and `prefill_batch`."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (batch, context), generator=generator).to(device)
    cache = output_cache(model(prompt, use_cache=True, logits_to_keep=1))
    token = prompt[:, -1:].contiguous()
    counts = {"decode": count_launches(lambda: model(token, cache=cache, logits_to_keep=1), device)}
    for rows in (1, prefill_batch):
        long_prompt = torch.randint(0, vocab, (rows, prefill), generator=generator).to(device)
        counts[f"prefill_b{rows}"] = count_launches(
            lambda: model(long_prompt, use_cache=True, logits_to_keep=1), device)
    return counts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=512, help="tokens the cache read before the decode step")
    parser.add_argument("--prefill", type=int, default=4096, help="prompt length of the counted prefill")
    parser.add_argument("--prefill-batch", type=int, default=8, help="rows of the second counted prefill")
    parser.add_argument("--quick", action="store_true", help="hidden 64, 4 layers, batch 2, prefill 256")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden_size, args.layers, args.heads, args.batch, args.context, args.prefill = 64, 4, 4, 2, 32, 256
        args.prefill_batch, args.sliding_window = 2, 17
    device = torch.device(args.device)
    jrt, llama = build_models(args)
    what = "CUDA kernels (torch.profiler)" if device.type == "cuda" else "dispatched ops on the GPU's code path"
    print(f"{what}; hidden {args.hidden_size}, {args.layers} layers ({', '.join(jrt.config.mixer_types)}), "
          f"{args.dtype}, decode at batch {args.batch} after {args.context} tokens, prefill of {args.prefill} tokens")
    results = {name: measure(model, args.vocab_size, args.batch, args.context, args.prefill, args.prefill_batch, device)
               for name, model in (("jrt", jrt), ("llama", llama))}
    print(f"{'':<22} {'JRT-RNN':>8} {'Llama':>8} {'JRT/Llama':>10}")
    for key, label in (("decode", f"decode step (B={args.batch})"), ("prefill_b1", "prefill (B=1)"),
                       (f"prefill_b{args.prefill_batch}", f"prefill (B={args.prefill_batch})")):
        jrt_count, llama_count = results["jrt"][key], results["llama"][key]
        print(f"{label:<22} {jrt_count:>8} {llama_count:>8} {jrt_count / llama_count:>10.2f}")
    report = {"device": str(device), "dtype": args.dtype, "counts": results,
              "args": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
