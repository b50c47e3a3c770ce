"""Peak memory and time of `jrt convert` on a full-size random checkpoint of a released family.

Builds a reference checkpoint (config.json + pytorch_model.bin, the released keys and shapes of docs/
reference_architecture.md §2, random weights), converts it in a fresh process and prints that process's peak RSS, its
ratio to the checkpoint's size, and the time. Nothing is downloaded.

    python benchmarks/convert.py                                  # JRT-360M-30B's keys and shapes (1.43 GB)
    python benchmarks/convert.py --checkpoint JRT-1B-50B --dtype bfloat16
    python benchmarks/convert.py --layers 4 --hidden 64 --vocab 257  # a tiny run (what the test does)

The converter memory-maps the checkpoint and writes the safetensors shards one tensor at a time; the goal is a peak
RSS of at most 1.3x the checkpoint (the python + torch + transformers baseline, about 0.4 GB, included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Released checkpoints (docs/reference_architecture.md §1.3 table): family, d, layers, MLP hidden, attention layers.
_LA_360M, _SWA_360M = [1, 6, 11, 16, 21], [2, 7, 12, 17, 22]
_LA_1B, _SWA_1B = [1, 6, 11, 16, 21, 27, 33], [2, 7, 12, 17, 22, 28, 34]
PRESETS = {
    "JRT-360M-30B": dict(kind="jrt", hidden=1024, layers=26, mlp=2048, la=_LA_360M, swa=_SWA_360M),
    "JRT-1B-50B": dict(kind="jrt", hidden=1792, layers=36, mlp=3584, la=_LA_1B, swa=_SWA_1B),
    "based-360M-30B": dict(kind="based-decay", hidden=1024, layers=27, mlp=2048, la=_LA_360M, swa=_SWA_360M),
    "based-1b-50b": dict(kind="based", hidden=1792, layers=36, mlp=3584, la=_LA_1B, swa=_SWA_1B),
    "based-360m": dict(kind="based", hidden=1024, layers=27, mlp=2048, la=_LA_360M, swa=_SWA_360M),
    "based-1b": dict(kind="based", hidden=1792, layers=36, mlp=3584, la=_LA_1B, swa=_SWA_1B),
}
HEADS = 16
FEATURE_DIM = 16


def reference_config(preset: dict, *, vocab: int) -> dict:
    """config.json of the preset, laid out like the released files (a GPT2Config dump with mixer dicts)."""
    config = {
        "vocab_size": vocab, "n_embd": preset["hidden"], "n_layer": preset["layers"], "n_head": HEADS,
        "n_inner": preset["mlp"], "activation_function": "swiglu", "layer_norm_epsilon": 1e-5, "bos_token_id": 50256,
        "eos_token_id": 50256, "tie_word_embeddings": True, "model_type": "gpt2", "rms_norm": True,
        "pad_vocab_size_multiple": 8, "rotary_emb_fraction": 1, "alt_mixer_layers": preset["la"],
        "alt_mixer_2_layers": preset["swa"],
        "mixer": {"_target_": "based.models.mixers.convolution.BaseConv", "l_max": 2048, "use_bias": True,
                  "expand_proj": 4, "kernel_sizes": 3},
        "alt_mixer_2": {"_target_": "based.models.mixers.slide_attention.SlidingAttention", "window_size": 256,
                        "num_heads": HEADS, "causal": True},
    }
    if preset["kind"] == "jrt":
        config["alt_mixer"] = {
            "_target_": "based.models.mixers.prefix_linear_attention.PrefixLinearAttention", "l_max": 2048,
            "feature_dim": FEATURE_DIM, "feature_name": "taylor_exp", "num_heads": HEADS, "enc_length": 1024,
            "dec_length": 1024, "use_mask": True,
        }
        config.update(enc_length=1024, dec_length=1024)
    else:
        config["alt_mixer"] = {
            "_target_": "based.models.mixers.linear_attention.LinearAttention", "l_max": 2048,
            "feature_dim": FEATURE_DIM, "feature_name": "taylor_exp", "num_heads": HEADS,
            "use_decay_proj": preset["kind"] == "based-decay",
        }
        if preset["kind"] == "based-decay":
            config.update(fixed_decay=True, decay_const=-3)
    return config


def reference_shapes(config: dict, preset: dict) -> dict[str, tuple[int, ...]]:
    """Every key of the released `pytorch_model.bin` (with the Lightning `model.` prefix) and its shape."""
    d, mlp = config["n_embd"], config["n_inner"]
    rows = math.ceil(config["vocab_size"] / 8) * 8
    shapes = {"model.transformer.embeddings.word_embeddings.weight": (rows, d)}
    for i in range(config["n_layer"]):
        p = f"model.transformer.layers.{i}."
        if i in preset["swa"]:
            shapes.update({p + "mixer.Wqkv.weight": (3 * d, d), p + "mixer.out_proj.weight": (d, d)})
        elif i in preset["la"]:
            for name in ("proj_q", "proj_k") + (("proj_k_enc",) if preset["kind"] == "jrt" else ()):
                shapes[p + f"mixer.{name}.weight"] = (HEADS * FEATURE_DIM, d)
            for name in ("proj_v", "out_proj") + (("proj_v_enc",) if preset["kind"] == "jrt" else ()):
                shapes[p + f"mixer.{name}.weight"] = (d, d)
            if preset["kind"] == "based-decay":
                shapes[p + "mixer.decay_proj.weight"] = (HEADS, d)
        else:
            shapes.update({p + "mixer.in_proj.weight": (4 * d, d), p + "mixer.in_proj.bias": (4 * d,),
                           p + "mixer.conv.conv.weight": (2 * d, 1, 3), p + "mixer.out_proj.weight": (d, 2 * d),
                           p + "mixer.out_proj.bias": (d,)})
        shapes.update({p + "norm1.weight": (d,), p + "norm2.weight": (d,), p + "mlp.fc1.weight": (2 * mlp, d),
                       p + "mlp.fc2.weight": (d, mlp)})
    shapes["model.transformer.ln_f.weight"] = (d,)
    if config.get("fixed_decay"):
        shapes["model.transformer.decay.decay"] = (HEADS,)
    shapes["model.lm_head.weight"] = (rows, d)  # tied to the embedding, stored once
    shapes["train_metrics.num-tokens.count"] = ()
    return shapes


def reference_state_dict(config: dict, preset: dict, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the released keys and shapes (std 0.02, as the reference initialises; norms 1)."""
    generator = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for key, shape in reference_shapes(config, preset).items():
        if key == "model.lm_head.weight":
            sd[key] = sd["model.transformer.embeddings.word_embeddings.weight"]
        elif "metrics" in key:
            sd[key] = torch.tensor(123456)
        elif key.endswith("decay.decay"):
            sd[key] = torch.log1p(-torch.pow(2.0, -3 - torch.arange(HEADS, dtype=torch.float64))).float()
        elif "norm" in key or "ln_f" in key:
            sd[key] = torch.ones(shape)
        else:
            sd[key] = torch.randn(*shape, generator=generator).mul_(0.02)
    return sd


