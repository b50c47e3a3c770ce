"""jrt_train: training helpers for JRT-RNN / Based models: the JRT-objective data collator, token packing and LoRA
defaults. Nothing here is part of the model (a converted folder ships none of it); the losses the model's forward
computes (`jrt_loss`, `ignore_prefix_targets`) live in `modeling_jrt.loss` and are re-exported here.
"""

from modeling_jrt.loss import IGNORE_INDEX, ignore_prefix_targets, jrt_loss

from .collator import MASK_SAMPLINGS, JRTDataCollator, pack_token_blocks
from .lora import LORA_TARGET_MODULES, default_lora_config

__all__ = ["IGNORE_INDEX", "LORA_TARGET_MODULES", "MASK_SAMPLINGS", "JRTDataCollator", "default_lora_config",
           "ignore_prefix_targets", "jrt_loss", "pack_token_blocks"]
