"""JRTRNNConfig: defaults of the released models, validation errors that name the field, save/load round trip."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_config

from modeling_jrt import JRTRNNConfig, default_mixer_types


def test_defaults_match_jrt_360m():
    config = JRTRNNConfig()
    assert config.model_type == "jrt_rnn"
    assert config.num_hidden_layers == 26 and config.hidden_size == 1024 and config.head_dim == 64
    assert [i for i, t in enumerate(config.mixer_types) if t == "linear_attention"] == [1, 6, 11, 16, 21]
    assert [i for i, t in enumerate(config.mixer_types) if t == "sliding_attention"] == [2, 7, 12, 17, 22]
    assert config.sliding_window == 129 and config.prefix_length == 1024 and config.num_taylor_features == 273
    assert config.tie_word_embeddings and config.vocab_size == 50264


def test_default_layer_types_for_36_layers():
    layer_types = default_mixer_types(36)
    assert [i for i, t in enumerate(layer_types) if t == "linear_attention"] == [1, 6, 11, 16, 21, 27, 33]
    assert [i for i, t in enumerate(layer_types) if t == "sliding_attention"] == [2, 7, 12, 17, 22, 28, 34]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_hidden_layers=3, mixer_types=["conv", "conv"]), r"`mixer_types` has 2 entries .* `num_hidden_layers` is 3"),
        (dict(num_hidden_layers=2, mixer_types=["conv", "ssm"]), r"`mixer_types\[1\]` is 'ssm'; allowed mixer types"),
        (dict(num_attention_heads=5), r"`hidden_size` \(1024\) must be divisible by `num_attention_heads` \(5\)"),
        (dict(linear_attention_type="bidirectional"), r"`linear_attention_type` must be one of \['prefix', 'causal'\]"),
        (dict(prefix_pad_masking="none"), r"`prefix_pad_masking` must be one of \['strict', 'reference'\]"),
        (dict(linear_attention_implementation="cuda"), r"`linear_attention_implementation` must be one of"),
        (dict(linear_attention_decay=True), r"need `linear_attention_type='causal'`"),
        (dict(sliding_window=0), r"`sliding_window` must be a positive integer"),
        (dict(prefix_length=-1), r"`prefix_length` must be an integer >= 0, got -1"),
        (dict(mask_token_id=50264), r"`mask_token_id` must be None or a token id in \[0, vocab_size=50264\)"),
        # Types: sizes are integers (not strings, floats or bools), flags are bools.
        (dict(hidden_size="1024"), r"`hidden_size` must be a positive integer, got '1024' \(str\)"),
        (dict(hidden_size=1024.0), r"`hidden_size` must be a positive integer, got 1024.0 \(float\)"),
        (dict(num_attention_heads=True), r"`num_attention_heads` must be a positive integer, got True \(bool\)"),
        (dict(num_attention_heads=0), r"`num_attention_heads` must be a positive integer, got 0"),
        (dict(num_hidden_layers=0, mixer_types=[]), r"`num_hidden_layers` must be a positive integer, got 0"),
        (dict(vocab_size=-5), r"`vocab_size` must be a positive integer"),
        (dict(feature_dim=0), r"`feature_dim` must be a positive integer"),
        (dict(conv_kernel_size=0), r"`conv_kernel_size` must be a positive integer"),
        (dict(conv_expansion=1.5), r"`conv_expansion` must be a positive integer"),
        (dict(linear_attention_chunk_size=0), r"`linear_attention_chunk_size` must be a positive integer"),
        (dict(intermediate_size=-1), r"`intermediate_size` must be an integer >= 0"),
        (dict(conv_bias="yes"), r"`conv_bias` must be True or False, got 'yes'"),
        # Positive, finite epsilons and bases.
        (dict(rms_norm_eps=0.0), r"`rms_norm_eps` must be a finite number > 0, got 0.0"),
        (dict(rms_norm_eps=float("nan")), r"`rms_norm_eps` must be a finite number > 0, got nan"),
        (dict(linear_attention_eps=-1e-12), r"`linear_attention_eps` must be a finite number > 0"),
        (dict(rope_theta=0), r"`rope_theta` must be a finite number > 0"),
        (dict(mlm_weight=float("inf")), r"`mlm_weight` must be a finite number >= 0, got inf"),
        (dict(initializer_range=-0.02), r"`initializer_range` must be a finite number >= 0"),
        # The decay gamma_h = 1 - 2**(decay_const - h) must lie in (0, 1).
        (dict(linear_attention_type="causal", linear_attention_decay=True, decay_const=0.0),
         r"`decay_const` must be < 0 so that every decay"),
        (dict(decay_const=float("nan")), r"`decay_const` must be a finite number, got nan"),
        # Token ids inside the vocabulary or None.
        (dict(bos_token_id=-1), r"`bos_token_id` must be None or a token id in \[0, vocab_size=50264\), got -1"),
        (dict(eos_token_id=[2, 60000]), r"`eos_token_id` must be None or a token id .* got \[2, 60000\]"),
        (dict(pad_token_id=50264), r"`pad_token_id` must be None or a token id"),
        (dict(vocab_size=200, prefix_pad_token_id=220),
         r"`prefix_pad_token_id` must be None or a token id in \[0, vocab_size=200\), got 220"),
        (dict(vocab_size=64, bos_token_id=50256), r"`bos_token_id` must be None or a token id in \[0, vocab_size=64\)"),
        # Upper bounds, before anything is allocated (prefix_length: 10**8 filled every short prompt to 10**8 tokens).
        (dict(prefix_length=100_000_000), r"^`prefix_length` must be at most 1,048,576, got 100,000,000"),
        (dict(sliding_window=10**12), r"^`sliding_window` must be at most 1,048,576, got 1,000,000,000,000"),
        (dict(hidden_size=10**9), r"^`hidden_size` must be at most 65,536, got 1,000,000,000"),
        (dict(vocab_size=2**40), r"^`vocab_size` must be at most 4,194,304"),
        (dict(num_hidden_layers=10**7), r"^`num_hidden_layers` must be at most 1,024"),
        (dict(intermediate_size=10**9), r"^`intermediate_size` must be at most 262,144"),
        (dict(feature_dim=1000), r"^`feature_dim` must be at most 128"),
        (dict(rms_norm_eps="abc"), r"^`rms_norm_eps` must be a finite number > 0, got 'abc'"),
        (dict(generation_vocab_size=0), r"`generation_vocab_size` \(0\) must be in \[1, vocab_size=50264\]"),
        # layer_types: a list of this model's own names; transformers' legacy remap must not rename them.
        (dict(num_hidden_layers=2, mixer_types=["conv", "mamba"]), r"`mixer_types\[1\]` is 'mamba'"),
        (dict(num_hidden_layers=2, mixer_types=["conv", "full_attention"]), r"`mixer_types\[1\]` is 'full_attention'"),
        (dict(num_hidden_layers=4, mixer_types="conv"), r"`mixer_types` must be a list"),
        (dict(hidden_size=48, num_attention_heads=16), r"head dim .* = 3 must be even"),
        (dict(vocab_size=2**22, hidden_size=2**16, num_attention_heads=2**9),
         r"^`vocab_size` x `hidden_size` = 4,194,304 x 65,536 = .* \(1,024 GiB in float32\), above 8,589,934,592"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        JRTRNNConfig(**overrides)


def test_based_decay_config_is_valid():
    config = JRTRNNConfig(num_hidden_layers=27, linear_attention_type="causal", linear_attention_decay=True,
                          use_decay_proj=True, decay_const=-3)
    assert config.mixer_types.count("linear_attention") == 5


def test_save_and_load_round_trip(tmp_path):
    config = JRTRNNConfig(num_hidden_layers=4, mixer_types=["conv", "linear_attention", "sliding_attention", "conv"],
                          prefix_pad_masking="reference", mask_token_id=50263, intermediate_size=0)
    config.save_pretrained(tmp_path)
    loaded = JRTRNNConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()


def test_invalid_config_json_names_the_field_on_load(tmp_path):
    """A hand-edited config.json is checked on load like a constructed config."""
    config = JRTRNNConfig(num_hidden_layers=4, mixer_types=["conv", "linear_attention", "sliding_attention", "conv"])
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["feature_dim"] = "16"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"`feature_dim` must be a positive integer, got '16' \(str\)"):
        JRTRNNConfig.from_pretrained(tmp_path)
    data["feature_dim"] = 16
    data["layer_types"] = ["conv", "mamba", "sliding_attention", "conv"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"`layer_types\[1\]` is 'mamba'"):
        JRTRNNConfig.from_pretrained(tmp_path)


def test_defaults_fit_any_vocabulary():
    """The default special ids are None and the default prefix pad is 0, a token of every vocabulary (the converter
    writes GPT-2's 50256 and 220 explicitly)."""
    config = JRTRNNConfig(vocab_size=1, num_hidden_layers=2, mixer_types=["conv", "linear_attention"])
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (None, None, None)
    assert config.prefix_pad_token_id == 0 and config.mask_token_id is None
    JRTRNNConfig(vocab_size=64)  # no error


def test_every_size_field_has_an_upper_bound():
    from modeling_jrt.configuration_jrt import MAX_SIZES, NON_NEGATIVE_INT_FIELDS, POSITIVE_INT_FIELDS

    assert set(MAX_SIZES) == set(POSITIVE_INT_FIELDS) | set(NON_NEGATIVE_INT_FIELDS)
    for field, maximum in MAX_SIZES.items():
        with pytest.raises(ValueError, match=rf"^`{field}` must be at most {maximum:,}, got {maximum + 1:,}"):
            JRTRNNConfig(**{field: maximum + 1})


def test_out_of_bound_size_in_config_json_fails_on_load_before_allocation(tmp_path):
    """A config.json with `prefix_length: 100000000` is refused by `from_pretrained` in one line naming the field."""
    from transformers import AutoModelForCausalLM

    config = JRTRNNConfig(vocab_size=32, hidden_size=8, intermediate_size=0, num_hidden_layers=2,
                          num_attention_heads=2, mixer_types=["conv", "linear_attention"], feature_dim=2)
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["prefix_length"] = 100_000_000
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"^`prefix_length` must be at most 1,048,576, got 100,000,000"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_model_with_default_ids_and_a_small_vocabulary_generates():
    """Default ids (None) and prefix pad (0) work for a vocabulary of 64: the short prompt is filled to the default
    prefix of 1024 with id 0 (transformers' `test_model_forward_default_config_values` built this config and failed)."""
    import torch

    from modeling_jrt import JRTRNNCache, JRTRNNForCausalLM
    from modeling_jrt.compat import CACHE_FIELD

    config = JRTRNNConfig(vocab_size=64, hidden_size=16, intermediate_size=0, num_hidden_layers=2,
                          num_attention_heads=2, mixer_types=["conv", "linear_attention"], feature_dim=2)
    model = JRTRNNForCausalLM(config).eval()
    input_ids = torch.randint(0, 64, (1, 5))
    # No attention layer: generate() needs nothing passed, on every release (transformers sees no layer types).
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2, do_sample=False)
    assert output.shape == (1, 7) and torch.equal(output[:, :5], input_ids)
    passed = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2, do_sample=False,
                            **{CACHE_FIELD: JRTRNNCache(config)})
    assert torch.equal(passed, output)


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(mixer_types=["conv"] * 3), r"`mixer_types` has 3 entries but `num_hidden_layers` is 4"),
        (dict(num_hidden_layers=6), r"`mixer_types` has 4 entries but `num_hidden_layers` is 6"),
        (dict(mixer_types=["conv", "attention", "conv", "conv"]), r"mixer_types"),
        (dict(hidden_size=33), r"`hidden_size` \(33\) must be divisible by `num_attention_heads` \(2\)"),
        (dict(linear_attention_type="prefix", use_decay_proj=True), r"Based options"),
        (dict(sliding_window=0), r"sliding_window"),
    ],
)
def test_the_config_a_model_is_built_from_is_checked(tmp_path, override, message):
    """`from_pretrained(folder, field=value)` and a field changed after construction never pass the config's own
    checks: the model checks the config it is built from, with the config's message (was an IndexError inside
    `modeling_jrt.py`, or a model of another shape)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from modeling_jrt import JRTRNNForCausalLM, JRTRNNModel

    config = tiny_config()
    JRTRNNForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path, **override)
    for model_class in (JRTRNNForCausalLM, JRTRNNModel):
        mutated = AutoConfig.from_pretrained(tmp_path)
        for field, value in override.items():
            setattr(mutated, field, value)
        with pytest.raises(ValueError, match=message):
            model_class(mutated)
        with pytest.raises(ValueError, match=message):
            AutoModelForCausalLM.from_config(mutated)
