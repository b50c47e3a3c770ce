"""Generation: prefill + O(1) decode vs the parallel forward, generate() against hand-built equivalents, the JRT prefix
strategies, cache continuation and memory, the vocabulary mask and transformers integrations (pipeline, streamers)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    pipeline,
)

from transformers.generation import BaseStreamer, GenerationMixin

from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt.compat import CACHE_FIELD, output_cache
from modeling_jrt import JRTRNNCache


# The tiny config of conftest: prefix_length 8, sliding_window 5, vocab 99, pad 0, eos 2, prefix pad 3.
PREFIX = 8
KINDS = {
    "jrt-prefix": dict(linear_attention_type="prefix"),
    "based-causal": dict(linear_attention_type="causal"),
    "based-decay": dict(linear_attention_type="causal", linear_attention_decay=True, use_decay_proj=True),
}
NO_EOS = dict(eos_token_id=None, pad_token_id=0)  # fixed-length generations


def build(make_config, **overrides) -> JRTRNNForCausalLM:
    """A tiny model with large enough weights that the logits (and argmaxes) differ between inputs."""
    torch.manual_seed(0)
    overrides.setdefault("initializer_range", 0.3)
    return JRTRNNForCausalLM(make_config(**overrides)).eval()


def prompt(length: int, batch: int = 1, seed: int = 1) -> torch.LongTensor:
    return torch.randint(4, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def argmax_loop(model, input_ids, steps, **forward_kwargs) -> torch.LongTensor:
    """Greedy decoding by full-sequence forwards without a cache; returns the generated tokens."""
    sequence = input_ids
    for _ in range(steps):
        logits = model(sequence, use_cache=False, **forward_kwargs).logits[:, -1]
        sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
        if "linear_attention_mask" in forward_kwargs:
            mask = forward_kwargs["linear_attention_mask"]
            forward_kwargs["linear_attention_mask"] = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return sequence[:, input_ids.shape[1] :]


def greedy(model, input_ids, steps, **kwargs):
    return model.generate(input_ids, max_new_tokens=steps, do_sample=False, **NO_EOS, **kwargs)


# ----------------------------------------------------------------------------------------------- decode == parallel


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("prompt_length", [3, PREFIX, 13])
def test_prefill_then_decode_equals_parallel_forward(make_config, kind, prompt_length):
    """Across the prefix boundary (prompt shorter, equal, longer) and the sliding window (5): every position."""
    model = build(make_config, **kind)
    input_ids = prompt(22, batch=2)
    # The prefill's encoder reads the prompt (filled to the prefix when shorter): the same prompt in the full forward.
    full = model(input_ids, prompt_lengths=torch.full((2,), prompt_length)).logits
    cache = JRTRNNCache(model.config)
    pieces = [model(input_ids[:, :prompt_length], cache=cache).logits]
    # A multi-token forward continuing from the state, then single-token steps.
    pieces.append(model(input_ids[:, prompt_length : prompt_length + 3], cache=cache).logits)
    for position in range(prompt_length + 3, 22):
        pieces.append(model(input_ids[:, position : position + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------- generate vs hand-built loops


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_greedy_generate_equals_argmax_loop(make_config, kind):
    model = build(make_config, **kind)
    long_prompt = prompt(11)
    expected = argmax_loop(model, long_prompt, 12)
    assert len(set(expected[0].tolist())) > 2  # the tiny model does not collapse onto one token
    torch.testing.assert_close(greedy(model, long_prompt, 12)[:, 11:], expected, rtol=0, atol=0)
    # A short prompt as it is: the encoder reads the prompt only, never generated tokens.
    short = prompt(4)
    expected = argmax_loop(model, short, 12, prefix_length=4)
    torch.testing.assert_close(greedy(model, short, 12, prefix_strategy="none")[:, 4:], expected, rtol=0, atol=0)
    no_cache = greedy(model, short, 12, prefix_strategy="none", use_cache=False)[:, 4:]
    torch.testing.assert_close(no_cache, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize(
    "mode",
    [
        dict(do_sample=False),
        dict(do_sample=True, top_k=0, temperature=1.5, num_return_sequences=2),
        dict(do_sample=False, num_beams=3, num_return_sequences=2),
    ],
    ids=["greedy", "sample", "beam"],
)
def test_cache_and_no_cache_give_the_same_tokens(make_config, kind, mode):
    model = build(make_config, **kind)
    input_ids = prompt(4, batch=2)  # shorter than the prefix: the default "pad" strategy applies
    outputs = []
    for use_cache in (True, False):
        torch.manual_seed(3)
        outputs.append(model.generate(input_ids, max_new_tokens=8, use_cache=use_cache, **NO_EOS, **mode))
    assert outputs[0].shape == (2 * mode.get("num_return_sequences", 1), 12)
    torch.testing.assert_close(outputs[0][:, :4], input_ids.repeat_interleave(mode.get("num_return_sequences", 1), 0))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("strategy", ["pad", "repeat", "none"])
def test_left_padded_batch_equals_one_by_one(make_config, kind, strategy):
    model = build(make_config, **kind)
    prompts = [prompt(3, seed=1), prompt(6, seed=2), prompt(11, seed=3)]
    batch = torch.zeros(3, 11, dtype=torch.long)
    mask = torch.zeros(3, 11, dtype=torch.long)
    for row, ids in enumerate(prompts):
        batch[row, 11 - ids.shape[1] :], mask[row, 11 - ids.shape[1] :] = ids[0], 1
    settings = dict(max_new_tokens=7, do_sample=False, return_dict_in_generate=True, output_scores=True,
                    prefix_strategy=strategy, **NO_EOS)
    batched = model.generate(batch, attention_mask=mask, **settings)
    torch.testing.assert_close(batched.sequences[:, :11], batch)
    for row, ids in enumerate(prompts):
        alone = model.generate(ids, **settings)
        torch.testing.assert_close(batched.sequences[row, 11:], alone.sequences[0, ids.shape[1] :], rtol=0, atol=0)
        for batched_scores, alone_scores in zip(batched.scores, alone.scores):
            torch.testing.assert_close(batched_scores[row], alone_scores[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_static_cache_equals_dynamic_cache(make_config, kind):
    model = build(make_config, **kind)
    input_ids = prompt(5, batch=2)
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0
    settings = dict(max_new_tokens=9, do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    dynamic = model.generate(input_ids, attention_mask=mask, **settings)
    static = model.generate(input_ids, attention_mask=mask, cache_implementation="static", **settings)
    torch.testing.assert_close(static.sequences, dynamic.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(dynamic.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("prompt_length", [3, 10])
def test_continuation_from_returned_cache_equals_one_shot(make_config, kind, prompt_length):
    assert_continuation_equals_one_shot(build(make_config, **kind), prompt(prompt_length, batch=2), 4, 6)


def assert_continuation_equals_one_shot(model, input_ids, first_tokens, more_tokens):
    """Greedy generation of first_tokens, continued from the returned cache for more_tokens: the same tokens and
    scores as one call for all of them."""
    settings = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    # The model's cache under the installed release's own name: a model without attention layers needs it passed
    # on transformers < 5.24 (transformers' default cache cannot count tokens there).
    fresh = lambda: {CACHE_FIELD: JRTRNNCache(model.config)}  # noqa: E731
    one_shot = model.generate(input_ids, max_new_tokens=first_tokens + more_tokens, **fresh(), **settings)
    first = model.generate(input_ids, max_new_tokens=first_tokens, **fresh(), **settings)
    second = model.generate(first.sequences, **{CACHE_FIELD: output_cache(first)}, max_new_tokens=more_tokens,
                            **settings)
    torch.testing.assert_close(second.sequences, one_shot.sequences, rtol=0, atol=0)
    torch.testing.assert_close(
        torch.stack(first.scores + second.scores), torch.stack(one_shot.scores), rtol=1e-4, atol=1e-4
    )


# ----------------------------------------------------------------------------------------------- prefix strategies


@pytest.mark.parametrize("masking", ["strict", "reference"])
def test_pad_strategy_equals_hand_padded_prompt(make_config, masking):
    """Reference protocol: left-pad with the pad token to prefix_length, mask the pads in the linear attention only."""
    model = build(make_config, prefix_pad_masking=masking)
    short = prompt(3)
    padded = torch.cat([torch.full((1, PREFIX - 3), 3), short], dim=1)
    linear_attention_mask = (padded != 3).long()
    expected = argmax_loop(model, padded, 10, linear_attention_mask=linear_attention_mask)
    generated = greedy(model, short, 10, prefix_strategy="pad")
    torch.testing.assert_close(generated, torch.cat([short, expected], dim=1), rtol=0, atol=0)
    # The fill matters: other pad tokens (read by conv and sliding attention) give other scores.
    settings = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    scores_3 = model.generate(short, prefix_pad_token_id=3, **settings).scores[0]
    scores_50 = model.generate(short, prefix_pad_token_id=50, **settings).scores[0]
    assert (scores_3 - scores_50).abs().max() > 1e-3


def test_repeat_and_none_strategies_equal_hand_built_prompts(make_config):
    model = build(make_config)
    short = prompt(3)
    repeated = short.repeat(1, 3)[:, -PREFIX:]  # [p1 p2 p0 p1 p2 p0 p1 p2]
    expected_repeat = argmax_loop(model, repeated, 10)
    torch.testing.assert_close(greedy(model, short, 10, prefix_strategy="repeat")[:, 3:], expected_repeat)
    expected_none = argmax_loop(model, short, 10, prefix_length=3)
    torch.testing.assert_close(greedy(model, short, 10, prefix_strategy="none")[:, 3:], expected_none)
    assert not torch.equal(expected_repeat, expected_none)
    # Per call overrides the config; the config default is used otherwise.
    model.config.prefix_strategy = "repeat"
    torch.testing.assert_close(greedy(model, short, 10)[:, 3:], expected_repeat)


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_chunked_prefill_equals_one_forward(make_config, kind):
    """Chunks of at least the prefix length: the encoder still reads the first prefix_length tokens."""
    model = build(make_config, **kind)
    input_ids = prompt(19, batch=2)
    settings = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    one = model.generate(input_ids, **settings)
    chunked = model.generate(input_ids, prefill_chunk_size=PREFIX, **settings)
    torch.testing.assert_close(chunked.sequences, one.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(chunked.scores), torch.stack(one.scores), rtol=1e-4, atol=1e-4)


def one_shot_and_chunked(model, input_ids, chunk, **kwargs):
    settings = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    with torch.no_grad():
        return model.generate(input_ids, **settings, **kwargs), model.generate(
            input_ids, prefill_chunk_size=chunk, **settings, **kwargs
        )


def assert_same_generation(chunked, one):
    torch.testing.assert_close(chunked.sequences, one.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(chunked.scores), torch.stack(one.scores), rtol=1e-4, atol=1e-4)


CHUNKS_BELOW_PREFIX = [
    # (kind, prompt length, left pads of row 1, prefill_chunk_size); the prefix is 8 tokens
    pytest.param("jrt-prefix", 23, 0, 3, id="jrt-chunk3"),
    pytest.param("jrt-prefix", 23, 5, 1, id="jrt-pads5-chunk1"),
    # 8 <= chunk < pads + 8: transformers' own loop splits row 1's encoder (it ends at 3 + 8 = 11)
    pytest.param("jrt-prefix", 23, 3, 10, id="jrt-pads3-chunk10"),
    pytest.param("based-causal", 23, 4, 3, id="based-pads4-chunk3"),
    pytest.param("based-decay", 23, 0, 5, id="based-decay-chunk5"),
]


@pytest.mark.parametrize("kind, length, pads, chunk", CHUNKS_BELOW_PREFIX)
def test_prefill_chunk_size_below_the_encoder_region_equals_one_shot(make_config, kind, length, pads, chunk):
    """Chunks of any size: the first forward spans every row's encoder region (pads + prefix), the rest are chunks."""
    model = build(make_config, **KINDS[kind])
    input_ids = prompt(length, batch=2)
    mask = torch.ones_like(input_ids)
    mask[1, :pads] = 0
    one, chunked = one_shot_and_chunked(model, input_ids, chunk, attention_mask=mask)
    assert_same_generation(chunked, one)


