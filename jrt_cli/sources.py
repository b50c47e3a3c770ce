"""Where a `--model` / `--tokenizer` comes from: a local folder or a Hub repo id, decided in seconds.

transformers treats a name that is not an existing folder as a Hub repo id and, when the Hub cannot be reached,
retries for about a minute before it says "couldn't connect" (even for `converted/X`, a folder the user simply
mistyped). The `jrt` commands call `check_model_source` first:

- an existing folder is used as is, unless it holds a released HazyResearch checkpoint that was never converted
  ("convert it first: jrt convert SRC DST");
- an existing file is a usage error ("a file, not a model folder"; transformers would take it for a Hub id);
- a name that can only be a path (`./x`, `/x`, `~/x`, `a/b/c`) and does not exist: "no such folder";
- anything else may be a Hub id: it is used when the Hub answers within `HUB_PROBE_TIMEOUT` seconds or when the repo
  is in the local Hub cache (the command then runs offline, without retries); otherwise one line names both
  possibilities (no such local folder, Hub unreachable) and `HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from .main import UsageError

HUB_PROBE_TIMEOUT = 3.0
"""Seconds to wait for the Hub to answer before a Hub id is reported as unreachable."""

# Files whose presence in the local Hub cache makes a repo usable offline (a model or a tokenizer).
_CACHE_PROBE_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")
# Keys of a released HazyResearch config.json (a GPT2Config dump with the `based` mixer dicts, model_type "gpt2");
# a converted folder's has model_type "jrt_rnn".
_REFERENCE_CONFIG_KEYS = ("alt_mixer", "alt_mixer_2", "alt_mixer_layers", "alt_mixer_2_layers", "mixer")


class ModelSourceError(FileNotFoundError):
    """No local folder of that name and no reachable Hub repo: one line, exit code 1."""


def looks_like_path(name: str) -> bool:
    """A name only a path can have: `./x`, `../x`, `/x`, `~/x`, `a/b/c`, or a trailing `/` (a Hub id is `owner/name`
    or `name`)."""
    return name.startswith((".", "/", "~")) or name.endswith(("/", os.sep)) or name.count("/") > 1 or "\\" in name


def is_hub_id(name: str) -> bool:
    """Whether `name` is a syntactically valid Hub repo id (`gpt2`, `owner/name`)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model_source(name: str, flag: str) -> None:
    """Raise a one-line error unless `name` (the value of option `flag`) is a usable folder or Hub repo id (the
    rules of the module docstring)."""
    path = Path(name).expanduser()
    if path.is_dir():
        check_converted(path, flag)
        return
    if path.exists():  # transformers reads a file as a Hub id ("Repo id must be in the form ..."), after retries
        holder = path.parent
        example = f" ({str(holder)!r} holds a config.json)" if (holder / "config.json").is_file() else ""
        raise UsageError(f"{flag} {name!r} is a file, not a model folder: give the folder that holds "
                         f"the model's config.json, weights and tokenizer files{example}, or a Hub id.")
    if looks_like_path(name) or not is_hub_id(name):
        raise ModelSourceError(f"{flag} {name!r}: no such folder.")
    check_hub_source(name, flag)


def check_hub_source(name: str, flag: str, *, hint: str = "") -> None:
    """For a `name` that is not a local path: raise a one-line error unless the Hub answers or the repo is in the
    local Hub cache (then this process goes offline, `HF_HUB_OFFLINE=1`); `hint` ends the message."""
    if Path(name).expanduser().exists() or looks_like_path(name) or not is_hub_id(name):
        return
    from huggingface_hub import constants

    cached = _in_hub_cache(name)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise ModelSourceError(
            f"{flag} {name!r}: there is no folder of that name, and it is not in the local Hub cache (HF_HUB_OFFLINE "
            "is set, so the Hub is not asked). Give an existing folder, or unset HF_HUB_OFFLINE to download it." + hint
        )
    problem = hub_unreachable()
    if problem is None:
        return
    if cached:
        go_offline()
        return
    raise ModelSourceError(
        f"{flag} {name!r}: there is no folder of that name, and the Hugging Face Hub ({constants.ENDPOINT}) cannot "
        f"be reached to download it as a repo id ({problem}). Give an existing folder, or connect to the network "
        "(HF_HUB_OFFLINE=1 uses the local Hub cache only, without waiting for the network)." + hint
    )


def check_converted(folder: Path, flag: str) -> None:
    """Refuse a folder holding a released HazyResearch checkpoint (its reference config.json, not a converted one)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers reports an unreadable config with its file name
    is_reference = isinstance(config, dict) and any(key in config for key in _REFERENCE_CONFIG_KEYS)
    if is_reference and config.get("model_type") != "jrt_rnn":
        raise ModelSourceError(f"{flag} {str(folder)!r} holds a released HazyResearch checkpoint "
                               "in its original format: convert it first: jrt convert SRC DST "
                               f"(e.g. jrt convert {folder} {folder}-hf), then pass DST.")


@functools.cache
def hub_unreachable() -> str | None:
    """None when the Hub endpoint answers an HTTP request within `HUB_PROBE_TIMEOUT` seconds, else the reason."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT)
    except Exception as error:  # noqa: BLE001  (httpx/requests errors differ by version; any failure = unreachable)
        return " ".join(str(error).split()) or type(error).__name__
    return None


def go_offline() -> None:
    """Make this process read the Hub cache only (the CLI's own process: `jrt` is not a library)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in _CACHE_PROBE_FILES)


__all__ = ["HUB_PROBE_TIMEOUT", "ModelSourceError", "check_converted", "check_hub_source", "check_model_source",
           "hub_unreachable", "looks_like_path"]
