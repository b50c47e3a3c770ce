"""The model owns its vocabulary and its cache: nothing transformers does with `layer_types` or with cache layers, on
any release of the declared range, reaches it (the release matrix in CI runs tests/cross_release on each)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from transformers import DynamicCache

import modeling_jrt
from modeling_jrt import JRTRNNCache, JRTRNNConfig, JRTRNNForCausalLM
from modeling_jrt.transformers_range import (
    KERNELS_CLASH,
    MIN_TRANSFORMERS,
    TRANSFORMERS_RANGE,
    check_transformers_release,
    importing_transformers,
)

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ["conv", "linear_attention", "sliding_attention", "conv"]


def test_the_model_code_declares_the_range_pyproject_declares():
    assert f'"transformers{TRANSFORMERS_RANGE}"' in (ROOT / "pyproject.toml").read_text()
    releases = [line.split("#")[0].split() for line in (ROOT / ".ci" / "transformers_releases").read_text().splitlines()]
    oldest = [fields[0] for fields in releases if len(fields) > 1 and fields[1] == "oldest"]
    assert len(oldest) == 1 and tuple(map(int, oldest[0].split(".")[:2])) == MIN_TRANSFORMERS


@pytest.mark.parametrize("version", ["4.57.6", "5.4.0", "6.0.0", "6.1.0.dev0"])
def test_a_release_outside_the_range_is_refused_in_one_line(version):
    with pytest.raises(ImportError) as raised:
        check_transformers_release(version)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"jrt-rnn's model code needs transformers>=5.5,<6; found {version}.")


@pytest.mark.parametrize("version", ["5.5.0", "5.17.0", "5.25.0", "5.99.0.dev0"])
def test_a_release_inside_the_range_is_accepted(version):
    check_transformers_release(version)


def test_the_kernels_clash_of_old_releases_becomes_one_line_with_the_fix():
    with pytest.raises(ImportError, match=r"pip uninstall kernels.*kernels<0.19"):
        with importing_transformers():
            raise ValueError(KERNELS_CLASH + ".")
    with pytest.raises(ValueError, match="something else"):  # any other error is transformers' to tell
        with importing_transformers():
            raise ValueError("something else")


def test_the_config_has_no_layer_types_for_transformers_to_read():
    config = tiny_config()
    assert getattr(config, "layer_types", None) is None
    assert not hasattr(config, "layer_types")
    with pytest.raises(AttributeError, match=r"now `mixer_types`"):
        config.layer_types  # noqa: B018
    assert "layer_types" not in config.to_dict() and config.to_dict()["mixer_types"] == LEGACY


def test_transformers_default_cache_for_the_config_has_no_recurrent_layer():
    """transformers 5.5 - 5.23 build a `DynamicCache(config=...)` in `generate()` and ask its length before the first
    forward, which raised for caches made only of recurrent layers: with no `layer_types`, it has none."""
    config = tiny_config(mixer_types=["conv", "linear_attention", "conv", "linear_attention"])
    assert DynamicCache(config=config).get_seq_length() == 0


def test_the_former_name_is_accepted_and_moved():
    assert tiny_config(mixer_types=None, layer_types=LEGACY).mixer_types == LEGACY
    with pytest.raises(ValueError, match=r"`layer_types` .* and `mixer_types` .* disagree"):
        tiny_config(layer_types=["conv"] * 4)
    with pytest.raises(ValueError, match=r"`layer_types\[1\]` is 'mamba'"):
        tiny_config(mixer_types=None, layer_types=["conv", "mamba", "conv", "conv"])


def test_a_config_json_of_an_earlier_release_loads_as_the_same_model(tmp_path):
    """0.2 / 0.3 folders store `layer_types` with "conv" (which transformers 5.17 rewrites in custom-code configs)."""
    torch.manual_seed(0)
    model = JRTRNNForCausalLM(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["layer_types"] = saved.pop("mixer_types")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded, info = JRTRNNForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.config.mixer_types == LEGACY
    input_ids = torch.randint(4, 99, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "again")  # saved again: the new name only
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["mixer_types"] == LEGACY and "layer_types" not in again


def test_the_cache_answers_what_transformers_asks_of_a_recurrent_cache():
    """What releases read of a cache and of its layers (5.25: `is_croppable` before assisted decoding; `generate()`:
    `is_compileable`, here fixed-shape buffers; transformers' tests: `keys` / `values`) is answered, as transformers'
    own recurrent layers answer it."""
    config = tiny_config()
    model = JRTRNNForCausalLM(config).eval()
    cache = model(torch.randint(4, 99, (2, 9)), use_cache=True).cache
    assert cache.is_croppable is False and cache.is_compileable is True
    assert cache.get_max_cache_shape() == cache.get_max_length() == cache.max_cache_len == -1
    assert cache.is_sliding == [False, False, True, False]
    for kind, layer in zip(config.mixer_types, cache.layers):
        assert layer.is_croppable is False and layer.is_compileable is True and layer.is_initialized
        if kind == "sliding_attention":
            assert layer.keys.shape == layer.values.shape == (2, 2, config.sliding_window - 1, config.head_dim)
        else:
            assert layer.keys is None and layer.values is None
        with pytest.raises(ValueError, match="cannot be rolled back"):
            layer.crop(3)
    assert not any(layer.is_initialized for layer in JRTRNNCache(config).layers)


def test_the_package_exports_the_mixer_vocabulary():
    assert modeling_jrt.MIXER_TYPES == ("conv", "sliding_attention", "linear_attention")
    assert re.fullmatch(r">=\d+\.\d+,<\d+", TRANSFORMERS_RANGE)
