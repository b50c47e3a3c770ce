"""Engine settings that JRT-RNN / Based need, applied when vLLM builds its config for a `JRTRNNForCausalLM` folder."""

from __future__ import annotations

import logging

from vllm.config import CUDAGraphMode, VllmConfig
from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG
from vllm.model_executor.models.config import MambaModelConfig, VerifyAndUpdateConfig

from .mixers import MIX_OP
from .prompt_lengths import QUALIFIED_NAME

logger = logging.getLogger(__name__)


def piecewise_cuda_graphs(vllm_config: VllmConfig) -> None:
    """Let vLLM capture piecewise CUDA graphs only (why: `JRTRNNVllmConfig`): a mode with full graphs, asked for (with
    a warning) or the default of vLLM's optimization level (which vLLM applies after this hook), becomes PIECEWISE;
    NONE and PIECEWISE stay."""
    asked, level = vllm_config.compilation_config.cudagraph_mode, vllm_config.optimization_level
    mode = asked if asked is not None else OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"]["cudagraph_mode"]
    if mode.has_full_cudagraphs():
        if asked is not None:
            logger.warning("jrt_vllm: cudagraph_mode=%s changed to PIECEWISE for JRT-RNN / Based: vLLM would replay a "
                           "full decode graph for a fresh one-token prompt, which needs a first forward of its own "
                           "(docs/serving.md, \"CUDA graphs\").", asked.name)
        mode = CUDAGraphMode.PIECEWISE
    vllm_config.compilation_config.cudagraph_mode = mode


class JRTRNNVllmConfig(VerifyAndUpdateConfig):
    """The engine settings of JRT-RNN / Based folders (docs/serving.md: "Engine settings the plugin sets", "CUDA
    graphs", "Preemption"). `register` puts this class in vLLM's `MODELS_CONFIG_MAP`, the table vLLM's own models
    use: vLLM 0.32 has no public per-model hook.

    - the mixers' opaque ops (`jrt_vllm.mixers.mix`) join `compilation_config.splitting_ops`;
    - piecewise CUDA graphs only (`piecewise_cuda_graphs`): vLLM 0.32 picks a full graph by the batch's shape alone,
      and would replay the decode graph for a fresh one-token prompt (a silently wrong output);
    - prefix caching off: a state depends on the whole prompt (the encoder's read, a short prompt's fill);
    - prefix models: chunked prefill off (the encoder reads a request's prefix in one forward; `max_num_batched_tokens`
      raised to `max_model_len` when smaller), and `jrt_vllm.prompt_lengths.PromptLengths` joins
      `model_config.logits_processors` (a preempted request is recomputed with its original prompt's prefix).
    """

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        scheduler_config, compilation_config = vllm_config.scheduler_config, vllm_config.compilation_config
        hf_config = model_config.hf_config
        piecewise_cuda_graphs(vllm_config)
        splitting_ops = compilation_config.splitting_ops or []  # vLLM's default (None) names attention ops
        if MIX_OP not in splitting_ops:
            compilation_config.splitting_ops = [*splitting_ops, MIX_OP]
        if cache_config.enable_prefix_caching:
            logger.info("jrt_vllm: prefix caching is off for JRT-RNN / Based (a state depends on the whole prompt).")
            cache_config.enable_prefix_caching = False
        is_prefix = hf_config.is_prefix_model
        if is_prefix and scheduler_config.enable_chunked_prefill:
            logger.warning(
                "jrt_vllm: chunked prefill is off for this JRT-RNN model: its encoder reads the first prefix_length=%d "
                "tokens of each prompt in one forward, and a chunk boundary inside them would change the outputs. "
                "Prompts are prefilled whole.",
                hf_config.prefix_length,
            )
            scheduler_config.enable_chunked_prefill = False
        if not scheduler_config.enable_chunked_prefill:
            max_model_len = model_config.max_model_len
            if scheduler_config.max_num_batched_tokens < max_model_len:
                logger.warning(
                    "jrt_vllm: max_num_batched_tokens raised from %d to max_model_len=%d so that every prompt fits "
                    "one forward (or pass a smaller max_model_len).",
                    scheduler_config.max_num_batched_tokens, max_model_len,
                )
                scheduler_config.max_num_batched_tokens = max_model_len
                scheduler_config.max_num_encoder_input_tokens = max_model_len
                scheduler_config.encoder_cache_size = max_model_len
        processors = model_config.logits_processors or []
        if is_prefix and QUALIFIED_NAME not in processors:
            model_config.logits_processors = [*processors, QUALIFIED_NAME]
        MambaModelConfig.verify_and_update_config(vllm_config)


__all__ = ["JRTRNNVllmConfig", "piecewise_cuda_graphs"]
