"""jrt_vllm on vLLM's CPU engine (in this process) against `generate()` and `forward()` of the same folder."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.overrides import TorchFunctionMode

from vllm_models import MODEL_KINDS, greedy, greedy_reference, save_model

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")

from modeling_jrt.prefix_fill import never_generated_ids  # noqa: E402

MAX_NEW_TOKENS = 8
# Prompt lengths around the tiny models' prefix_length = 8 and sliding_window = 5: a single token, shorter than the
# prefix, exactly the prefix, longer than prefix and window.
PROMPTS = [
    [37],
    [70, 101, 44],
    [12, 250, 7, 99, 180, 33, 5, 61],
    [9, 140, 77, 3, 201, 56, 88, 19, 230, 41, 162, 28, 95],
]


@pytest.fixture(scope="module", params=list(MODEL_KINDS))
def engine(request, tmp_path_factory, byte_bpe_tokenizer):
    """(kind, the transformers model, a vLLM engine serving its folder); one engine at a time."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    model = save_model(kind, path, byte_bpe_tokenizer)
    llm = vllm.LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    yield kind, model, llm
    del llm
    gc.collect()


def test_engine_settings(engine):
    """Prefix caching is off for both families; chunked prefill is off for JRT-RNN (its encoder reads in one
    forward)."""
    kind, model, llm = engine
    vllm_config = llm.llm_engine.vllm_config
    assert not vllm_config.cache_config.enable_prefix_caching
    if model.config.linear_attention_type == "prefix":
        assert not vllm_config.scheduler_config.enable_chunked_prefill


def test_mixers_split_the_compiled_graph(engine):
    """The mixers' op is one of vLLM's splitting ops, matched by vLLM's own rule on a traced call of it: vLLM compiles
    the dense parts between the mixers as pieces (on a GPU), as around its own mixers."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.compilation.partition_rules import should_split

    from jrt_vllm.mixers import MIX_OP

    kind, model, llm = engine
    splitting_ops = llm.llm_engine.vllm_config.compilation_config.splitting_ops
    assert MIX_OP in splitting_ops

    def call_mixer(hidden_states, output):
        torch.ops.jrt_vllm.mix(hidden_states, output, "model.layers.0.mixer")
        return output

    graph = make_fx(call_mixer, tracing_mode="fake")(torch.zeros(3, 4), torch.zeros(3, 4)).graph
    split = [node for node in graph.nodes if should_split(node, splitting_ops)]
    assert [str(node.target) for node in split] == ["jrt_vllm.mix.default"]


def test_greedy_batch_of_mixed_lengths_equals_generate(engine):
    """One batch of prompts shorter than, equal to and longer than the prefix: each gives `generate()`'s tokens for
    that prompt alone."""
    kind, model, llm = engine
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(MAX_NEW_TOKENS), use_tqdm=False)
    actual = [list(o.outputs[0].token_ids) for o in outputs]
    expected = [greedy_reference(model, p, MAX_NEW_TOKENS) for p in PROMPTS]
    assert actual == expected
    suppressed = set(never_generated_ids(model.config))
    assert not suppressed & {token for tokens in actual for token in tokens}
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS), "the tiny model must not be degenerate"


def test_prompts_of_one_shape_are_prefilled_in_one_batch(engine, monkeypatch):
    """The prompts of a prefill that expand to the same rows (the same length; with the "pad" or "repeat" fill, every
    prompt shorter than the prefix) are read by each mixer in one call, as the rows of one batch; each still gives
    `generate()`'s tokens for that prompt alone, beside prompts of other shapes."""
    import jrt_vllm.mixers

    kind, model, llm = engine
    # Lengths 3, 5, 3, 13, 1, 8, 13, 2, 2: prompts of one shape apart in the batch (their rows gathered) and side by
    # side (a view of the rows).
    prompts = [[70, 101, 44], [12, 250, 7, 99, 180], [5, 61, 9], PROMPTS[3], [37], PROMPTS[2],
               [3, 201, 56, 88, 19, 230, 41, 162, 28, 95, 9, 140, 77], [8, 90], [66, 4]]
    batches = []
    read = jrt_vllm.mixers.JRTLinearAttention.read

    def recording(self, projected, hidden_states, slots, group):
        if slots is not None and self.layer_idx == model.config.mixer_types.index("linear_attention"):
            batches.append(sorted(group.requests))
        return read(self, projected, hidden_states, slots, group)

    monkeypatch.setattr(jrt_vllm.mixers.JRTLinearAttention, "read", recording)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, 4)
    # vLLM's batch order is the order of the requests here (one prefill forward). Without a fill the groups are the
    # lengths; the "pad" and "repeat" fills make every prompt of 1 to 8 tokens 8 rows, all read by the encoder.
    filled = kind in ("jrt-pad", "jrt-repeat")
    expected = [[0, 1, 2, 4, 5, 7, 8], [3, 6]] if filled else [[0, 2], [1], [3, 6], [4], [5], [7, 8]]
    assert batches == expected


