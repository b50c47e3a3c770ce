"""The outputs of `JRTRNNModel` and `JRTRNNForCausalLM`: transformers' output classes, with the cache under the
installed release's name and its other name as an alias (`compat.add_cache_alias`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .compat import add_cache_alias


@add_cache_alias
@dataclass
class JRTRNNModelOutput(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` (its cache field is `cache` on transformers >= 5.24, `past_key_values` before)."""


@add_cache_alias
@dataclass
class JRTRNNCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` (its cache field as `JRTRNNModelOutput`'s) plus the two parts of the JRT objective
    (set only when `mlm_labels` are given).

    Args:
        ntp_loss: detached mean next-token cross-entropy of the batch.
        mlm_loss: detached mean masked-LM cross-entropy of the batch.
    """

    ntp_loss: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None


__all__ = ["JRTRNNCausalLMOutput", "JRTRNNModelOutput"]
