"""Decode cost vs sequence length: JRT-RNN's recurrent cache against a same-size Llama with its KV cache.

For each total length N (prompt + generated), both models (random weights, built from configs) prefill N - steps
tokens, then decode `steps` tokens one at a time from the cache. Reported per length:

    ms/token   median wall time of one single-token forward with the cache
    cache MiB  bytes of every tensor held by the cache after the last step (the memory held per sequence)

and the Llama / JRT ratios. JRT-RNN's columns stay flat in N (fixed-size linear-attention state, a sliding window
of keys/values, a conv window); Llama's grow linearly.

    OMP_NUM_THREADS=1 python benchmarks/decode.py            # N = 512 .. 8192, hidden 256, 8 layers
    OMP_NUM_THREADS=1 python benchmarks/decode.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM
from modeling_jrt.compat import output_cache


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


@torch.no_grad()
def measure(model: torch.nn.Module, length: int, steps: int, vocab_size: int) -> tuple[float, int]:
    """(median seconds per decode step, cache bytes) after prefilling `length - steps` tokens."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (1, length - steps), generator=generator)
    output = model(prompt, use_cache=True, logits_to_keep=1)  # a fresh cache of the model's own kind
    cache, logits = output_cache(output), output.logits
    timings = []
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        logits = model(token, cache=cache).logits
        timings.append(time.perf_counter() - start)
    return statistics.median(timings), cache_bytes(cache)


def build_models(
    hidden: int, layers: int, heads: int, vocab: int, window: int
) -> tuple[JRTRNNForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    jrt = JRTRNNForCausalLM(
        JRTRNNConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, prefix_length=1024, sliding_window=window, bos_token_id=0, eos_token_id=0,
        )
    ).eval()
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1 << 16,
            bos_token_id=0, eos_token_id=0,
        )
    ).eval()
    return jrt, llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--sliding-window", type=int, default=129)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per length")
    parser.add_argument("--quick", action="store_true", help="small model, N = 512 and 1024, 4 steps")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.hidden_size, args.layers, args.heads, args.steps = [512, 1024], 128, 4, 4, 4

    jrt, llama = build_models(args.hidden_size, args.layers, args.heads, args.vocab_size, args.sliding_window)
    print(
        f"hidden {args.hidden_size}, {args.layers} layers ({', '.join(jrt.config.mixer_types)}), {args.heads} heads, "
        f"torch threads {torch.get_num_threads()}, {args.steps} decode steps per length"
    )
    header = (
        f"{'N':>6} | {'JRT ms/tok':>10} {'Llama ms/tok':>12} {'Llama/JRT':>9} | "
        f"{'JRT cache MiB':>13} {'Llama cache MiB':>15} {'Llama/JRT':>9}"
    )
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        jrt_time, jrt_bytes = measure(jrt, length, args.steps, args.vocab_size)
        llama_time, llama_bytes = measure(llama, length, args.steps, args.vocab_size)
        print(
            f"{length:>6} | {jrt_time * 1e3:>10.2f} {llama_time * 1e3:>12.2f} {llama_time / jrt_time:>9.2f} | "
            f"{jrt_bytes / 2**20:>13.2f} {llama_bytes / 2**20:>15.2f} {llama_bytes / jrt_bytes:>9.2f}"
        )


if __name__ == "__main__":
    main()
