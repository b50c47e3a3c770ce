"""Standard transformers outputs: hidden states, attentions of the sliding layers, tuples, `logits_to_keep`, the
`past_key_values` alias, and `generate()` with ids and embeddings together, all through transformers' mechanisms."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from modeling_jrt import JRTRNNCache, JRTRNNForCausalLM
from modeling_jrt.compat import output_cache

NO_EOS = dict(eos_token_id=None, pad_token_id=0)


def build(make_config, **kwargs) -> JRTRNNForCausalLM:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(initializer_range=0.3), **kwargs).eval()


def ids(batch: int = 2, length: int = 11) -> torch.LongTensor:
    return torch.randint(4, 99, (batch, length), generator=torch.Generator().manual_seed(1))


def test_output_hidden_states_are_the_input_and_every_block_output(make_config):
    model = build(make_config)
    input_ids = ids()
    inputs, outputs = [], []  # each block's input and output, recorded by plain forward hooks

    def record(module, args, output) -> None:
        inputs.append(args[0])
        outputs.append(output)

    hooks = [layer.register_forward_hook(record) for layer in model.model.layers]
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    states = [inputs[0], *outputs]
    torch.testing.assert_close(states[0], model.model.embed_tokens(input_ids).float())
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for index in range(model.config.num_hidden_layers):
        torch.testing.assert_close(out.hidden_states[index], states[index])
    torch.testing.assert_close(out.hidden_states[-1], model.model.norm(states[-1]))  # the last one after the norm
    torch.testing.assert_close(out.hidden_states[-1], model.model(input_ids).last_hidden_state)
    assert model(input_ids).hidden_states is None  # nothing recorded unless asked


def test_output_attentions_are_the_sliding_window_weights(make_config):
    model = build(make_config, attn_implementation="eager")
    window = model.config.sliding_window
    with torch.no_grad():
        attentions = model(ids(), output_attentions=True).attentions
    assert len(attentions) == model.config.mixer_types.count("sliding_attention")
    weights = attentions[0]  # (B, H, T, T)
    assert weights.shape == (2, model.config.num_attention_heads, 11, 11)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    query, key = torch.arange(11)[:, None], torch.arange(11)[None, :]
    outside = (key > query) | (key <= query - window)  # the future, and keys older than the window
    assert (weights[..., outside] == 0).all() and (weights[..., ~outside] > 0).all()


def test_output_attentions_of_a_filled_prompt_cover_the_callers_positions_only(make_config):
    """A prompt shorter than the prefix is filled in front of its first token: the weights are (B, H, T, T) over the
    caller's queries and keys, as with no fill (they used to carry the fill's key columns, (1, H, 3, 8))."""
    model = build(make_config, attn_implementation="eager")
    short = ids(1, 3)
    with torch.no_grad():
        filled = model(short, output_attentions=True, prefix_strategy="pad").attentions[0]
        plain = model(short, output_attentions=True, prefix_strategy="none").attentions[0]
    assert filled.shape == plain.shape == (1, model.config.num_attention_heads, 3, 3)


@pytest.mark.parametrize("kind", ["prefix", "causal"])
@pytest.mark.parametrize("strategy", ["pad", "repeat", "none"])
def test_a_row_of_a_left_padded_batch_shows_the_attention_it_shows_alone(make_config, strategy, kind):
    """Rows of 3 and 12 tokens, left padded: the short row's fill sits in its batch padding, and its weight used to
    show on those padding columns (0.2 each on columns 5..8). Each row shows on its real columns what it shows alone,
    and 0 on padding columns, in a forward and in `generate(output_attentions=True)`'s first step."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(initializer_range=0.3, linear_attention_type=kind),
                                             attn_implementation="eager").eval()
    batch = ids(2, 12)
    mask = torch.ones_like(batch)
    mask[0, :9] = 0
    batch[0, :9] = 0
    with torch.no_grad():
        together = model(batch, attention_mask=mask, output_attentions=True, prefix_strategy=strategy).attentions
        alone = model(batch[:1, 9:], output_attentions=True, prefix_strategy=strategy).attentions
        generated = model.generate(batch, attention_mask=mask, max_new_tokens=2, do_sample=False, output_attentions=True,
                                   return_dict_in_generate=True, prefix_strategy=strategy, **NO_EOS).attentions[0]
        longest = model(batch[1:], output_attentions=True, prefix_strategy=strategy).attentions
    for weights in (together, generated):
        for batched, single, row in zip(weights, alone, longest):
            torch.testing.assert_close(batched[0, :, 9:, 9:], single[0], rtol=1e-5, atol=1e-6)
            assert (batched[0, :, :, :9] == 0).all()
            torch.testing.assert_close(batched[1], row[0], rtol=1e-5, atol=1e-6)


