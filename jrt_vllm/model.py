"""JRT-RNN / Based as a vLLM model: serves the folders that `save_pretrained` and `jrt convert` write.

The blocks are `modeling_jrt`'s (pre-norm, fp32 residual stream, SwiGLU MLP, RMSNorm) with vLLM's parallel layers for
the dense parts; the mixers and their per-request states are `jrt_vllm.mixers`, the mapping of vLLM's flattened batch
onto them `jrt_vllm.batch_plan`.

The JRT prefix (docs/serving.md, "The JRT prefix", "Preemption"): a request's first forward reads its whole prompt,
with the transformers model's fill in front of a short one (`JRTRNNForCausalLM.fill`), which never reaches vLLM;
later forwards are O(1) recurrent steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.forward_context import get_forward_context, override_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.model_executor.models.utils import AutoWeightsLoader, extract_layer_index, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors

from modeling_jrt.configuration_jrt import JRTRNNConfig
from modeling_jrt.kernel_choice import KernelChoice
from modeling_jrt.modeling_jrt import JRTRNNRMSNorm
from modeling_jrt.prefix_fill import check_prefix_strategy, fill_prefix, never_generated_ids, plan_prefix

from .batch_plan import DECODE_STEP, ForwardPlan, forward_metadata, is_decode_only, plan_batch
from .mixers import MIXER_CLASSES
from .prompt_lengths import QUALIFIED_NAME, tracker_for
from .weights import StackedWeights

logger = logging.getLogger(__name__)


class JRTMLP(StackedWeights, nn.Module):
    """`JRTRNNMLP` (same weights) with vLLM's layers: gate and up projections in one column-parallel matmul, fused
    SiLU-and-multiply, row-parallel down projection."""

    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: JRTRNNConfig, prefix: str):
        super().__init__()
        self.prefix = prefix
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False,
                                                       prefix=f"{prefix}.gate_up_proj", return_bias=False)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj",
                                           return_bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden_states)))


class JRTRMSNorm(JRTRNNRMSNorm):
    """`JRTRNNRMSNorm` (same weight, same arithmetic) in one pass over the batch: its `forward` cuts long inputs into
    token chunks by a size-dependent loop, which a graph traced once for every batch size must not contain. A vLLM
    batch is bounded by `max_num_batched_tokens`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.normalize(hidden_states)


class JRTDecoderLayer(nn.Module):
    """Pre-norm block on an fp32 residual stream: r += mixer(norm(r)); r += mlp(norm(r)) (`JRTRNNDecoderLayer`)."""

    def __init__(self, config: JRTRNNConfig, prefix: str, plans: ForwardPlan):
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        self.layer_type = config.mixer_types[layer_idx]
        self.input_layernorm = JRTRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = MIXER_CLASSES[self.layer_type](config, layer_idx, f"{prefix}.mixer", plans)
        has_mlp = config.intermediate_size > 0
        self.post_attention_layernorm = JRTRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if has_mlp else None
        self.mlp = JRTMLP(config, f"{prefix}.mlp") if has_mlp else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.mixer(self.input_layernorm(hidden_states)).float()
        if self.mlp is None:
            return hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)).float()