def test_prefill_chunk_size_with_mixed_lengths_and_the_pad_fill(make_config):
    """A left-padded batch of a short prompt (filled to the prefix with masked pads) and longer ones, chunk 2: the
    fill's `linear_attention_mask` columns follow each chunk."""
    model = build(make_config)
    input_ids = prompt(14, batch=3)
    mask = torch.ones_like(input_ids)
    mask[0, :11] = 0  # 3 tokens: filled with 5 pads
    mask[1, :4] = 0  # 10 tokens: encoder ends at column 4 + 8 = 12
    for chunk in (2, 9):
        one, chunked = one_shot_and_chunked(model, input_ids, chunk, attention_mask=mask, prefix_strategy="pad")
        assert_same_generation(chunked, one)
    # The short prompt alone: the fill is the whole first forward, the prompt generated as without chunks.
    one, chunked = one_shot_and_chunked(model, input_ids[:1, 11:], 1, prefix_strategy="pad")
    assert_same_generation(chunked, one)


@pytest.mark.parametrize(
    "mixer_types", [None, ["conv", "linear_attention", "conv", "linear_attention"]], ids=["with-sliding", "recurrent-only"]
)
def test_prefill_chunk_size_with_embeddings_and_continuation(make_config, mixer_types):
    """Chunked prefill of `inputs_embeds` (sliced per chunk) and of a continuation from a returned cache (the tokens
    the cache read are skipped, the new ones chunked), with no cache passed in, for an attention-free model too."""
    model = build(make_config, **({} if mixer_types is None else dict(mixer_types=mixer_types)))
    input_ids = prompt(17)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(input_ids)
    if CACHE_FIELD != "cache":
        pytest.skip("transformers < 5.24 chunks neither `inputs_embeds` nor a continuation (its loop restarts at 0)")
    settings = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    one = model.generate(inputs_embeds=embeds, **settings)
    chunked = model.generate(inputs_embeds=embeds, prefill_chunk_size=3, **settings)
    assert_same_generation(chunked, one)
    settings = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, **NO_EOS)
    with torch.no_grad():
        first = model.generate(input_ids, **settings)
        longer = torch.cat([first.sequences, prompt(9, seed=2)], dim=1)
        # The mask is given: inferred from `pad_token_id` (0), a generated 0 would read as a hole in the row.
        settings["attention_mask"] = torch.ones_like(longer)
        expected = model.generate(longer, **{CACHE_FIELD: copy.deepcopy(output_cache(first))}, **settings)
        chunked = model.generate(longer, **{CACHE_FIELD: output_cache(first)}, prefill_chunk_size=2, **settings)
    torch.testing.assert_close(chunked.sequences, expected.sequences, rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [5, 9])
