"""jrt-rnn: JRT-RNN (prefix linear attention) and Based models for HuggingFace Transformers.

Importing this package registers `model_type = "jrt_rnn"` with `AutoConfig`, `AutoModel` and
`AutoModelForCausalLM`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_jrt import JRTRNNConfig, default_layer_types
from .linear_attention import (
    linear_attention_step,
    prefix_linear_attention,
    prefix_linear_attention_chunked,
    prefix_linear_attention_quadratic,
    taylor_feature_map,
)
from .modeling_jrt import JRTRNNCausalLMOutput, JRTRNNForCausalLM, JRTRNNModel, JRTRNNPreTrainedModel
from .prompting import (
    PROMPT_TEMPLATES,
    default_prompt,
    default_prompts,
    jrt_prompt,
    jrt_prompts,
    repeat_to_fill,
    truncate_context,
)
from .training import (
    LORA_TARGET_MODULES,
    JRTDataCollator,
    default_lora_config,
    ignore_prefix_targets,
    jrt_loss,
    pack_token_blocks,
)

AutoConfig.register(JRTRNNConfig.model_type, JRTRNNConfig, exist_ok=True)
AutoModel.register(JRTRNNConfig, JRTRNNModel, exist_ok=True)
AutoModelForCausalLM.register(JRTRNNConfig, JRTRNNForCausalLM, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "LORA_TARGET_MODULES",
    "JRTDataCollator",
    "JRTRNNCausalLMOutput",
    "JRTRNNConfig",
    "JRTRNNForCausalLM",
    "JRTRNNModel",
    "JRTRNNPreTrainedModel",
    "PROMPT_TEMPLATES",
    "default_prompt",
    "default_prompts",
    "default_layer_types",
    "default_lora_config",
    "ignore_prefix_targets",
    "jrt_loss",
    "jrt_prompt",
    "jrt_prompts",
    "linear_attention_step",
    "pack_token_blocks",
    "prefix_linear_attention",
    "prefix_linear_attention_chunked",
    "prefix_linear_attention_quadratic",
    "repeat_to_fill",
    "taylor_feature_map",
    "truncate_context",
]
