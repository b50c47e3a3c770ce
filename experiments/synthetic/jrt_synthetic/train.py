"""Training and evaluation of tiny JRT-RNN / Based models on the synthetic recall tasks (docs/synthetics.md, 2-3).

Both arms of an experiment use the same `JRTRNNForCausalLM` stack ([conv, linear attention] x 2, no MLP, tied
embeddings) and differ only in `linear_attention_type` ("prefix" = JRT-RNN, "causal" = Based), so their recurrent
state has the same size. The loss and the metric only look at labelled positions: the LM head runs on the hidden
states of those positions only.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from jrt_cli.demo_models import recurrent_state_size  # noqa: F401  (re-exported)
from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM

from .data import IGNORE_INDEX, SyntheticBatch, prefix_query_mqar, set_disjointness

# Seed of the held-out evaluation sets: identical for every arm and every training seed.
EVAL_SEED = 10_000


@dataclass
class TaskSpec:
    """What to train on and evaluate.

    Attributes:
        kind: "sd" (set disjointness) or "qmqar" (prefix-query MQAR).
        vocab_size: `V` (68 for SD, 132 for qmqar in the experiments).
        train_slices: SD: `(|A|, |B|)` pairs; qmqar: `(D,)` curriculum values. One is drawn per training batch.
        eval_slices: slices of the held-out set, `eval_examples` examples each.
        repeat: SD only: times the context is given (2 = JRT-Prompt).
        order: qmqar only: "CQ", "QC" or "CQC" (JRT-Prompt).
        num_queries: qmqar only: questions per example `m`.
        eval_examples: examples per evaluation slice.
    """

    kind: str
    vocab_size: int
    train_slices: list[tuple[int, ...]]
    eval_slices: list[tuple[int, ...]]
    repeat: int = 1
    order: str = "CQ"
    num_queries: int = 2
    eval_examples: int = 1000

    def __post_init__(self):
        if self.kind not in ("sd", "qmqar"):
            raise ValueError(f"`kind` must be 'sd' or 'qmqar', got {self.kind!r}.")
        self.train_slices = [tuple(s) for s in self.train_slices]
        self.eval_slices = [tuple(s) for s in self.eval_slices]

    def sample(self, rng: np.random.RandomState, num_examples: int, slice_: tuple[int, ...]) -> SyntheticBatch:
        if self.kind == "sd":
            short_length, long_length = slice_
            return set_disjointness(rng, num_examples, short_length, long_length, self.vocab_size, self.repeat)
        (num_kv_pairs,) = slice_
        return prefix_query_mqar(rng, num_examples, num_kv_pairs, self.num_queries, self.vocab_size, self.order)

    @staticmethod
    def slice_name(slice_: tuple[int, ...]) -> str:
        return "_".join(str(v) for v in slice_) if len(slice_) > 1 else f"D={slice_[0]}"

    def eval_sets(self) -> dict[str, SyntheticBatch]:
        """The fixed held-out sets, one per slice, seeded by `EVAL_SEED` and the slice index."""
        return {self.slice_name(s): self.sample(np.random.RandomState(EVAL_SEED + i), self.eval_examples, s)
                for i, s in enumerate(self.eval_slices)}


@dataclass
class RunSpec:
    """One training run: an arm of an experiment with one seed.

    `linear_attention_type` is "prefix" (JRT-RNN: the encoder reads the whole prompt, `prefix_length` of the
    batch) or "causal" (Based). `embedding_init_std` re-initialises the (tied) token embedding with N(0, std^2):
    1.0 is PyTorch's `nn.Embedding` default that zoology-style synthetic models use; `None` keeps the model's
    `initializer_range` (0.02), with which the pre-norm residual stream is dominated by the mixers' outputs and
    the token identities that recall needs fade (see docs/synthetic_results.md).
    """

    name: str
    task: TaskSpec
    linear_attention_type: str
    seed: int = 0
    steps: int = 4000
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    grad_clip: float = 1.0
    hidden_size: int = 64
    num_attention_heads: int = 2
    feature_dim: int = 2
    embedding_init_std: float | None = 1.0
    eval_every: int = 1000
    log_every: int = 50


def build_model_config(spec: RunSpec, prefix_length: int) -> JRTRNNConfig:
    """The zoology-style tiny model: [conv, linear attention, conv, linear attention], no MLP, tied embeddings.

    `prefix_length` is stored in the config (what `generate()` uses); training passes each batch's own prompt length.
    """
    return JRTRNNConfig(vocab_size=spec.task.vocab_size, hidden_size=spec.hidden_size, intermediate_size=0,
                        num_hidden_layers=4, num_attention_heads=spec.num_attention_heads,
                        mixer_types=["conv", "linear_attention", "conv", "linear_attention"],
                        feature_dim=spec.feature_dim, conv_kernel_size=3, conv_expansion=1,
                        linear_attention_type=spec.linear_attention_type, prefix_length=prefix_length,
                        prefix_pad_token_id=None, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                        tie_word_embeddings=True)


def labelled_logits(model: JRTRNNForCausalLM, batch: SyntheticBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits `(N, V)` at the N labelled positions of `batch` (row-major order), their labels `(N,)` and rows
    `(N,)`. The encoder of a prefix model reads `batch.prefix_length` tokens."""
    hidden = model.model(input_ids=batch.input_ids, prefix_length=batch.prefix_length, use_cache=False)
    hidden = hidden.last_hidden_state  # (B, T, d)
    rows, positions = (batch.labels != IGNORE_INDEX).nonzero(as_tuple=True)
    return model.lm_head(hidden[rows, positions]), batch.labels[rows, positions], rows