def test_greedy_one_prompt_at_a_time_equals_generate(engine):
    """Each prompt alone (the first forward of every request is a whole prompt, the rest are O(1) steps)."""
    kind, model, llm = engine
    for prompt in (PROMPTS[1], PROMPTS[3]):
        output = llm.generate([{"prompt_token_ids": prompt}], greedy(MAX_NEW_TOKENS), use_tqdm=False)[0]
        assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, MAX_NEW_TOKENS)


class Stepper:
    """Drives vLLM's engine one step at a time, keeping the tokens of each finished request by its id."""

    def __init__(self, llm):
        self.core = llm.llm_engine
        self.results: dict[str, list[int]] = {}

    def __call__(self) -> None:
        for output in self.core.step():
            if output.finished:
                self.results[output.request_id] = list(output.outputs[0].token_ids)

    def finish(self) -> dict[str, list[int]]:
        while self.core.has_unfinished_requests():
            self()
        return self.results


def test_fused_decode_kernel_in_the_engine_equals_generate(engine, monkeypatch):
    """The GPU decode path (`jrt_kernels.linear_attention_decode_triton`, each state updated at its slot) wired into
    the engine: the plugin's step asks for it by name on the CPU pool, where triton's interpreter runs it
    (tests/conftest.py), and a batch of requests decodes exactly what `generate()` does (decay and gate included
    for Based)."""
    pytest.importorskip("triton")
    import jrt_vllm.mixers

    rows = []
    step_at_slots = jrt_vllm.mixers.linear_attention_step_at_slots

    def forced(*args, **kwargs):
        rows.append(args[4].numel())  # the decoding rows' slots
        return step_at_slots(*args, **{**kwargs, "implementation": "triton"})

    monkeypatch.setattr(jrt_vllm.mixers, "linear_attention_step_at_slots", forced)
    kind, model, llm = engine
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(4), use_tqdm=False)
    assert rows and max(rows) > 1  # several requests decoded in one launch
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, 4)


# Tensor calls that a CUDA graph cannot hold: reading a tensor's values on the host (a sync at capture, frozen at
# replay) and making a tensor from Python data (a copy from host memory).
HOST_READS = {"tolist", "item", "numpy", "tensor", "as_tensor", "__bool__", "__int__", "__float__", "__index__"}


class HostReads(TorchFunctionMode):
    """Adds to `found` the name of every host-read call (`HOST_READS`) made under it."""

    def __init__(self, found: set[str]):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.found.add(name)
        return func(*args, **(kwargs or {}))


