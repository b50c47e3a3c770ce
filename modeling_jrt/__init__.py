"""jrt-rnn: JRT-RNN (prefix linear attention) and Based models for HuggingFace Transformers.

Importing this package registers `model_type = "jrt_rnn"` with `AutoConfig`, `AutoModel` and
`AutoModelForCausalLM`. The package holds the model only (configuration, modeling, its cache, the prefix fill,
linear-attention ops, the losses forward computes): it is what a saved folder ships as remote code. Training helpers
are in `jrt_train`, prompt builders in `jrt_prompt`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import JRTRNNCache
from .configuration_jrt import MIXER_TYPES, JRTRNNConfig, default_layer_types, default_mixer_types
from .kernel_choice import KernelChoice
from .linear_attention import (
    linear_attention_step, prefix_linear_attention, prefix_linear_attention_chunked, prefix_linear_attention_quadratic,
    taylor_feature_map,
)
from .loss import IGNORE_INDEX, ignore_prefix_targets, jrt_loss
from .modeling_jrt import JRTRNNForCausalLM, JRTRNNModel, JRTRNNPreTrainedModel
from .outputs import JRTRNNCausalLMOutput

AutoConfig.register(JRTRNNConfig.model_type, JRTRNNConfig, exist_ok=True)
AutoModel.register(JRTRNNConfig, JRTRNNModel, exist_ok=True)
AutoModelForCausalLM.register(JRTRNNConfig, JRTRNNForCausalLM, exist_ok=True)

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX", "MIXER_TYPES", "JRTRNNCache", "JRTRNNCausalLMOutput", "JRTRNNConfig", "JRTRNNForCausalLM",
    "JRTRNNModel", "JRTRNNPreTrainedModel", "KernelChoice", "default_layer_types", "default_mixer_types",
    "ignore_prefix_targets", "jrt_loss", "linear_attention_step", "prefix_linear_attention",
    "prefix_linear_attention_chunked", "prefix_linear_attention_quadratic", "taylor_feature_map",
]
