"""What the benchmark scripts share: the same-size JRT-RNN / Llama pair and its flags, a synchronised clock, the peak
RSS and the prefill cost model. Importing it makes the repository root importable (the scripts run by path)."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of `fn()` on `clock`, the device synchronised before and after."""
    synchronize(device)
    start = clock()
    fn()
    synchronize(device)
    return clock() - start


def training_step(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> Callable[[], None]:
    """One training step as `Trainer` runs it: forward with labels (`kwargs` too), backward, AdamW, zero_grad."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(input_ids, labels=input_ids, **kwargs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def peak_rss() -> int:
    """Peak resident set size of this process in bytes: VmHWM, its own high-water mark (ru_maxrss, the fallback
    without /proc, is carried across exec on Linux: it would report the parent's RSS at fork time when larger)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def add_model_arguments(parser: argparse.ArgumentParser, device: str = "cpu") -> None:
    """The flags `build_models` and `model_configs` read: the shape of both models, their device and dtype."""
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--sliding-window", type=int, default=129)
    parser.add_argument("--device", default=device, help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights of both models")


def model_configs(args: argparse.Namespace, *, token_id: int | None = 0, jrt: dict, llama: dict) -> tuple:
    """JRT-RNN and Llama configs of the same width, depth, heads, MLP (2 x hidden) and vocabulary (`args`' shape
    flags), with `jrt` / `llama` the options of each."""
    from transformers import LlamaConfig

    from modeling_jrt import JRTRNNConfig

    shape = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, bos_token_id=token_id,
                 eos_token_id=token_id)
    return (JRTRNNConfig(**shape, sliding_window=args.sliding_window, **jrt),
            LlamaConfig(**shape, num_key_value_heads=args.heads, **llama))


def build_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    """JRT-RNN (prefix 1024) and Llama of `add_model_arguments`' shape, random weights (seed 0), eval mode, on
    `args.device` in `args.dtype`."""
    from transformers import LlamaForCausalLM

    from modeling_jrt import JRTRNNForCausalLM

    jrt, llama = model_configs(args, jrt=dict(prefix_length=1024), llama=dict(max_position_embeddings=1 << 16))
    torch.manual_seed(0)
    models = JRTRNNForCausalLM(jrt).eval(), LlamaForCausalLM(llama).eval()
    return tuple(model.to(args.device, getattr(torch, args.dtype)) for model in models)


def pla_flops(T: int, M: int, K: int, V: int, chunk: int = 64) -> float:
    """FLOPs per (batch, head) of the chunked algorithm (docs/prefill.md §4.2, denominator column included).

    Decoder token: intra-chunk 2 C (K + V + 1), inter-chunk and state update 2 (K + K^2) (V + 1) each;
    encoder token: the update only.
    """
    update = 2 * (K + K * K) * (V + 1)
    return T * (2 * chunk * (K + V + 1) + 2 * update) + M * update


def pla_bytes(T: int, M: int, K: int, V: int, element_size: int) -> float:
    """HBM bytes per (batch, head): read q, k, v, k_enc, v_enc, write o, write the fp32 state (1 + K + K^2 features;
    written out, as kernel_aot.py needs no transformers)."""
    return (T * (2 * K + 2 * V) + M * (K + V)) * element_size + (1 + K + K * K) * (V + 1) * 4