def test_decode_steps_read_nothing_on_the_host(engine, monkeypatch):
    """A forward of decode steps only plans nothing: the model and every mixer (inside its opaque op) run without a
    host read (no sync per step on a GPU; what a CUDA-graph capture needs). A forward with prompts plans them on the
    host, which the recorder sees. The tokens are `generate()`'s."""
    import jrt_vllm.mixers
    import jrt_vllm.model
    from jrt_vllm.batch_plan import forward_metadata, is_decode_only

    kind, model, llm = engine
    forwards: list[tuple[bool, set[str]]] = []  # (decode-only, host reads), forward by forward
    model_forward, layer_mix = jrt_vllm.model.JRTRNNForCausalLM.forward, jrt_vllm.mixers.JRTStateLayer.mix

    def recorded_forward(self, *args, **kwargs):
        metadata = forward_metadata()
        forwards.append((metadata is not None and is_decode_only(metadata), set()))
        with HostReads(forwards[-1][1]):
            return model_forward(self, *args, **kwargs)

    def recorded_mix(self, hidden_states, output):  # the op's body: the outer recorder is off inside the op
        with HostReads(forwards[-1][1]):
            return layer_mix(self, hidden_states, output)

    monkeypatch.setattr(jrt_vllm.model.JRTRNNForCausalLM, "forward", recorded_forward)
    monkeypatch.setattr(jrt_vllm.mixers.JRTStateLayer, "mix", recorded_mix)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(MAX_NEW_TOKENS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [
        greedy_reference(model, p, MAX_NEW_TOKENS) for p in PROMPTS
    ]
    assert [decode_only for decode_only, _ in forwards] == [False] + [True] * (MAX_NEW_TOKENS - 1)
    assert "tolist" in forwards[0][1]  # the prefill's plan
    assert [found for _, found in forwards[1:]] == [set()] * (MAX_NEW_TOKENS - 1)


def test_forwards_with_prompts_run_without_cuda_graphs(engine, monkeypatch):
    """vLLM replays its piecewise CUDA graphs by its own padded token count. On a GPU its runner puts PIECEWISE in the
    forward context of each forward it sized to a graph (here the test does, around the model's forward). A forward
    with prompts reads rows of its own (the fill, no padding), so its backbone must run under NONE; a decode-only
    forward keeps the graphs; the context is as the runner set it after each forward. Prompts join mid-stream (mixed
    forwards), and the tokens are `generate()`'s."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    import jrt_vllm.mixers
    import jrt_vllm.model
    from jrt_vllm.batch_plan import forward_metadata, is_decode_only

    kind, model, llm = engine
    forwards = []  # per forward: [decode-only, the modes its mixers ran under, the mode after it]
    model_forward, layer_mix = jrt_vllm.model.JRTRNNForCausalLM.forward, jrt_vllm.mixers.JRTStateLayer.mix

    def as_a_graph_runner(self, *args, **kwargs):
        context = get_forward_context()
        forwards.append([is_decode_only(forward_metadata()), set(), None])
        context.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
        try:
            return model_forward(self, *args, **kwargs)
        finally:
            forwards[-1][2], context.cudagraph_runtime_mode = context.cudagraph_runtime_mode, CUDAGraphMode.NONE

    def recorded_mix(self, hidden_states, output):
        forwards[-1][1].add(get_forward_context().cudagraph_runtime_mode)
        return layer_mix(self, hidden_states, output)

    monkeypatch.setattr(jrt_vllm.model.JRTRNNForCausalLM, "forward", as_a_graph_runner)
    monkeypatch.setattr(jrt_vllm.mixers.JRTStateLayer, "mix", recorded_mix)
    core, params, step = llm.llm_engine, greedy(6), Stepper(llm)
    core.add_request("first", {"prompt_token_ids": PROMPTS[3]}, params)
    step()
    step()
    core.add_request("second", {"prompt_token_ids": PROMPTS[0]}, params)
    assert step.finish() == {name: greedy_reference(model, PROMPTS[i], 6) for name, i in (("first", 3), ("second", 0))}
    assert [decode_only for decode_only, _, _ in forwards] == [False, True, False] + [True] * 5
    for decode_only, modes, after in forwards:
        assert modes == {CUDAGraphMode.PIECEWISE if decode_only else CUDAGraphMode.NONE}
        assert after == CUDAGraphMode.PIECEWISE


def test_request_added_mid_stream_equals_generate(engine):
    """Continuous batching: requests join while others decode (their prefill shares forwards with decode steps)."""
    kind, model, llm = engine
    core = llm.llm_engine
    params = greedy(12)
    step = Stepper(llm)
    core.add_request("first", {"prompt_token_ids": PROMPTS[3]}, params)
    for _ in range(3):
        step()
    core.add_request("second", {"prompt_token_ids": PROMPTS[1]}, params)
    step()
    core.add_request("third", {"prompt_token_ids": PROMPTS[0]}, params)
    assert step.finish() == {
        "first": greedy_reference(model, PROMPTS[3], 12),
        "second": greedy_reference(model, PROMPTS[1], 12),
        "third": greedy_reference(model, PROMPTS[0], 12),
    }


def forward_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """`(L - 1,)` log p(prompt[t] | prompt[:t]) from `forward()` of the prompt (which fills a short prompt's JRT prefix
    itself), over the ids that can be generated."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()  # (L, vocab): the caller's positions
    logits[:, never_generated_ids(model.config)] = float("-inf")  # jrt_vllm masks them in the logits
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]  # (L - 1, vocab): the prediction of each next token
    return logprobs.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize("prompt_index", [1, 3], ids=["shorter-than-prefix", "longer-than-prefix"])