@torch.no_grad()
def per_example_accuracy(model: JRTRNNForCausalLM, batch: SyntheticBatch, chunk: int = 256) -> torch.Tensor:
    """`(B,)` accuracy of each example: the fraction of its labelled positions where argmax = label."""
    results = []
    for start in range(0, batch.input_ids.shape[0], chunk):
        part = SyntheticBatch(batch.input_ids[start:start + chunk], batch.labels[start:start + chunk],
                              batch.prefix_length)
        logits, labels, rows = labelled_logits(model, part)
        correct = (logits.argmax(-1) == labels).float()
        hits = torch.zeros(part.input_ids.shape[0]).index_add_(0, rows, correct)
        counts = torch.zeros(part.input_ids.shape[0]).index_add_(0, rows, torch.ones_like(correct))
        results.append(hits / counts)
    return torch.cat(results)


def evaluate(model: JRTRNNForCausalLM, eval_sets: dict[str, SyntheticBatch]) -> dict[str, float]:
    """Mean per-example accuracy of each held-out slice."""
    was_training = model.training
    model.eval()
    accuracy = {name: per_example_accuracy(model, batch).mean().item() for name, batch in eval_sets.items()}
    model.train(was_training)
    return accuracy


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """Learning-rate multiplier: linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def machine_description() -> dict:
    """What the timings were measured on."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def train_run(spec: RunSpec, out_dir: str | Path | None = None, progress_position: int = 0,
              show_progress: bool = True) -> dict:
    """Train one run, evaluate it on the fixed held-out sets and (if `out_dir`) save the model and the results.

    Data: a fresh batch every step from `RandomState(seed)` (one `task.train_slices` entry per batch); model
    init from `torch.manual_seed(seed)`. Optimiser: AdamW, `lr` with linear warmup + cosine decay, gradient
    clipping. Writes `out_dir/results.json` and `out_dir/model/` (`save_pretrained`).

    Returns:
        The results dict: spec, final and intermediate accuracies, loss curve (mean per `log_every` steps),
        recurrent state size, parameter count, timings and machine.
    """
    torch.manual_seed(spec.seed)
    rng = np.random.RandomState(spec.seed)
    eval_sets = spec.task.eval_sets()
    config = build_model_config(spec, prefix_length=next(iter(eval_sets.values())).prefix_length)
    model = JRTRNNForCausalLM(config)
    model.config.prefix_strategy = "none"  # the task's inputs are the prompts, never filled
    if spec.embedding_init_std is not None:
        torch.nn.init.normal_(model.model.embed_tokens.weight, std=spec.embedding_init_std)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    warmup = max(1, int(spec.warmup_fraction * spec.steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, spec.steps, warmup))

    losses, curve, eval_curve = [], [], []
    start = time.perf_counter()
    bar = tqdm(range(spec.steps), desc=f"{spec.name} seed {spec.seed}", position=progress_position,
               disable=not show_progress, mininterval=2.0, leave=True, dynamic_ncols=True)
    for step in bar:
        slice_ = spec.task.train_slices[rng.randint(len(spec.task.train_slices))]
        logits, labels, _ = labelled_logits(model, spec.task.sample(rng, spec.batch_size, slice_))
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % spec.log_every == 0:
            curve.append({"step": step + 1, "loss": float(np.mean(losses[-spec.log_every:]))})
            bar.set_postfix(loss=f"{curve[-1]['loss']:.3f}")
        if spec.eval_every and (step + 1) % spec.eval_every == 0 and step + 1 < spec.steps:
            eval_curve.append({"step": step + 1, "accuracy": evaluate(model, eval_sets)})
    train_seconds = time.perf_counter() - start
    bar.close()
    accuracy = evaluate(model, eval_sets)
    eval_curve.append({"step": spec.steps, "accuracy": accuracy})
    model.eval()
    results = {
        "name": spec.name, "seed": spec.seed, "spec": asdict(spec), "accuracy": accuracy, "eval_curve": eval_curve,
        "loss_curve": curve, "final_train_loss": float(np.mean(losses[-min(len(losses), 200):])),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "recurrent_state_floats": recurrent_state_size(model, next(iter(eval_sets.values()))),
        "train_seconds": train_seconds, "ms_per_step": 1000 * train_seconds / spec.steps,
        "machine": machine_description(),
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir / "model")
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results
