"""transformers' compiled decode path: `generate(cache_implementation="static")`, or a `JRTRNNCache` passed in, runs the
decode step through `torch.compile` (on a GPU by itself; here on CPU with a compile config that allows every device,
as transformers' own tests do). The tokens equal the eager ones, and dynamo compiles the step once across decode
steps, padded and unpadded batches, per-row prompt lengths and prefix fills, greedy and sampling, and a second call
with another prompt length; beam search reorders the cache in place without a recompile."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import CompileConfig

from modeling_jrt import JRTRNNCache, JRTRNNForCausalLM
from modeling_jrt.compat import CACHE_FIELD, output_cache

KINDS = {
    "jrt-prefix": dict(linear_attention_type="prefix"),
    "based-causal": dict(linear_attention_type="causal"),
    "based-decay": dict(linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True),
}
NO_EOS = dict(eos_token_id=None, pad_token_id=0)


class CountingBackend:
    """A dynamo backend that counts the graphs it is handed and runs them as traced (no code generation)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs, **options):
        self.graphs += 1
        return graph_module.forward

    def __deepcopy__(self, memo):  # generate() deep-copies its generation config, and the compile config in it
        return self


def compile_config(backend: CountingBackend) -> CompileConfig:
    config = CompileConfig(backend=backend, fullgraph=True)
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise (as in its tests)
    return config


def build(make_config, **overrides) -> JRTRNNForCausalLM:
    torch.manual_seed(0)
    overrides.setdefault("initializer_range", 0.3)
    return JRTRNNForCausalLM(make_config(**overrides)).eval()


def left_padded(lengths: list[int], width: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
        ids[row, : width - length] = 0
    return ids, mask


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_static_cache_compiles_the_decode_step_once_and_matches_eager(make_config, kind):
    model = build(make_config, **kind)
    backend = CountingBackend()
    compiled = dict(cache_implementation="static", compile_config=compile_config(backend))
    calls = [  # (inputs, generate() keywords): all with batch 2
        (left_padded([3, 12], 12), dict(do_sample=False)),  # padding; one prompt shorter than the prefix (a fill)
        (left_padded([12, 12], 12, seed=2), dict(do_sample=False)),  # no padding (generate() drops the mask)
        (left_padded([5, 20], 20, seed=3), dict(do_sample=False, prompt_lengths=torch.tensor([3, 11]))),
        (left_padded([6, 9], 9, seed=4), dict(do_sample=True, top_k=5)),  # sampling
        (left_padded([2, 2], 2, seed=5), dict(do_sample=False, prefix_strategy="repeat")),
    ]
    for call, ((input_ids, mask), kwargs) in enumerate(calls):
        new_tokens = 6 if call % 2 else 3  # and another number of new tokens
        torch.manual_seed(7)
        eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, **NO_EOS, **kwargs)
        torch.manual_seed(7)
        fast = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, **NO_EOS, **kwargs,
                              **compiled)
        torch.testing.assert_close(fast, eager, rtol=0, atol=0)
    assert backend.graphs == 1


def test_a_cache_passed_in_takes_the_compiled_path_and_the_default_stays_eager(make_config):
    model = build(make_config)
    input_ids, mask = left_padded([4, 10], 10)
    backend = CountingBackend()
    config = compile_config(backend)
    eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **NO_EOS)
    default = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, compile_config=config,
                             **NO_EOS)
    assert backend.graphs == 0  # transformers' default DynamicCache: eager, as for every model
    cache = JRTRNNCache(model.config)
    passed = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False, compile_config=config,
                            **{CACHE_FIELD: cache}, **NO_EOS)  # the cache's name on this transformers release
    assert backend.graphs == 1
    torch.testing.assert_close(default, eager, rtol=0, atol=0)
    torch.testing.assert_close(passed, eager, rtol=0, atol=0)
    # The cache was filled in place: it continues the sequence like the eager cache does.
    assert cache.get_seq_length() == passed.shape[1] - 1


def test_disable_compile_turns_the_compiled_path_off(make_config):
    model = build(make_config)
    input_ids, mask = left_padded([4, 10], 10)
    backend = CountingBackend()
    model.generate(input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
                   compile_config=compile_config(backend), disable_compile=True, **NO_EOS)
    assert backend.graphs == 0


def test_beam_search_reorders_the_cache_in_place_without_a_recompile(make_config):
    """transformers compiles no beam search (its `_sample` loop only): with the static cache it runs eagerly and
    gives the eager beams. A compiled decode step serves every reordering of the rows (`reorder_cache` copies the
    rows in place), as beam search would ask of it."""
    model = build(make_config)
    input_ids, mask = left_padded([4, 10], 10)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, do_sample=False, **NO_EOS)
    torch.testing.assert_close(
        model.generate(input_ids, cache_implementation="static", **kwargs), model.generate(input_ids, **kwargs),
        rtol=0, atol=0,
    )
    backend = CountingBackend()
    step = torch.compile(model, backend=backend, fullgraph=True)
    eager_cache = output_cache(model(input_ids, attention_mask=mask, use_cache=True))
    compiled_cache = output_cache(model(input_ids, attention_mask=mask, use_cache=True))
    token = input_ids[:, -1:].contiguous()
    for order in ([1, 0], [0, 0], [1, 1], [1, 0]):
        eager_cache.reorder_cache(torch.tensor(order))
        compiled_cache.reorder_cache(torch.tensor(order))
        expected = model(token, cache=eager_cache).logits
        torch.testing.assert_close(step(token, cache=compiled_cache).logits, expected, rtol=1e-5, atol=1e-5)
        token = expected[:, -1:].argmax(-1)
    assert backend.graphs == 1


