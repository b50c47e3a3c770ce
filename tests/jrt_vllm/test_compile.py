"""The plugin's model compiled as vLLM compiles by default (no `enforce_eager`): on vLLM's CPU backend, dynamo traces
the backbone once around the mixers' opaque `jrt_vllm::mix` ops and inductor builds it. Greedy outputs equal
`generate()`'s, as in the eager engine (test_engine.py)."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

from vllm.compilation.counter import compilation_counter  # noqa: E402
from vllm.config import CompilationMode  # noqa: E402
from vllm_models import greedy_reference, save_model  # noqa: E402

# Shorter than, equal to and longer than the prefix (8); one prompt twice, side by side.
PROMPTS = [[37], [70, 101, 44], [12, 250, 7, 99, 180, 33, 5, 61], [9, 140, 77, 3, 201, 56, 88, 19, 230, 41, 162, 28, 95],
           [70, 101, 44]]
MAX_NEW_TOKENS = 10


@pytest.mark.slow  # an engine start with a compile (about 20 s each)
@pytest.mark.parametrize("kind", ["jrt-pad", "based-decay"])
def test_compiled_engine_equals_generate(kind, tmp_path, byte_bpe_tokenizer):
    model = save_model(kind, tmp_path, byte_bpe_tokenizer)
    compiled_before = compilation_counter.num_models_seen
    llm = vllm.LLM(model=str(tmp_path), dtype="float32", max_model_len=128, seed=0)
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
        assert compilation_counter.num_models_seen == compiled_before + 1  # the backbone, compiled
        params = vllm.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        # twice: the prefill of a mixed batch and its decode steps, then single prompts (other batch sizes through
        # the one traced graph)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in PROMPTS[:2]]
    finally:
        del llm
        gc.collect()
    expected = [greedy_reference(model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert [list(o.outputs[0].token_ids) for o in alone] == expected[:2]
