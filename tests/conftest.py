"""Shared fixtures: tiny configs with every layer type (hidden 32, vocab 99), fixed seeds, one thread."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA the Triton kernel tests (tests/jrt_kernels/) run in triton's CPU interpreter. triton reads
# TRITON_INTERPRET when `triton.language` is first imported, and importing transformers (hence modeling_jrt)
# already does that, so it is set here, before anything else. Only triton kernels see it; an explicit
# TRITON_INTERPRET in the environment wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import modeling_jrt  # noqa: E402

torch.set_num_threads(1)


def tiny_config(**overrides) -> modeling_jrt.JRTRNNConfig:
    """A 4-layer model with every layer type; odd sizes on purpose (prefix 8, window 5, feature dim 4)."""
    values = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        mixer_types=["conv", "linear_attention", "sliding_attention", "conv"],
        feature_dim=4,
        prefix_length=8,
        sliding_window=5,
        linear_attention_chunk_size=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        prefix_pad_token_id=3,
    )
    values.update(overrides)
    return modeling_jrt.JRTRNNConfig(**values)


def enable_activation_checkpointing(model, **kwargs) -> None:
    """transformers' activation checkpointing of the decoder layers with `kwargs` (e.g. `use_reentrant=False`), under
    the name of the installed release: `activation_checkpointing_enable` (newer releases) or
    `gradient_checkpointing_enable` (older ones, e.g. 5.17)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def saved_for_backward_bytes(run, exclude=()) -> tuple[int, object]:
    """`(bytes, result)`: the distinct storages of every tensor autograd saves for the backward pass while `run()`
    executes (`torch.autograd.graph.saved_tensors_hooks`), less those of the tensors in `exclude` (inputs,
    parameters), and what `run()` returned."""
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude if tensor is not None}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(saved.values()), result


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def make_config():
    """Factory fixture: `make_config(**overrides)` -> a tiny `JRTRNNConfig` (see `tiny_config`)."""
    return tiny_config


RECALL_FIXTURE = Path(__file__).resolve().parents[1] / "examples" / "data" / "recall_fixture.jsonl"


@pytest.fixture(scope="session")
def byte_bpe_tokenizer():
    """A byte-level BPE tokenizer (vocab 300) trained offline on the recall fixture: exact decode round trips.

    Special tokens: "<pad>" = 0, "<eos>" = 1; left padding, as batched generation wants.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(RECALL_FIXTURE.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


@pytest.fixture(scope="session")
def load_benchmark():
    """Imports a script of benchmarks/ as a module: `load_benchmark("prefill")` (registered in sys.modules under
    `benchmarks_<name>` while the session runs, as dataclasses look their module up)."""
    import importlib.util
    import sys

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    yield load
    for name in loaded:
        sys.modules.pop(f"benchmarks_{name}", None)


@pytest.fixture
def auto_takes_kernel(monkeypatch):
    """Kernel tests: makes `"auto"` choose the Triton kernels on CPU too (the interpreter), until a kernel is marked
    failed in the choice that runs it; transformers' warn-once cache is cleared so that each test sees its own
    fallback warning."""
    from transformers.utils import logging as hf_logging

    from modeling_jrt import kernel_choice

    monkeypatch.setattr(kernel_choice, "KERNEL_DEVICE_TYPES", ("cuda", "cpu"))
    hf_logging.warning_once.cache_clear()
