"""Whole-model checks of the GPU paths: each model kind on `--device` (the fused Triton prefill, its fused backward,
the serving decode kernel) against the same weights on the CPU (the chunked PyTorch path).

For JRT-RNN with each prefix fill ("pad", "repeat", "none") and Based with decay and gate, a small random model
(`build`: every mixer type; weights drawn wide so that greedy decoding does not repeat one token):

    forward    logits of a left-padded batch (prompt lengths 7..40) in fp32: max |device - CPU| / max |CPU|
    generate   greedy `generate()` of 24 tokens for that batch in fp32: the device's tokens equal the CPU's
    backward   the JRT objective (`labels`, `prompt_lengths`) in fp32: the largest ||grad_device - grad_CPU|| /
               ||grad_CPU|| over parameters
    bf16       the logits with bf16 weights on the device against fp32 on the CPU (reported, and bounded)

and, once, the serving decode step at pool slots (`linear_attention_step_at_slots`, the Triton kernel and the PyTorch
step) replayed from a CUDA graph with new inputs, against the eager step. Exits 1 when a check fails or a Triton kernel
fell back to PyTorch.

    python benchmarks/gpu_model_check.py                     # on a CUDA machine (about a minute)
    TRITON_INTERPRET=1 python benchmarks/gpu_model_check.py --device cpu --impl triton   # dry run on a CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for a run by path

from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM  # noqa: E402
from modeling_jrt.linear_attention import (  # noqa: E402
    fixed_log_decay, linear_attention_step_at_slots, num_taylor_features)

# Based first: a run that its time limit cuts short has still checked it.
MODEL_KINDS = {
    "based-decay": dict(linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True),
    "jrt-pad": dict(prefix_strategy="pad"),
    "jrt-repeat": dict(prefix_strategy="repeat"),
    "jrt-none": dict(prefix_strategy="none"),
}
PROMPT_LENGTHS = (40, 7, 23, 31)
NEW_TOKENS = 24
TOLERANCE = {"forward": 1e-3, "backward": 1e-3, "bf16": 6e-2}


def build(kind: str, implementation: str) -> JRTRNNForCausalLM:
    """The small model of `kind` (seed 0), fp32, eval mode, on the CPU."""
    config = JRTRNNConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        mixer_types=["conv", "linear_attention", "sliding_attention", "linear_attention"], feature_dim=16,
        prefix_length=24, sliding_window=9, linear_attention_chunk_size=16, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, prefix_pad_token_id=3, initializer_range=0.1, linear_attention_implementation=implementation,
        **MODEL_KINDS[kind],
    )
    torch.manual_seed(0)
    return JRTRNNForCausalLM(config).eval()


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask (B, T) of the prompts, left-padded with id 0."""
    generator = torch.Generator().manual_seed(1)
    T = max(PROMPT_LENGTHS)
    input_ids = torch.zeros(len(PROMPT_LENGTHS), T, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(PROMPT_LENGTHS):
        input_ids[row, T - length :] = torch.randint(4, 512, (length,), generator=generator)
        attention_mask[row, T - length :] = 1
    return input_ids, attention_mask


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32 on the CPU."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_model(kind: str, device: torch.device, implementation: str) -> dict:
    """The four model checks of one kind; returns their numbers and verdicts."""
    reference = build(kind, "chunked")
    model = build(kind, implementation).to(device)
    input_ids, attention_mask = left_padded_batch()
    result: dict = {}

    with torch.no_grad():
        expected = reference(input_ids, attention_mask=attention_mask).logits
        actual = model(input_ids.to(device), attention_mask=attention_mask.to(device)).logits
    result["forward"] = relative(actual * attention_mask.to(device)[..., None], expected * attention_mask[..., None])

    generate = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected_tokens = reference.generate(input_ids, attention_mask=attention_mask, **generate)
        actual_tokens = model.generate(input_ids.to(device), attention_mask=attention_mask.to(device), **generate)
    same = (actual_tokens.cpu() == expected_tokens)[:, input_ids.shape[1] :]
    result["generate"] = f"{same.sum().item()}/{same.numel()} tokens equal"
    result["generate_ok"] = bool(same.all())

    # Training: the JRT objective on an unpadded batch (every row's prompt is its first 24 tokens).
    batch = input_ids[:, -max(PROMPT_LENGTHS) :].clone()
    batch[batch == 0] = 5
    prompt_lengths = torch.full((batch.shape[0],), 24)
    reference.train()
    model.train()
    for net, ids, lengths in ((reference, batch, prompt_lengths), (model, batch.to(device), prompt_lengths.to(device))):
        net.zero_grad()
        net(ids, labels=ids, prompt_lengths=lengths).loss.backward()
    errors = [((actual.grad.cpu() - expected.grad).norm() / expected.grad.norm()).item()
              for expected, actual in zip(reference.parameters(), model.parameters()) if expected.grad is not None]
    result["backward"] = max([0.0, *errors])

    model.eval()
    model.to(torch.bfloat16)
    with torch.no_grad():
        half = model(input_ids.to(device), attention_mask=attention_mask.to(device)).logits
    result["bf16"] = relative(half * attention_mask.to(device)[..., None], expected * attention_mask[..., None])
    # The kernels that failed under "auto" (logged once, then PyTorch): the model's kernel choice records them.
    result["kernel_failures"] = dict(model.model.kernels.failures)
    return result


def check_decode_graph(device: torch.device, implementation: str) -> dict:
    """The serving decode step at pool slots, eager and replayed from a CUDA graph with new inputs: max |diff|."""
    B, H, K, V, slots_in_pool = 5, 4, 16, 32, 12
    F = num_taylor_features(K)
    generator = torch.Generator().manual_seed(2)

    def inputs():
        q, k = (torch.randn(B, H, K, generator=generator).to(device) for _ in range(2))
        v = torch.randn(B, H, V, generator=generator).to(device)
        gate = torch.rand(B, H, generator=generator).to(device)
        return q, k, v, gate

    pool = torch.rand(slots_in_pool, H, F, V + 1, generator=generator).to(device)
    slots = torch.tensor([7, 0, 3, 11, 5], device=device)
    log_decay = fixed_log_decay(-3.0, range(H), device)
    results = {}
    for name in ("triton", "chunked"):  # "chunked": the PyTorch step (gather, update, write back)
        if name == "triton" and implementation != "triton" and device.type != "cuda":
            continue
        static = inputs()
        static_pool = pool.clone()

        def step(tensors=static, state=static_pool):
            q, k, v, gate = tensors
            return linear_attention_step_at_slots(q, k, v, state, slots, log_decay=log_decay, gate=gate,
                                                  implementation=name)

        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up (compiles the kernel) outside the graph
                step()
            torch.cuda.current_stream().wait_stream(stream)
            static_pool.copy_(pool)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_output = step()
        fresh = inputs()
        eager_pool = pool.clone()
        eager_output = step(fresh, eager_pool)
        static_pool.copy_(pool)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        if device.type == "cuda":
            graph.replay()
            torch.cuda.synchronize()
        else:
            static_output = step()
        results[name] = max((static_output - eager_output).abs().max().item(),
                            (static_pool - eager_pool).abs().max().item())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", default="auto", help="the device model's linear_attention_implementation")
    parser.add_argument("--kinds", nargs="+", default=list(MODEL_KINDS), choices=list(MODEL_KINDS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failures = []
    try:
        graph = check_decode_graph(device, args.impl)
        print("decode step at slots, graph replay vs eager, max |diff|: "
              + ", ".join(f"{name} {value:.2e}" for name, value in graph.items()), flush=True)
        failures += [f"decode graph {name}" for name, value in graph.items() if not value <= 1e-5]
    except Exception as error:
        print(f"decode step at slots in a CUDA graph: failed: {type(error).__name__}: {error}")
        failures.append("decode graph")
    print(f"{'model':<12} | {'forward rel':>11} | {'generate':>22} | {'backward rel':>12} | {'bf16 rel':>9} | s")
    for kind in args.kinds:
        start = time.perf_counter()
        try:
            result = check_model(kind, device, args.impl)
        except Exception as error:  # report and go on to the next kind
            print(f"{kind:<12} | failed: {type(error).__name__}: {error}")
            failures.append(f"{kind}: {type(error).__name__}")
            continue
        print(f"{kind:<12} | {result['forward']:>11.2e} | {result['generate']:>22} | {result['backward']:>12.2e} | "
              f"{result['bf16']:>9.2e} | {time.perf_counter() - start:.0f}", flush=True)
        failures += [f"{kind} {name}" for name, bound in TOLERANCE.items() if not result[name] <= bound]
        failures += [] if result["generate_ok"] else [f"{kind} generate"]
        # A fallback would make the GPU side the chunked path, and the comparisons vacuous.
        for kernel, failure in result["kernel_failures"].items():
            print(f"the Triton {kernel} kernel fell back to PyTorch: {failure}")
            failures.append(f"triton {kernel} fallback")
    print("all checks passed" if not failures else f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
