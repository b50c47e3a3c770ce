"""Property-style check over many small valid configs: finite logits, and cached decode == parallel forward.

Each case draws a layer mix, a sliding window of 1..4 keys, a prefix length of 0..T, decay on or off, 1..4 heads and a
feature dim of 1..4 from a seeded generator, builds the model and compares the teacher-forced cached decode (prefill of
the prefix, then one token at a time) with one parallel forward of the whole sequence.
"""

from __future__ import annotations

import random

import pytest
import torch

from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM
from modeling_jrt.compat import output_cache

SEQ_LEN = 7
NUM_CASES = 40
LAYER_TYPES = ("conv", "sliding_attention", "linear_attention")


def draw_config(seed: int) -> JRTRNNConfig:
    """One random small valid config (every choice within the documented ranges)."""
    rng = random.Random(seed)
    num_layers = rng.randint(1, 3)
    heads = rng.randint(1, 4)
    causal = rng.random() < 0.5
    decay = causal and rng.random() < 0.5
    return JRTRNNConfig(
        vocab_size=37,
        hidden_size=heads * rng.choice((2, 4, 6)),
        intermediate_size=rng.choice((0, 16)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        mixer_types=[rng.choice(LAYER_TYPES) for _ in range(num_layers)],
        sliding_window=rng.randint(1, 4),
        conv_kernel_size=rng.randint(1, 4),
        conv_expansion=rng.randint(1, 2),
        feature_dim=rng.randint(1, 4),
        linear_attention_type="causal" if causal else "prefix",
        prefix_length=0 if causal else rng.randint(0, SEQ_LEN),
        linear_attention_decay=decay,
        use_decay_proj=decay and rng.random() < 0.5,
        decay_const=rng.choice((-1.0, -3.0)),
        linear_attention_chunk_size=rng.randint(1, 5),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        prefix_pad_token_id=3,
    )


def case_id(seed: int) -> str:
    config = draw_config(seed)
    kinds = "".join(t[0] for t in config.mixer_types)
    return (
        f"s{seed}-{kinds}-W{config.sliding_window}-H{config.num_attention_heads}-F{config.feature_dim}"
        f"-{config.linear_attention_type}{config.prefix_length}{'-decay' if config.linear_attention_decay else ''}"
    )


@pytest.mark.parametrize("seed", [pytest.param(s, id=case_id(s)) for s in range(NUM_CASES)])
def test_small_valid_configs_give_finite_logits_and_cached_equals_parallel(seed):
    config = draw_config(seed)
    torch.manual_seed(seed)
    model = JRTRNNForCausalLM(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, SEQ_LEN))
    with torch.no_grad():
        parallel = model(input_ids, use_cache=False).logits  # (B, T, vocab)
        # The encoder reads the first forward only, so the prefill covers the whole prefix (at least one token).
        prefill = max(config.prefix_length if config.linear_attention_type == "prefix" else 0, 1)
        output = model(input_ids[:, :prefill], use_cache=True)
        steps = [output.logits]
        for t in range(prefill, SEQ_LEN):
            output = model(input_ids[:, t : t + 1], cache=output_cache(output), use_cache=True)
            steps.append(output.logits)
    cached = torch.cat(steps, dim=1)
    assert torch.isfinite(parallel).all()
    torch.testing.assert_close(cached, parallel, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_window_of_one_key_generates_like_the_parallel_forward(make_config, cache_implementation):
    """`sliding_window=1` (the converter's translation of a reference window of 0 or 1): the dynamic cache keeps no
    key (transformers' layer kept them all: its slice `[-0:]`), and greedy decoding matches the parallel argmax."""
    model = JRTRNNForCausalLM(make_config(sliding_window=1)).eval()
    input_ids = torch.randint(4, 99, (1, 9))
    output = model.generate(
        input_ids, max_new_tokens=5, do_sample=False, eos_token_id=None, prefix_strategy="none",
        cache_implementation=cache_implementation, return_dict_in_generate=True,
    )
    if cache_implementation is None:
        assert output_cache(output).layers[2].keys.shape[-2] == 0
    with torch.no_grad():
        logits = model(output.sequences[:, :-1], use_cache=False).logits
    assert torch.equal(logits[:, 8:].argmax(-1), output.sequences[:, 9:])