@support_torch_compile(dynamic_arg_dims={"input_ids": 0})
class JRTModel(nn.Module):
    """Embeddings, blocks, final norm (`JRTRNNModel`'s names, so the safetensors load by them). When the engine
    compiles, the embedding, norms, residual stream and MLPs are traced once, for every batch size, around the mixers'
    opaque `jrt_vllm::mix` ops."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", plans: ForwardPlan):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        _, _, self.layers = make_layers(
            config.num_hidden_layers, lambda prefix: JRTDecoderLayer(config, prefix, plans), prefix=f"{prefix}.layers"
        )
        self.norm = JRTRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # One kernel choice for the model (`modeling_jrt.kernel_choice`), shared by its mixers and norms.
        self.kernels = KernelChoice(config=config)
        self.kernels.install(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids).float()  # the residual stream stays fp32
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)


def _prefix_strategy(model_path: str, config: JRTRNNConfig) -> str:
    """`config.prefix_strategy`, or the `prefix_strategy` of an older folder's generation_config.json (jrt-rnn 0.2
    saved it there; `JRTRNNForCausalLM` reads it the same way)."""
    from transformers import GenerationConfig

    try:
        legacy = getattr(GenerationConfig.from_pretrained(model_path), "prefix_strategy", None)
    except OSError:  # no generation_config.json
        legacy = None
    return check_prefix_strategy(config.prefix_strategy if legacy is None else legacy)


class JRTRNNForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    """vLLM model for the `JRTRNNForCausalLM` folders that `save_pretrained` and `jrt convert` write."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("jrt_vllm splits JRT-RNN / Based over devices by tensor parallelism only: "
                                      "pipeline parallelism is not implemented (got "
                                      f"pipeline_parallel_size={parallel.pipeline_parallel_size}); use "
                                      "tensor_parallel_size, or data parallelism (one engine per device).")
        if vllm_config.speculative_config is not None:
            raise NotImplementedError("jrt_vllm does not support speculative decoding (the state cannot roll back).")
        self.config = config
        self.vllm_config = vllm_config
        self.is_prefix = config.is_prefix_model
        self.prefix_strategy = _prefix_strategy(vllm_config.model_config.model, config) if self.is_prefix else "none"
        if self.prefix_strategy == "pad" and config.prefix_pad_token_id is None:
            raise ValueError("prefix_strategy='pad' needs `prefix_pad_token_id` in config.json (220 in the released "
                             "models), or another `prefix_strategy` in config.json.")
        self.plans = ForwardPlan()
        self.max_compiled_rows = vllm_config.scheduler_config.max_num_batched_tokens  # vLLM's compile ranges
        self.model = JRTModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), plans=self.plans)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.suppressed_ids = never_generated_ids(config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _prompt_lengths(self) -> dict[int, int] | None:
        """Each request's original prompt length by its place in this forward (`jrt_vllm.prompt_lengths`), or None
        for a causal model (its recompute is exact without it) or when the tracker is not loaded (warned once)."""
        if not self.is_prefix:
            return None
        tracker = tracker_for(self.vllm_config)
        if tracker is None:
            if not getattr(self, "_warned_no_tracker", False):
                self._warned_no_tracker = True
                logger.warning(
                    "jrt_vllm: the prompt-length tracker (%s) is not among this engine's logits processors, so a "
                    "preempted request whose prompt is shorter than prefix_length=%d would be recomputed with its "
                    "generated tokens inside its prefix. Keep jrt_vllm's engine settings (do not replace "
                    "`logits_processors` after the engine is configured).",
                    QUALIFIED_NAME, self.config.prefix_length,
                )
            return None
        return tracker.lengths

    def fill(self, tokens: torch.Tensor, prompt_length: int | None = None
             ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """The tokens `(T,)` of a request's first forward in the model's layout, with the JRT prefix fill in front,
        the rows its encoder reads and the keys its linear attention reads (`(F + T,)` bool, False at the `"pad"`
        fill; None when it reads every key): the transformers model's own prefix rule (`plan_prefix`, `fill_prefix`),
        on a batch of one. `prompt_length`: where its prompt ends (None: all T tokens are prompt); the tokens after it
        (a preempted request's generated tokens) are read causally."""
        if not self.is_prefix:
            return tokens, 0, None
        prompt_lengths = None if prompt_length is None or prompt_length >= tokens.shape[0] else prompt_length
        plan = plan_prefix(self.config, None, 1, tokens.shape[0], tokens.device, prompt_lengths=prompt_lengths,
                           strategy=self.prefix_strategy)
        filled_ids, _, _, key_mask = fill_prefix(plan, tokens[None], None, None)
        masked = key_mask is not None and plan.fill_columns > 0
        return filled_ids[0], int(plan.prefix_lengths[0]), key_mask[0].bool() if masked else None

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        if input_ids is None:
            raise NotImplementedError("jrt_vllm reads token ids (the JRT fill is made of tokens), not embeddings.")
        metadata = forward_metadata()
        if metadata is None:  # vLLM's profiling run: the mixers read the plan None
            return self.model(input_ids)
        if is_decode_only(metadata):  # nothing planned on the host: no host read, the same launches at every step
            expanded_ids, plan, backbone_context = input_ids, DECODE_STEP, nullcontext()
        else:
            expanded_ids, plan = plan_batch(input_ids, metadata, self.fill, self._prompt_lengths())
            # Rows of its own (the fill, no padding): no CUDA graph, nor a compiled backbone past them (docs/serving.md)
            context = get_forward_context()
            uncompiled = context.skip_compiled or len(expanded_ids) > self.max_compiled_rows
            backbone_context = override_forward_context(
                replace(context, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_compiled=uncompiled))
        self.plans.plan = plan  # what every mixer of this forward reads (`JRTStateLayer.mix`)
        try:
            with backbone_context:
                hidden_states = self.model(expanded_ids)
        finally:
            self.plans.plan = None
        if plan is DECODE_STEP:  # one row per token, as vLLM gave them
            return hidden_states
        output = hidden_states.new_zeros(input_ids.shape[0], hidden_states.shape[-1])
        output[: plan.input_rows.shape[0]] = hidden_states[plan.input_rows]
        return output

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states.to(self.lm_head.weight.dtype))
        # Padded vocabulary rows and [MASK] are never generated (`generate()`'s suppress_tokens).
        if logits is not None and self.suppressed_ids:
            logits[:, self.suppressed_ids] = float("-inf")
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The safetensors of a `save_pretrained` / `jrt convert` folder, by their own names (`jrt_vllm.weights`). A
        tied head is loaded once, as the embedding."""
        return AutoWeightsLoader(self).load_weights(weights)


__all__ = ["JRTRNNForCausalLM"]