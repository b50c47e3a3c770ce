"""What differs between the transformers releases this package supports (see pyproject's `transformers` range).

transformers 5.24 renamed the cache of model inputs and outputs from `past_key_values` to `cache`: the model accepts
both names and returns its cache under the installed release's name (read from the public output dataclass).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
"""The name of the cache in transformers' model outputs on the installed release."""


def model_output(output_class: type, cache: object, **fields) -> object:
    """`output_class(**fields)` with the cache under the installed release's name (`CACHE_FIELD`)."""
    return output_class(**fields, **{CACHE_FIELD: cache})


def output_cache(output: object) -> object:
    """The cache of a model output, on any supported release."""
    return getattr(output, CACHE_FIELD, None)


def add_cache_alias(output_class: type) -> type:
    """Give `output_class` the other release's name of its cache as a read-only alias (`out.cache` on transformers
    < 5.24 as well, `out.past_key_values` on >= 5.24 where transformers has none), so user code reads either."""
    other = "past_key_values" if CACHE_FIELD == "cache" else "cache"
    if other not in {field.name for field in dataclasses.fields(output_class)} and not hasattr(output_class, other):
        setattr(output_class, other, property(lambda self: getattr(self, CACHE_FIELD), doc="The cache (alias)."))
    return output_class


def leave_static_cache_unused(cache: object) -> None:
    """Mark the unused layers of a `StaticCache` that `generate(cache_implementation="static")` built, and the model
    replaced, as holding no batch (`max_batch_size = 0`): transformers 5.5 - 5.14 read it at the next call, where an
    unused layer raised `AttributeError`."""
    for layer in getattr(cache, "layers", ()):
        if not getattr(layer, "is_initialized", True) and not hasattr(layer, "max_batch_size"):
            layer.max_batch_size = 0


def keep_last_logits(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of `hidden_states` `(B, T, hidden)` to compute logits for: the last `logits_to_keep` (0 = all),
    or those a 1D index tensor `(K,)` or a per-row one `(B, K)` selects (transformers' `logits_to_keep` convention).
    A negative count or an index outside `[-T, T)` is refused (indices are read outside torch.compile tracing)."""
    length = hidden_states.shape[1]
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, torch.Tensor)):
        raise ValueError(f"`logits_to_keep` must be an int or an integer tensor, got {logits_to_keep!r}.")
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"`logits_to_keep` must be >= 0 (0 keeps every position), got {logits_to_keep}.")
        return hidden_states if logits_to_keep == 0 else hidden_states[:, -logits_to_keep:]
    dtype = logits_to_keep.dtype
    if dtype.is_floating_point or dtype == torch.bool or logits_to_keep.dim() not in (1, 2):
        raise ValueError("`logits_to_keep` as a tensor holds integer positions, (K,) or (batch, K); got "
                         f"{logits_to_keep.dtype} of shape {tuple(logits_to_keep.shape)}.")
    if logits_to_keep.dim() == 2 and logits_to_keep.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"`logits_to_keep` (batch, K) has {logits_to_keep.shape[0]} rows for a batch of "
                         f"{hidden_states.shape[0]}.")
    if not torch.compiler.is_compiling() and logits_to_keep.numel():
        low, high = int(logits_to_keep.min()), int(logits_to_keep.max())
        first = 0 if logits_to_keep.dim() == 2 else -length  # per-row positions are gathered: no negative ones
        if low < first or high >= length:
            raise ValueError(f"`logits_to_keep` selects position {high if high >= length else low}, outside the "
                             f"{length} positions of the input (valid: {first} ... {length - 1}).")
    if logits_to_keep.dim() == 2:  # (B, K) positions per row
        index = logits_to_keep.to(hidden_states.device)[:, :, None].expand(-1, -1, hidden_states.shape[-1])
        return torch.gather(hidden_states, 1, index)
    return hidden_states[:, logits_to_keep]


__all__ = [
    "CACHE_FIELD", "add_cache_alias", "keep_last_logits", "leave_static_cache_unused", "model_output", "output_cache",
]
