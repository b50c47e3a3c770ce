"""LoRA defaults for JRT-RNN / Based models (PEFT is optional: imported when a config is built)."""

from __future__ import annotations

from typing import Any

# Every `nn.Linear` of the mixers and MLPs. `JRTRNNShortConv.conv` is a depthwise Conv1d (groups = channels): a
# low-rank update of a (channels, 1, kernel) weight is meaningless, and PEFT rejects it unless the rank divides the
# number of groups. The tied `lm_head` / `embed_tokens` are left out so the adapter does not untie them.
LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj",  # sliding-window and linear attention
    "k_enc_proj", "v_enc_proj",  # JRT prefix encoder projections
    "in_proj", "out_proj",  # gated short convolution
    "gate_proj", "up_proj", "down_proj",  # SwiGLU MLP
)


def default_lora_config(**overrides: Any):
    """A `peft.LoraConfig` for JRT-RNN / Based models: rank 8, alpha 16, on every Linear projection.

    Targets `LORA_TARGET_MODULES`; the depthwise convolution cannot take LoRA (see there) and stays frozen unless you
    list `"conv"` in `modules_to_save`. Keyword arguments override any `LoraConfig` field.

    Example:
        >>> from peft import get_peft_model
        >>> model = get_peft_model(model, default_lora_config(r=16))
    """
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError("`default_lora_config` needs PEFT: `pip install peft`.") from error
    values = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGET_MODULES), task_type="CAUSAL_LM")
    values.update(overrides)
    return LoraConfig(**values)


__all__ = ["LORA_TARGET_MODULES", "default_lora_config"]