def test_return_dict_false_returns_the_tuple(make_config):
    model = build(make_config)
    input_ids = ids()
    with torch.no_grad():
        as_dict = model(input_ids, labels=input_ids)
        as_tuple = model(input_ids, labels=input_ids, return_dict=False)
        backbone = model.model(input_ids, return_dict=False)
    assert isinstance(as_tuple, tuple) and isinstance(backbone, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.loss)
    torch.testing.assert_close(as_tuple[1], as_dict.logits)
    torch.testing.assert_close(backbone[0], model.model(input_ids).last_hidden_state)


def test_logits_to_keep_slices_like_transformers(make_config):
    model = build(make_config)
    input_ids = ids()
    with torch.no_grad():
        full = model(input_ids).logits
        torch.testing.assert_close(model(input_ids, logits_to_keep=3).logits, full[:, -3:])
        positions = torch.tensor([0, 4, 10])
        torch.testing.assert_close(model(input_ids, logits_to_keep=positions).logits, full[:, positions])


def test_past_key_values_is_the_same_argument_as_cache(make_config):
    """`past_key_values=` is the name transformers < 5.24 passes the cache under: the same argument, no warning."""
    model = build(make_config)
    input_ids = ids()
    with torch.no_grad():
        first = model(input_ids[:, :9], use_cache=True)
        expected = model(input_ids[:, 9:], cache=output_cache(first)).logits
        first = model(input_ids[:, :9], use_cache=True)
        aliased = model(input_ids[:, 9:], past_key_values=output_cache(first)).logits
    torch.testing.assert_close(aliased, expected)
    with pytest.raises(ValueError, match="Pass the cache once"):
        model(input_ids[:, 9:], cache=output_cache(first), past_key_values=JRTRNNCache(model.config))


@pytest.mark.parametrize("strategy", ["pad", "repeat", "none"])
def test_generate_takes_input_ids_with_their_embeddings(make_config, strategy):
    """As transformers' generate: the embeddings are read, and the returned sequences start with the ids."""
    model = build(make_config)
    input_ids = ids(1, 5)  # shorter than the prefix (8): the strategy fills it
    embeds = model.get_input_embeddings()(input_ids)
    kwargs = dict(max_new_tokens=4, do_sample=False, prefix_strategy=strategy, **NO_EOS)
    expected = model.generate(input_ids, **kwargs)
    assert torch.equal(model.generate(input_ids=input_ids, inputs_embeds=embeds, **kwargs), expected)
    assert torch.equal(model.generate(input_ids, inputs_embeds=embeds, **kwargs), expected)
    with pytest.raises(ValueError, match="were passed alongside"):  # transformers' own check
        model.generate(input_ids, input_ids=input_ids, **kwargs)


def test_generate_returns_hidden_states_when_asked(make_config):
    model = build(make_config)
    out = model.generate(ids(1, 10), max_new_tokens=3, do_sample=False, output_hidden_states=True,
                         return_dict_in_generate=True, **NO_EOS)
    assert len(out.hidden_states) == 3  # one entry per step
    assert all(len(step) == model.config.num_hidden_layers + 1 for step in out.hidden_states)
    assert out.hidden_states[0][0].shape == (1, 10, 32) and out.hidden_states[1][-1].shape == (1, 1, 32)


def test_an_unavailable_attention_backend_gets_transformers_own_error(make_config):
    """No error of the package's own: transformers refuses an unsupported or uninstalled backend, naming it."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises((ValueError, ImportError), match="(?i)flash ?attention ?2"):
            build(make_config, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match='attn_implementation="nonsense"` is not supported'):
        build(make_config, attn_implementation="nonsense")
