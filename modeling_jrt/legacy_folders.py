"""What folders saved by earlier jrt-rnn releases carry that now lives elsewhere, moved where it lives now.

- `layer_types` in config.json (< 0.4): read by `JRTRNNConfig` as `mixer_types` (configuration_jrt.py).
- `prefix_strategy` in generation_config.json (0.2): a model setting now (`config.prefix_strategy`). Releases differ
  in what they keep of a generation config's unknown fields, so the migration reads the saved file itself, on load.
"""

from __future__ import annotations

import json
import os

from transformers.utils import logging

from .prefix_fill import check_prefix_strategy

logger = logging.get_logger(__name__)

GENERATION_CONFIG_NAME = "generation_config.json"


def saved_generation_settings(source: str | os.PathLike, load_kwargs: dict) -> dict:
    """The raw `generation_config.json` of the folder or Hub repo `from_pretrained` just loaded (no download), or {}
    when there is none or it is not a JSON object (a damaged file warns: transformers loads such a folder anyway)."""
    source = str(source)
    subfolder = load_kwargs.get("subfolder") or ""
    if os.path.isdir(source):
        path: object = os.path.join(source, subfolder, GENERATION_CONFIG_NAME)
    else:
        from huggingface_hub import try_to_load_from_cache

        filename = f"{subfolder}/{GENERATION_CONFIG_NAME}" if subfolder else GENERATION_CONFIG_NAME
        path = try_to_load_from_cache(
            source, filename, cache_dir=load_kwargs.get("cache_dir"), revision=load_kwargs.get("revision")
        )
    if not isinstance(path, str) or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            settings = json.load(file)
    except json.JSONDecodeError as error:
        reason = f"{error.msg} at line {error.lineno}, column {error.colno}"
    except (OSError, UnicodeDecodeError) as error:
        reason = f"{type(error).__name__}: {error}"
    else:
        return settings if isinstance(settings, dict) else {}
    logger.warning(
        f"{path} is not readable JSON ({reason}): transformers ignores it and uses the generation defaults of "
        "config.json, and a jrt-rnn 0.2 `prefix_strategy` in it was not read. Fix or delete the file, or save the "
        "model again."
    )
    return {}


def migrate_legacy_generation_settings(model: object, source: str | os.PathLike, load_kwargs: dict) -> None:
    """Move a 0.2 folder's `generation_config.prefix_strategy` into `model.config.prefix_strategy`, with a warning."""
    legacy = saved_generation_settings(source, load_kwargs).get("prefix_strategy")
    if legacy is None:
        return
    model.config.prefix_strategy = check_prefix_strategy(legacy)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "prefix_strategy"):
        delattr(generation_config, "prefix_strategy")
    logger.warning(
        f"{source}: `prefix_strategy` ({legacy!r}) is saved in generation_config.json (jrt-rnn 0.2); it is a model "
        "setting now and was moved to `model.config.prefix_strategy` (save the model again to store it there). A "
        "per-call `generate(prefix_strategy=...)` overrides it."
    )


__all__ = ["migrate_legacy_generation_settings", "saved_generation_settings"]
