"""The plugin's model compiled as vLLM compiles by default (no `enforce_eager`): on vLLM's CPU backend, dynamo traces
the backbone once around the mixers' opaque `jrt_vllm::mix` ops and inductor builds it. Greedy outputs equal
`generate()`'s, as in the eager engine (test_engine.py)."""

from __future__ import annotations

import gc

import pytest

vllm = pytest.importorskip("vllm")

from vllm.compilation.counter import compilation_counter  # noqa: E402
from vllm.config import CompilationMode  # noqa: E402
from vllm_models import greedy, greedy_reference, save_model  # noqa: E402

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
        params = greedy(MAX_NEW_TOKENS)
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


@pytest.mark.slow  # an engine start with a compile (about 20 s)
def test_a_fill_past_the_compiled_rows_runs_uncompiled(tmp_path, byte_bpe_tokenizer, monkeypatch):
    """vLLM compiles the backbone for at most `max_num_batched_tokens` rows (on a GPU a larger input fails its range
    check), and the JRT fill may pass them: four short prompts (11 tokens, within the budget of 16) are 32 rows with
    their fills. That forward runs the backbone uncompiled (the forward context's `skip_compiled`); one short prompt
    (8 rows) and the decode steps run compiled; the tokens are `generate()`'s."""
    from vllm.forward_context import get_forward_context

    import jrt_vllm.mixers

    model = save_model("jrt-pad", tmp_path, byte_bpe_tokenizer)
    uncompiled = []  # per mixer call: the forward context's skip_compiled
    layer_mix = jrt_vllm.mixers.JRTStateLayer.mix

    def recorded_mix(self, hidden_states, output):
        uncompiled.append((hidden_states.shape[0], get_forward_context().skip_compiled))
        return layer_mix(self, hidden_states, output)

    monkeypatch.setattr(jrt_vllm.mixers.JRTStateLayer, "mix", recorded_mix)
    llm = vllm.LLM(model=str(tmp_path), dtype="float32", max_model_len=16, max_num_batched_tokens=16, max_num_seqs=4,
                   seed=0)
    prompts = [[37], [70, 101, 44], [12, 250, 7, 99, 180], [5, 61]]
    try:
        uncompiled.clear()  # the engine's profiling and warm-up runs
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4), use_tqdm=False)
        alone = llm.generate([{"prompt_token_ids": prompts[1]}], greedy(4), use_tqdm=False)[0]
    finally:
        del llm
        gc.collect()
    assert [list(o.outputs[0].token_ids) for o in outputs] == [greedy_reference(model, p, 4) for p in prompts]
    assert list(alone.outputs[0].token_ids) == greedy_reference(model, prompts[1], 4)
    layers = model.config.num_hidden_layers
    assert uncompiled == ([(32, True)] * layers + [(4, False)] * (3 * layers)
                          + [(8, False)] * layers + [(1, False)] * (3 * layers))