def test_chunked_prefill_of_left_padded_embeddings(make_config, chunk):
    """transformers cuts a chunked prefill by `input_ids`: with the embeddings' ids the chunks give the one-shot
    tokens; embeddings alone would reach the model with an empty mask and are refused in one line (they failed with
    "`attention_mask` has 0 columns")."""
    if CACHE_FIELD != "cache":
        pytest.skip("transformers < 5.24 does not chunk `inputs_embeds`")
    model = build(make_config)
    input_ids = prompt(21, batch=2)
    mask = torch.ones_like(input_ids)
    mask[0, :6] = 0
    with torch.no_grad():
        embeds = model.get_input_embeddings()(input_ids)
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, **NO_EOS)
    one = model.generate(inputs_embeds=embeds, **settings)
    chunked = model.generate(input_ids=input_ids, inputs_embeds=embeds, prefill_chunk_size=chunk, **settings)
    torch.testing.assert_close(chunked[:, -4:], one, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"covers 0 of the 21 positions .* pass the embeddings' `input_ids` too"):
        model.generate(inputs_embeds=embeds, prefill_chunk_size=chunk, **settings)


def test_generation_lengths_count_the_callers_prompt(make_config):
    model = build(make_config)
    short = prompt(3)
    assert greedy(model, short, 5).shape == (1, 8)
    assert model.generate(short, max_length=9, min_length=9, do_sample=False, **NO_EOS).shape == (1, 9)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(short)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False, **NO_EOS)
    torch.testing.assert_close(from_embeds, greedy(model, short, 5)[:, 3:], rtol=0, atol=0)


