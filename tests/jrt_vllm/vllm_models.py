"""Tiny JRT-RNN / Based folders (with a tokenizer) for the vLLM tests, and vLLM's in-process CPU settings.

vLLM is an optional dependency: every test module here starts with `pytest.importorskip("vllm")` (before importing
this helper), so the main CI venv (without vLLM) skips them; `.ci/vllm` runs them in a venv of their own.
"""

from __future__ import annotations

import os

# Before vLLM is imported: a 1 GiB state pool, the engine in this process (no engine-core subprocess).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

import modeling_jrt
from conftest import tiny_config

# Vocabulary of the byte-level BPE tokenizer the folders carry (`byte_bpe_tokenizer`, "<pad>" = 0, "<eos>" = 1).
VOCAB_SIZE = 300
# The folders: JRT-RNN with each prefix strategy ("pad", the default; "repeat", with suppressed ids; "none"), Based
# with the fixed decay and the input-dependent gate. The weights are drawn with a large std (`initializer_range`), so
# that greedy decoding does not just repeat a token.
MODEL_KINDS = {
    "jrt-pad": dict(prefix_strategy="pad"),
    # Ids >= 250 are never generated (the released models' padded vocabulary rows): masked in vLLM's logits too.
    "jrt-repeat": dict(prefix_strategy="repeat", generation_vocab_size=250),
    "jrt-none": dict(prefix_strategy="none"),
    "based-decay": dict(linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True),
}


def build_model(kind: str) -> modeling_jrt.JRTRNNForCausalLM:
    """The tiny model of `kind` (fixed seed), in eval mode."""
    overrides = dict(
        vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=1, pad_token_id=0, prefix_pad_token_id=220,
        initializer_range=0.2,
    )
    overrides.update(MODEL_KINDS[kind])
    torch.manual_seed(0)
    return modeling_jrt.JRTRNNForCausalLM(tiny_config(**overrides)).eval()


def save_model(kind: str, path, tokenizer) -> modeling_jrt.JRTRNNForCausalLM:
    """Write the tiny model of `kind` and `tokenizer` to `path` (as `save_pretrained` does); returns the model."""
    model = build_model(kind)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def greedy_reference(model: modeling_jrt.JRTRNNForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The tokens `generate()` adds to `prompt` alone, greedy, without stopping at EOS."""
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )
    return output[0, len(prompt) :].tolist()


def greedy(max_tokens: int, **kwargs) -> "vllm.SamplingParams":  # noqa: F821 (vLLM is imported by the caller's skip)
    """vLLM's sampling parameters of `greedy_reference`: greedy, `max_tokens` new tokens, not stopping at EOS."""
    import vllm

    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)