def build_checkpoint(folder: Path, name: str, *, layers: int | None, hidden: int | None, vocab: int,
                     legacy: bool = False) -> Path:
    preset = dict(PRESETS[name])
    if layers is not None:  # a smaller model with the same layer pattern (tests)
        preset.update(layers=layers, la=[i for i in preset["la"] if i < layers],
                      swa=[i for i in preset["swa"] if i < layers])
    if hidden is not None:
        preset.update(hidden=hidden, mlp=256 * math.ceil(2 * hidden / 256))  # GatedMlp rounds up to 256
    source = folder / name
    source.mkdir(parents=True)
    config = reference_config(preset, vocab=vocab)
    (source / "config.json").write_text(json.dumps(config))
    # legacy: the pre-zip format of torch < 1.6, which cannot be memory-mapped (read whole).
    torch.save(reference_state_dict(config, preset), source / "pytorch_model.bin",
               _use_new_zipfile_serialization=not legacy)
    return source


_CHILD = """
import json, sys, time
from _common import peak_rss as peak_bytes
from jrt_convert import convert_checkpoint
imported = peak_bytes()
start = time.perf_counter()
options = {} if sys.argv[4] == "default" else {"prefix_pad_token_id": int(sys.argv[4])}
result = convert_checkpoint(sys.argv[1], sys.argv[2], dtype=sys.argv[3], **options)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_bytes": peak_bytes(), "import_bytes": imported,
                  "parameters": result.num_parameters, "files": result.files}))
"""


def run_conversion(source: Path, destination: Path, *, dtype: str) -> dict:
    """Convert in a fresh interpreter (so the peak RSS is the conversion's own) and return its measurements."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    pad = "default" if vocab > 220 else "0"  # GPT-2's " " (220) does not fit a tiny vocabulary
    process = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(destination), dtype, pad], env=env,
                             capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"the conversion failed:\n{process.stderr[-3000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="JRT-360M-30B", choices=list(PRESETS), help="keys and shapes to build")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layers", type=int, help="fewer layers (same pattern), for a quick run")
    parser.add_argument("--hidden", type=int, help="a smaller hidden size, for a quick run")
    parser.add_argument("--vocab", type=int, default=50257, help="tokenizer vocabulary (default GPT-2's 50257)")
    parser.add_argument("--legacy", action="store_true", help="save the checkpoint in torch's pre-zip format")
    parser.add_argument("--workdir", type=Path, help="where to build and convert (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        folder = Path(folder)
        start = time.perf_counter()
        source = build_checkpoint(folder, args.checkpoint, layers=args.layers, hidden=args.hidden, vocab=args.vocab,
                                  legacy=args.legacy)
        built = time.perf_counter() - start
        checkpoint_bytes = (source / "pytorch_model.bin").stat().st_size
        measured = run_conversion(source, folder / "out", dtype=args.dtype)
        output_bytes = sum(p.stat().st_size for p in (folder / "out").iterdir() if p.is_file())
    peak, imported = measured["peak_bytes"], measured["import_bytes"]
    result = {
        "checkpoint": args.checkpoint, "dtype": args.dtype, "legacy": args.legacy, "parameters": measured["parameters"],
        "checkpoint_bytes": checkpoint_bytes, "output_bytes": output_bytes, "peak_rss_bytes": peak,
        "peak_over_checkpoint": peak / checkpoint_bytes, "import_rss_bytes": imported,
        "seconds": measured["seconds"], "build_seconds": built,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "cpu": platform.processor() or platform.machine(),
                        "threads": os.environ.get("OMP_NUM_THREADS")},
    }
    print(f"{args.checkpoint} ({measured['parameters']:,} parameters), --dtype {args.dtype}"
          f"{' (legacy pickle)' if args.legacy else ''}, torch {torch.__version__}")
    print(f"checkpoint      {checkpoint_bytes / 1e9:8.3f} GB  (built in {built:.1f} s)")
    print(f"peak RSS        {peak / 1e9:8.3f} GB  = {peak / checkpoint_bytes:.2f}x the checkpoint "
          f"(after imports: {imported / 1e9:.3f} GB)")
    print(f"conversion time {measured['seconds']:8.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