def test_prefix_errors_are_clear(make_config):
    model = build(make_config)
    with pytest.raises(ValueError, match="prefix_strategy"):
        greedy(model, prompt(3), 2, prefix_strategy="twice")
    right_padded = torch.ones(2, 4, dtype=torch.long)
    right_padded[0, 3] = 0
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        greedy(model, prompt(4, batch=2), 2, attention_mask=right_padded)
    with pytest.raises(ValueError, match="vocab_size=99"):
        greedy(model, prompt(3), 2, prefix_pad_token_id=220)


# What each release says: up to 5.24 `_is_stateful` refuses the model, from 5.25 the cache that cannot be cropped.
ASSISTED_REFUSED = (
    "assisted generation is not supported with stateful models|Assisted decoding requires a cache that can be cropped"
)


def test_transformers_refuses_assisted_decoding_for_the_stateful_model(make_config):
    """`generate()` has no check of its own: transformers refuses assistants and prompt lookup with a `ValueError`
    (`_is_stateful`, and the cache's `is_croppable` False)."""
    model = build(make_config)
    for kwargs in (dict(prompt_lookup_num_tokens=2), dict(assistant_model=build(make_config))):
        with pytest.raises(ValueError, match=ASSISTED_REFUSED):
            greedy(model, prompt(10), 2, **kwargs)