def test_prompt_logprobs_equal_forward(engine, prompt_index):
    """`prompt_logprobs` are the log-softmax of `forward()`'s logits (fp32 tolerance)."""
    kind, model, llm = engine
    prompt = PROMPTS[prompt_index]
    output = llm.generate([{"prompt_token_ids": prompt}], greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    assert output.prompt_logprobs[0] is None
    actual = torch.tensor(
        [position[token].logprob for position, token in zip(output.prompt_logprobs[1:], prompt[1:])],
        dtype=torch.float64,
    )
    torch.testing.assert_close(actual, forward_logprobs(model, prompt), rtol=0, atol=2e-4)


LONG_PROMPT = [(7 * i + 3) % 290 + 5 for i in range(41)]


@pytest.mark.parametrize("kind", ["based-decay", "jrt-pad"])
def test_chunked_prefill_and_prefix_caching_requested(kind, tmp_path, byte_bpe_tokenizer):
    """Chunked prefill and prefix caching asked for, with a 16-token budget per forward and prompts that share their
    first 20 tokens. Based reads a 41-token prompt in chunks (states carried between them); JRT-RNN turns chunked
    prefill off and reads it whole; prefix caching is turned off. Every prompt gives `generate()`'s tokens."""
    model = save_model(kind, tmp_path, byte_bpe_tokenizer)
    llm = vllm.LLM(
        model=str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True,
    )
    try:
        assert not llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        scheduler_config = llm.llm_engine.vllm_config.scheduler_config
        if kind == "jrt-pad":
            assert not scheduler_config.enable_chunked_prefill
            assert scheduler_config.max_num_batched_tokens == 64  # raised to max_model_len: whole prompts fit
        else:
            assert scheduler_config.enable_chunked_prefill and scheduler_config.max_num_batched_tokens == 16
        prompts = [LONG_PROMPT, PROMPTS[1], LONG_PROMPT[:20] + PROMPTS[3]]
        for batch in (prompts[:2], prompts[2:]):  # the shared prefix is read first, then again in a later request
            outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(MAX_NEW_TOKENS), use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == [
                greedy_reference(model, p, MAX_NEW_TOKENS) for p in batch
            ]
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("steps_before", [1, 3], ids=["after-first-token", "mid-generation"])
def test_preempted_requests_equal_generate(engine, steps_before):
    """Preemption: `reset_prefix_cache(reset_running_requests=True)` preempts every running request, which vLLM then
    recomputes from its prompt and the tokens it generated. The encoder reads the original prompt's prefix again (the
    generated tokens causally), so every request gives what it gives without preemption."""
    kind, model, llm = engine
    params = greedy(10)
    step = Stepper(llm)
    for index, prompt in enumerate(PROMPTS):
        llm.llm_engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, params)
    for _ in range(steps_before):
        step()
    assert llm.reset_prefix_cache(reset_running_requests=True)
    assert step.finish() == {f"r{index}": greedy_reference(model, prompt, 10) for index, prompt in enumerate(PROMPTS)}
