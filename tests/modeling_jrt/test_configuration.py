"""JRTRNNConfig: defaults of the released models, validation errors that name the field, save/load round trip."""

from __future__ import annotations

import pytest

from modeling_jrt import JRTRNNConfig, default_layer_types


def test_defaults_match_jrt_360m():
    config = JRTRNNConfig()
    assert config.model_type == "jrt_rnn"
    assert config.num_hidden_layers == 26 and config.hidden_size == 1024 and config.head_dim == 64
    assert [i for i, t in enumerate(config.layer_types) if t == "linear_attention"] == [1, 6, 11, 16, 21]
    assert [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"] == [2, 7, 12, 17, 22]
    assert config.sliding_window == 129 and config.prefix_length == 1024 and config.num_taylor_features == 273
    assert config.tie_word_embeddings and config.vocab_size == 50264


def test_default_layer_types_for_36_layers():
    layer_types = default_layer_types(36)
    assert [i for i, t in enumerate(layer_types) if t == "linear_attention"] == [1, 6, 11, 16, 21, 27, 33]
    assert [i for i, t in enumerate(layer_types) if t == "sliding_attention"] == [2, 7, 12, 17, 22, 28, 34]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_hidden_layers=3, layer_types=["conv", "conv"]), r"`layer_types` has 2 entries .* `num_hidden_layers` is 3"),
        (dict(num_hidden_layers=2, layer_types=["conv", "ssm"]), r"`layer_types\[1\]` is 'ssm'; allowed layer types"),
        (dict(num_attention_heads=5), r"`hidden_size` \(1024\) must be divisible by `num_attention_heads` \(5\)"),
        (dict(linear_attention_type="bidirectional"), r"`linear_attention_type` must be one of \['prefix', 'causal'\]"),
        (dict(prefix_pad_masking="none"), r"`prefix_pad_masking` must be one of \['strict', 'reference'\]"),
        (dict(prefix_strategy="truncate"), r"`prefix_strategy` must be one of \['pad', 'repeat', 'none'\]"),
        (dict(linear_attention_implementation="cuda"), r"`linear_attention_implementation` must be one of"),
        (dict(linear_attention_decay=True), r"need `linear_attention_type='causal'`"),
        (dict(sliding_window=0), r"`sliding_window` must be a positive integer"),
        (dict(prefix_length=-1), r"`prefix_length` must be >= 0"),
        (dict(mask_token_id=50264), r"`mask_token_id` \(50264\) must be in \[0, vocab_size=50264\)"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        JRTRNNConfig(**overrides)


def test_based_decay_config_is_valid():
    config = JRTRNNConfig(num_hidden_layers=27, linear_attention_type="causal", linear_attention_decay=True,
                          use_decay_proj=True, decay_const=-3)
    assert config.layer_types.count("linear_attention") == 5


def test_save_and_load_round_trip(tmp_path):
    config = JRTRNNConfig(num_hidden_layers=4, layer_types=["conv", "linear_attention", "sliding_attention", "conv"],
                          prefix_pad_masking="reference", mask_token_id=50263, intermediate_size=0)
    config.save_pretrained(tmp_path)
    loaded = JRTRNNConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