# ------------------------------------------------------------------------------------------------ memory and vocab


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_cache_bytes_stay_flat_past_the_window(make_config, kind):
    model = build(make_config, **kind)

    def cache_bytes(new_tokens: int) -> int:
        out = model.generate(prompt(6), max_new_tokens=new_tokens, return_dict_in_generate=True, **NO_EOS)
        tensors = [tensor for layer in output_cache(out).layers for tensor in layer.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    assert cache_bytes(10) == cache_bytes(200) > 0


def test_vocabulary_padding_rows_and_mask_token_are_never_generated(make_config):
    model = build(make_config)
    with torch.no_grad():  # make ids 95 (a padding row) and 5 (the mask token) the argmax everywhere
        model.lm_head.weight[95] = model.lm_head.weight[5] = 0
        model.lm_head.bias = None
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[95, 0] = model.lm_head.weight[5, 1] = 1e3
    unmasked = greedy(model, prompt(10), 6)[:, 10:]
    assert set(unmasked.flatten().tolist()) <= {5, 95}
    model.config.generation_vocab_size, model.config.mask_token_id = 90, 5
    assert model.generation_config.suppress_tokens is None  # reading the config changes nothing
    model.generation_config = model.generation_config  # the documented step after changing those fields
    for settings in (dict(do_sample=False), dict(do_sample=True, temperature=5.0), dict(num_beams=2)):
        generated = model.generate(prompt(10), max_new_tokens=6, **NO_EOS, **settings)[:, 10:]
        assert generated.max() < 90 and not (generated == 5).any()


def test_never_generated_ids_are_suppress_tokens_of_the_saved_generation_config(make_config, tmp_path):
    """Saved as `suppress_tokens`, so transformers' own generate (pipelines, lm-eval, `GenerationMixin.generate`
    called directly) never emits them either."""
    model = build(make_config, generation_vocab_size=90, mask_token_id=5)
    assert model.generation_config.suppress_tokens == [5, *range(90, 99)]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["suppress_tokens"] == [5, *range(90, 99)]
    reloaded = JRTRNNForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():  # make ids 95 (a padding row) and 5 (the mask token) the argmax everywhere
        reloaded.lm_head.weight[95] = reloaded.lm_head.weight[5] = 0
        reloaded.model.norm.weight.fill_(1.0)
        reloaded.lm_head.weight[95, 0] = reloaded.lm_head.weight[5, 1] = 1e3
    plain = GenerationMixin.generate(reloaded, prompt(10), max_new_tokens=6, do_sample=False, **NO_EOS)[:, 10:]
    assert plain.max() < 90 and not (plain == 5).any()
    assert build(make_config).generation_config.suppress_tokens is None  # nothing to suppress


# ----------------------------------------------------------------------------------- streamers, criteria, pipeline


class Collector(BaseStreamer):
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.reshape(-1))

    def end(self) -> None:
        self.ended = True


