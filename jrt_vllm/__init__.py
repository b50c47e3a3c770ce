"""vLLM plugin for JRT-RNN and Based: serves the folders that `save_pretrained` and `jrt convert` write.

Installed with `pip install -e ".[vllm]"`; vLLM calls `register` through the `vllm.general_plugins` entry point, in
every process it starts. See docs/serving.md and `jrt_vllm.model`.
"""

from __future__ import annotations

ARCHITECTURE = "JRTRNNForCausalLM"


def register() -> None:
    """Register the model class, its engine settings and the `jrt_rnn` config type with vLLM and transformers."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from modeling_jrt.configuration_jrt import JRTRNNConfig

    from .config import JRTRNNVllmConfig

    AutoConfig.register(JRTRNNConfig.model_type, JRTRNNConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "jrt_vllm.model:JRTRNNForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = JRTRNNVllmConfig


__all__ = ["register"]
