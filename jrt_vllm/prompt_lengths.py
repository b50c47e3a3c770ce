"""Each running request's original prompt length, as vLLM's persistent batch tells its logits processors.

Why (docs/serving.md, "Preemption"): a preempted request is recomputed in one forward whose metadata does not say
where its prompt ended, which a short JRT-RNN prompt's encoder read and fill depend on. `BatchUpdate.added` carries
each request's prompt ids under its index in the persistent batch, also its place in the model's forward (decodes
first). `jrt_vllm.config` adds `PromptLengths` to the engines of JRT-RNN folders; `jrt_vllm.model` reads it.
"""

from __future__ import annotations

import weakref

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

# The fully-qualified name vLLM loads the class by (`model_config.logits_processors`).
QUALIFIED_NAME = "jrt_vllm.prompt_lengths:PromptLengths"

# The newest tracker of this process, by the id of the engine config it serves (one engine per worker process).
_trackers: dict[int, weakref.ReferenceType[PromptLengths]] = {}


class PromptLengths(LogitsProcessor):
    """A logits processor that leaves the logits alone and records each request's prompt length by batch index."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.lengths: dict[int, int] = {}
        _trackers.clear()  # an engine of this process that went away leaves nothing behind
        _trackers[id(vllm_config)] = weakref.ref(self)

    def is_argmax_invariant(self) -> bool:
        return True  # never applied to greedy rows: `apply` changes nothing anyway

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Removed, added, moved: the order `BatchUpdate` documents."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.lengths.pop(index, None)
        for index, _params, prompt_ids, _output_ids in batch_update.added:
            if prompt_ids is None:  # prompt embeddings: jrt_vllm refuses them before any forward
                self.lengths.pop(index, None)
            else:
                self.lengths[index] = len(prompt_ids)
        for first, second, direction in batch_update.moved:
            moving, other = self.lengths.pop(first, None), self.lengths.pop(second, None)
            if moving is not None:
                self.lengths[second] = moving
            if direction == MoveDirectionality.SWAP and other is not None:
                self.lengths[first] = other


def tracker_for(vllm_config) -> PromptLengths | None:
    """The tracker of the engine that `vllm_config` configures, or None (not built yet, or not loaded)."""
    reference = _trackers.get(id(vllm_config))
    return None if reference is None else reference()


__all__ = ["QUALIFIED_NAME", "PromptLengths", "tracker_for"]
