"""Tensor parallelism on vLLM's CPU backend: two ranks, each with half of every mixer's heads or channels (and of its
state) and half of the MLP, give the tokens of one rank and of `generate()`."""

from __future__ import annotations

import gc

import pytest

from vllm_models import greedy, greedy_reference, save_model

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")

# Shorter than, equal to and longer than the tiny models' prefix_length = 8 and sliding_window = 5.
PROMPTS = [[70, 101, 44], [12, 250, 7, 99, 180, 33, 5, 61], [9, 140, 77, 3, 201, 56, 88, 19, 230, 41, 162, 28, 95]]
MAX_NEW_TOKENS = 6


def greedy_tokens(path, tensor_parallel_size: int, monkeypatch: pytest.MonkeyPatch, compiled: bool = False
                  ) -> list[list[int]]:
    # vLLM binds each CPU rank to a NUMA node of its own; a machine with one node lets the ranks share the cores.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind" if tensor_parallel_size > 1 else "auto")
    llm = vllm.LLM(
        model=str(path), dtype="float32", enforce_eager=not compiled, max_model_len=64, seed=0,
        tensor_parallel_size=tensor_parallel_size,
        distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
    )
    try:
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == tensor_parallel_size
        params = greedy(MAX_NEW_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]
    finally:
        del llm
        gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jrt-pad", "based-decay"])
def test_two_ranks_give_the_tokens_of_one(kind, tmp_path, byte_bpe_tokenizer, monkeypatch):
    model = save_model(kind, tmp_path, byte_bpe_tokenizer)
    expected = [greedy_reference(model, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    assert greedy_tokens(tmp_path, 2, monkeypatch) == expected
    assert greedy_tokens(tmp_path, 1, monkeypatch) == expected


@pytest.mark.slow
def test_two_compiled_ranks_give_the_tokens_of_generate(tmp_path, byte_bpe_tokenizer, monkeypatch):
    """As vLLM runs by default (compiled: each rank traces its backbone around the mixers' ops; the MLP's row-parallel
    sum inside the graph, the mixers' inside their ops)."""
    model = save_model("jrt-pad", tmp_path, byte_bpe_tokenizer)
    expected = [greedy_reference(model, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    assert greedy_tokens(tmp_path, 2, monkeypatch, compiled=True) == expected
