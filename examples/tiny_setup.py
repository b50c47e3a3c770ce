"""Offline building blocks shared by the training examples: a byte-level tokenizer, a small built-in corpus and
the config of a tiny JRT-RNN. Nothing here is downloaded; replace them with your tokenizer and data."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

import torch

from modeling_jrt import JRTRNNConfig, default_mixer_types

EOS_ID = 256  # bytes are 0..255
MASK_ID = 257  # the [MASK] of the JRT objective
VOCAB_SIZE = 264  # 258 ids, padded to a multiple of 8 as the released models


def encode(text: str) -> list[int]:
    """UTF-8 bytes as token ids."""
    return list(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def builtin_corpus(num_documents: int = 400, seed: int = 0) -> list[str]:
    """Key-value records followed by questions about them: text where reading the context twice pays off."""
    rng = random.Random(seed)
    words = ["amber", "basil", "cedar", "delta", "ember", "flint", "grove", "heron", "indigo", "jade", "kelp", "lotus"]
    documents = []
    for _ in range(num_documents):
        pairs = {rng.choice(words): rng.randint(10, 99) for _ in range(6)}
        records = " ".join(f"{key}={value};" for key, value in pairs.items())
        key = rng.choice(list(pairs))
        documents.append(f"{records} what is {key}? {key} is {pairs[key]}.")
    return documents


def tiny_config(prefix_length: int = 64, hidden_size: int = 64, num_layers: int = 4) -> JRTRNNConfig:
    """A JRT-RNN with every layer type (conv, prefix linear attention, sliding attention) and a byte vocabulary."""
    return JRTRNNConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=4, feature_dim=8, sliding_window=33,
                        mixer_types=default_mixer_types(num_layers), prefix_length=prefix_length, mask_token_id=MASK_ID,
                        prefix_pad_token_id=ord(" "), bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)


def end_distributed(*, synchronize: bool) -> None:
    """Tear down the process group that Trainer started under torchrun / accelerate, so that every rank exits with
    its own status. A rank that exits with the gloo group still alive can abort in the group's destructor
    ("terminate called without an active exception"), e.g. while rank 0 is still saving. `synchronize` first waits
    for every rank (skip it when this rank failed: the others would wait for it forever)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if synchronize:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


Arguments = TypeVar("Arguments")


def run_distributed(entry: Callable[[Arguments], int], arguments: Arguments) -> int:
    """Run an example's `entry(arguments)` (its parsed command line), then `end_distributed`: after a success every
    rank waits for the others (rank 0 saves and samples), a failing rank leaves at once with its exception."""
    try:
        code = entry(arguments)
    except BaseException:
        end_distributed(synchronize=False)
        raise
    end_distributed(synchronize=True)
    return code
