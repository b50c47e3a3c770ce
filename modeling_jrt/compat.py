"""What differs between the transformers releases this package supports (see pyproject's `transformers` range).

transformers 5.24 renamed the cache of model inputs and outputs from `past_key_values` to `cache`. The model accepts
both names as forward arguments and returns its cache under the name the installed release reads
(`CausalLMOutputWithPast`'s own field), so `GenerationMixin.generate` finds it on every release. Nothing here touches
a private name: the field is read from the public output dataclass.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_FIELD = "cache" if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
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


def keep_last_logits(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of `hidden_states` `(B, T, hidden)` to compute logits for: the last `logits_to_keep` (0 = all),
    or those a 1D index tensor selects (transformers' `logits_to_keep` convention)."""
    if isinstance(logits_to_keep, int):
        return hidden_states if logits_to_keep == 0 else hidden_states[:, -logits_to_keep:]
    if logits_to_keep.dim() == 2:  # (B, K) positions per row
        index = logits_to_keep.to(hidden_states.device)[:, :, None].expand(-1, -1, hidden_states.shape[-1])
        return torch.gather(hidden_states, 1, index)
    return hidden_states[:, logits_to_keep]


__all__ = ["CACHE_FIELD", "add_cache_alias", "keep_last_logits", "model_output", "output_cache"]