class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_streamer_sees_the_callers_prompt_and_every_token(make_config):
    model = build(make_config)
    short = prompt(3)
    streamer = Collector()
    generated = greedy(model, short, 6, streamer=streamer)
    assert streamer.ended
    torch.testing.assert_close(streamer.chunks[0], short[0])  # no internal fill
    torch.testing.assert_close(torch.cat(streamer.chunks), generated[0])


def test_stopping_criteria_and_eos(make_config):
    model = build(make_config)
    long_prompt = prompt(10)
    stopped = model.generate(
        long_prompt, max_new_tokens=20, stopping_criteria=StoppingCriteriaList([StopAfter(14)]), **NO_EOS
    )
    assert stopped.shape == (1, 14)
    reference = greedy(model, long_prompt, 8)
    eos = int(reference[0, 13])
    with_eos = model.generate(long_prompt, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    torch.testing.assert_close(with_eos, reference[:, :14])


def _word_tokenizer(tmp_path) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<sp>": 3}
    vocab.update({f"w{i}": i for i in range(4, 99)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )


def test_text_generation_pipeline(make_config, tmp_path):
    model = build(make_config)
    tokenizer = _word_tokenizer(tmp_path)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    texts = ["w5 w6 w7", "w8 w9 w10 w11 w12 w13 w14 w15 w16 w17"]
    results = generator(texts, max_new_tokens=5, do_sample=False, batch_size=2, return_full_text=False,
                        eos_token_id=None)
    for text, result in zip(texts, results):
        ids = tokenizer(text, return_tensors="pt").input_ids
        expected = tokenizer.decode(greedy(model, ids, 5)[0, ids.shape[1] :])
        assert result[0]["generated_text"].strip() == expected.strip()


def test_generation_vocab_size_is_validated(make_config):
    with pytest.raises(ValueError, match="generation_vocab_size"):
        make_config(generation_vocab_size=100)
    assert make_config(generation_vocab_size=99).generation_vocab_size == 99


# ------------------------------------------------------------------------------- the prompt record on the cache


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
@pytest.mark.parametrize("strategy", ["pad", "repeat"])
def test_deepcopy_of_a_cache_continues_like_the_original(make_config, kind, strategy):
    """The fill and what the cache read live on the cache: a deep copy continues exactly like the original."""
    model = build(make_config, **kind)
    input_ids = prompt(3, batch=2)  # shorter than the prefix: the fill applies
    settings = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, prefix_strategy=strategy,
                    **NO_EOS)
    first = model.generate(input_ids, max_new_tokens=4, **settings)
    saved = copy.deepcopy(output_cache(first))
    from_copy = model.generate(first.sequences, cache=saved, max_new_tokens=5, **settings)
    from_original = model.generate(first.sequences, cache=output_cache(first), max_new_tokens=5, **settings)
    torch.testing.assert_close(from_copy.sequences, from_original.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(from_copy.scores), torch.stack(from_original.scores), rtol=0, atol=0)
    assert saved.get_seq_length() == 3 + 4 + 5 - 1  # the caller's tokens read (the last one is not yet)
    if kind["linear_attention_type"] == "prefix":
        assert saved.prefix.prefix_lengths.tolist() == [PREFIX, PREFIX]  # the encoder read the filled first turn
        assert saved.prefix.prompt.tolist() == [3, 3] and saved.fill_columns == PREFIX - 3


def test_continuing_from_a_cache_needs_the_tokens_it_read(make_config):
    """`input_ids` of a continuation start with the tokens the cache read (it keeps a constant-size state, not the
    tokens: it counts them, `get_seq_length()`); fewer are refused."""
    model = build(make_config)
    first = model.generate(prompt(5), max_new_tokens=3, do_sample=False, return_dict_in_generate=True, **NO_EOS)
    assert output_cache(first).get_seq_length() == 7
    with pytest.raises(ValueError, match="This cache has read 7 tokens, but `input_ids` has 5"):
        greedy(model, prompt(5), 3, cache=output_cache(first))


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_generate_continues_from_the_cache_of_a_plain_forward(make_config, kind):
    """transformers' own `test_generate_continue_from_inputs_embeds` pattern: a forward with `use_cache=True`, then
    `generate(cache=...)` with the full sequence, equals one `generate()` over it."""
    model = build(make_config, **kind)
    input_ids = prompt(10, batch=2)
    settings = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    one_shot = model.generate(input_ids, **settings)
    with torch.no_grad():
        cache = output_cache(model(input_ids[:, :6], use_cache=True))
    continued = model.generate(input_ids, cache=cache, **settings)
    # The encoder of the forward read its 6 tokens (prompt_lengths 6): the same as a one-shot prompt of 6 whose
    # 4 further tokens are read causally, i.e. generate(prompt_lengths=6) on the whole prompt.
    expected = model.generate(input_ids, prompt_lengths=torch.full((2,), 6), **settings) if kind is KINDS[
        "jrt-prefix"] else one_shot
    torch.testing.assert_close(continued.sequences, expected.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(continued.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prompt_length", [3, 10])
def test_continuation_on_an_all_recurrent_cache_reads_each_token_once(make_config, prompt_length):
    """No sliding-attention layer: the cache counts the tokens it read all the same."""
    model = build(make_config, mixer_types=["conv", "linear_attention", "linear_attention"], num_hidden_layers=3)
    assert_continuation_equals_one_shot(model, prompt(prompt_length, batch=2), 4, 5)


@pytest.mark.parametrize(
    "processor_kwargs,processor",
    [
        (dict(repetition_penalty=2.0), lambda: RepetitionPenaltyLogitsProcessor(2.0)),
        (dict(no_repeat_ngram_size=1), lambda: NoRepeatNGramLogitsProcessor(1)),
    ],
    ids=["repetition_penalty", "no_repeat_ngram_size"],
)
def test_logits_processors_never_see_the_fill(make_config, processor_kwargs, processor):
    """Under "pad", a short prompt's scores equal a hand loop over the padded prompt whose processor sees only the
    caller's prompt and the generated tokens (not the fill token, id 3)."""
    model = build(make_config)
    short = prompt(3)
    padded = torch.cat([torch.full((1, PREFIX - 3), 3), short], dim=1)
    generated = model.generate(short, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                               output_scores=True, prefix_strategy="pad", **processor_kwargs, **NO_EOS)
    hand = processor()
    sequence, visible, scores = padded, short, []
    for _ in range(6):
        mask = torch.cat([(padded != 3).long(), torch.ones(1, sequence.shape[1] - PREFIX, dtype=torch.long)], dim=1)
        logits = model(sequence, use_cache=False, linear_attention_mask=mask).logits[:, -1]
        step_scores = hand(visible, logits)
        scores.append(step_scores)
        token = step_scores.argmax(-1, keepdim=True)
        sequence, visible = torch.cat([sequence, token], 1), torch.cat([visible, token], 1)
    torch.testing.assert_close(generated.sequences, visible, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(generated.scores), torch.stack(scores), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(generated.scores[0][0, 3])  # the fill token is neither banned nor penalised


def test_stopping_criteria_see_the_callers_tokens(make_config):
    model = build(make_config)
    short = prompt(3)
    seen = []

    class Record(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(input_ids.clone())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    generated = greedy(model, short, 4, stopping_criteria=StoppingCriteriaList([Record()]))
    assert [ids.shape[1] for ids in seen] == [4, 5, 6, 7]
    torch.testing.assert_close(seen[-1], generated, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["pad", "none"])
def test_left_padded_batch_without_a_cache_keeps_each_rows_prefix(make_config, strategy):
    """use_cache=False recomputes the whole sequence each step: each row's encoder must stay on its own prompt."""
    model = build(make_config)
    batch = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    batch[0, 3:], mask[0, 3:] = prompt(3, seed=4)[0], 1
    batch[1], mask[1] = prompt(6, seed=5)[0], 1
    settings = dict(max_new_tokens=6, do_sample=False, prefix_strategy=strategy, attention_mask=mask, **NO_EOS)
    cached = model.generate(batch, use_cache=True, **settings)
    uncached = model.generate(batch, use_cache=False, **settings)
    torch.testing.assert_close(uncached, cached, rtol=0, atol=0)


def test_prefix_strategy_default_is_the_model_configs_and_generate_overrides_it(make_config, tmp_path):
    """`config.prefix_strategy` (saved in config.json) is the default of every first forward; `generate(
    prefix_strategy=...)` overrides it per call."""
    model = build(make_config, prefix_strategy="repeat")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["prefix_strategy"] == "repeat"
    reloaded = JRTRNNForCausalLM.from_pretrained(tmp_path).eval()
    short = prompt(3)
    assert torch.equal(greedy(reloaded, short, 6), greedy(reloaded, short, 6, prefix_strategy="repeat"))
    assert not torch.equal(greedy(reloaded, short, 6), greedy(reloaded, short, 6, prefix_strategy="pad"))
    with pytest.raises(ValueError, match=r"`prefix_strategy` must be one of \['pad', 'repeat', 'none'\]"):
        greedy(reloaded, short, 2, prefix_strategy="truncate")


def test_a_generation_config_with_the_former_prefix_strategy_key_still_loads(make_config, tmp_path):
    """Folders saved by jrt-rnn 0.2 keep `prefix_strategy` in generation_config.json: it becomes the model config's
    default (with a warning), and per-call values still override it."""
    build(make_config).save_pretrained(tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "_from_model_config": False, "prefix_strategy": "repeat"}))
    reloaded = JRTRNNForCausalLM.from_pretrained(tmp_path).eval()
    short = prompt(3)
    assert torch.equal(greedy(reloaded, short, 6), greedy(reloaded, short, 6, prefix_strategy="repeat"))
    assert reloaded.config.prefix_strategy == "repeat"
    assert not hasattr(reloaded.generation_config, "prefix_strategy")
    assert not torch.equal(greedy(reloaded, short, 6), greedy(reloaded, short, 6, prefix_strategy="pad"))


@pytest.mark.parametrize(
    "text, reason",
    [
        ("{not json", "Expecting property name"),
        ('{"prefix_strategy": "repeat",', "Expecting property name"),
        ("", "Expecting value"),
        (b"\xff\xfe{}", "UnicodeDecodeError"),
    ],
    ids=["not-json", "truncated", "empty", "not-utf8"],
)
def test_a_damaged_generation_config_loads_like_transformers_with_a_warning_naming_the_file(
    make_config, tmp_path, caplog, text, reason
):
    """A generation_config.json that is not JSON: transformers alone loads the folder with the generation defaults of
    config.json; the 0.2 migration must not crash on it either (it did, with a bare JSONDecodeError), but skips it
    with a warning that names the file."""
    model = build(make_config, prefix_strategy="repeat")
    model.save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with caplog.at_level("WARNING"):
        reloaded = JRTRNNForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.prefix_strategy == "repeat"  # config.json's, untouched
    assert reloaded.generation_config.eos_token_id == model.generation_config.eos_token_id
    warning = [record.getMessage() for record in caplog.records if "not readable JSON" in record.getMessage()]
    assert len(warning) == 1 and str(path) in warning[0] and reason in warning[0], caplog.text


@pytest.mark.parametrize("text", ["[1, 2]", "3", '"prefix_strategy"'])
def test_a_generation_config_that_is_not_an_object_fails_as_in_transformers(make_config, tmp_path, text):
    """A JSON list, number or string: transformers itself refuses the folder (before the migration runs), the same
    way for a stock model; the migration adds no error of its own."""
    from transformers import GPT2Config, GPT2LMHeadModel

    build(make_config).save_pretrained(tmp_path / "jrt")
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)).save_pretrained(tmp_path / "gpt2")
    errors = []
    for name, cls in (("gpt2", GPT2LMHeadModel), ("jrt", JRTRNNForCausalLM)):
        (tmp_path / name / "generation_config.json").write_text(text)
        with pytest.raises(Exception) as caught:
            cls.from_pretrained(tmp_path / name)
        errors.append((type(caught.value), str(caught.value)))
        assert "legacy_folders" not in str(caught.traceback[-1].path)
    assert errors[0] == errors[1]