def test_the_cache_keeps_its_buffers_through_decoding(make_config):
    """Fixed shapes and addresses: what a CUDA graph captured in the first step is what every later step reads."""
    model = build(make_config)
    input_ids, mask = left_padded([3, 9], 9)
    cache = output_cache(model(input_ids, attention_mask=mask, use_cache=True))
    buffers = [tensor for layer in cache.layers for tensor in layer.tensors()] + [cache.positions]
    before = [(tensor.data_ptr(), tuple(tensor.shape)) for tensor in buffers]
    config = model.config
    assert cache.layers[0].inputs.shape == (2, config.conv_expansion * config.hidden_size, config.conv_kernel_size - 1)
    assert cache.layers[2].keys.shape == (2, config.num_attention_heads, config.sliding_window - 1, config.head_dim)
    assert cache.layers[2].key_mask.shape == (2, config.sliding_window - 1)
    token = input_ids[:, -1:]
    for _ in range(config.sliding_window + 2):  # past a full turn of the ring
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    assert [(tensor.data_ptr(), tuple(tensor.shape)) for tensor in buffers] == before
    cache.reorder_cache(torch.tensor([1, 0]))
    assert [(tensor.data_ptr(), tuple(tensor.shape)) for tensor in buffers] == before


@pytest.mark.slow
def test_transformers_default_compile_config_builds_the_step(make_config):
    """The compile config a GPU user gets (inductor, `mode="reduce-overhead"`: CUDA graphs there, skipped on CPU)
    builds the decode step in one graph and decodes the eager tokens (Based with decay: the gate and the decay)."""
    model = build(make_config, linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True)
    input_ids, mask = left_padded([3, 10], 10)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, **NO_EOS)
    fast = model.generate(input_ids, cache_implementation="static", compile_config=config, **kwargs)
    torch.testing.assert_close(fast, model.generate(input_ids, **kwargs), rtol=0, atol=0)


# ------------------------------------------------------------------------- transformers' generation contract

DICT_OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, output_hidden_states=True)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(num_beams=2, do_sample=False)], ids=["greedy", "beam"])
def test_dict_outputs_with_and_without_the_cache(make_config, kind, mode):
    """`return_dict_in_generate` with scores, logits and hidden states: the same tokens and scores with and without
    the cache, a cache returned with it, and none without it (Based). A JRT-RNN model returns its first forward's
    cache under `use_cache=False` too: it carries each row's prompt boundary between the recomputes
    (docs/generate.md, "use_cache=False")."""
    model = build(make_config, **kind)
    input_ids, mask = left_padded([3, 6], 6)
    cached = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, **mode, **NO_EOS, **DICT_OUTPUTS)
    uncached = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, use_cache=False, **mode, **NO_EOS,
                              **DICT_OUTPUTS)
    torch.testing.assert_close(uncached.sequences, cached.sequences, rtol=0, atol=0)
    assert len(cached.scores) == len(uncached.scores) == len(cached.logits) == len(cached.hidden_states) == 4
    for with_cache, without in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(without, with_cache, rtol=1e-5, atol=1e-5)
    # hidden states: the first step covers the prompt (embeddings + one per layer), later steps the new token only
    assert len(cached.hidden_states[0]) == model.config.num_hidden_layers + 1
    assert cached.hidden_states[0][0].shape[1] == 6 and cached.hidden_states[1][0].shape[1] == 1
    assert isinstance(output_cache(cached), JRTRNNCache)
    if model.config.is_prefix_model:
        assert isinstance(output_cache(uncached), JRTRNNCache) and output_cache(uncached).prefix is not None
        # ... unless the call states each row's prompt: then nothing needs carrying, and no cache comes back
        stated = model.generate(input_ids, attention_mask=mask, max_new_tokens=4, use_cache=False, **mode, **NO_EOS,
                                prompt_lengths=mask.sum(-1),  # (B,): generate() expands it for the beams
                                **DICT_OUTPUTS)
        assert output_cache(stated) is None
        torch.testing.assert_close(stated.sequences, cached.sequences, rtol=0, atol=0)
    else:
        assert output_cache(uncached) is None


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_compiled_generation_returns_all_outputs(make_config, kind):
    """The compiled decode step (static cache) returns what the eager one returns: scores, logits, hidden states and
    attention weights (eager attention), step by step, and the same cache contents."""
    model = build(make_config, attn_implementation="eager", **kind)
    input_ids, mask = left_padded([3, 7], 7)
    backend = CountingBackend()
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_attentions=True, **NO_EOS,
                    **DICT_OUTPUTS)
    eager = model.generate(input_ids, **settings)
    fast = model.generate(input_ids, cache_implementation="static", compile_config=compile_config(backend), **settings)
    assert backend.graphs == 1
    torch.testing.assert_close(fast.sequences, eager.sequences, rtol=0, atol=0)
    for name in ("scores", "logits", "hidden_states", "attentions"):
        expected, actual = getattr(eager, name), getattr(fast, name)
        assert len(actual) == len(expected) == 4, name
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=name)
    for expected, actual in zip(output_cache(eager).layers, output_cache(fast).layers):
        torch.testing.assert_close(actual.tensors(), expected.tensors(), rtol=1e-5, atol=1e-5)
