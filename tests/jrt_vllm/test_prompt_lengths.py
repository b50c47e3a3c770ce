"""`jrt_vllm.prompt_lengths.PromptLengths`: the prompt length of each request by its index in vLLM's persistent batch,
through the batch updates vLLM sends its logits processors."""

from __future__ import annotations

import pytest
import torch

import vllm_models  # noqa: F401  (vLLM's in-process settings, before vLLM is imported)

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")

from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from jrt_vllm.prompt_lengths import PromptLengths, tracker_for  # noqa: E402


def update(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved))


def test_prompt_lengths_follow_the_batch_updates():
    config = object()
    tracker = PromptLengths(config, torch.device("cpu"), False)
    assert tracker_for(config) is tracker and tracker_for(object()) is None
    params = vllm.SamplingParams()
    tracker.update_state(None)  # nothing changed
    tracker.update_state(update(3, added=[(0, params, [5, 6, 7], []), (1, params, [8], []), (2, params, [1, 2], [])]))
    assert tracker.lengths == {0: 3, 1: 1, 2: 2}
    # A resumed (preempted) request comes back with its output tokens beside its prompt: its prompt length counts.
    tracker.update_state(update(3, removed=[1], added=[(1, params, [4, 4, 4, 4], [9, 9])]))
    assert tracker.lengths == {0: 3, 1: 4, 2: 2}
    tracker.update_state(update(3, moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert tracker.lengths == {0: 2, 1: 4, 2: 3}
    tracker.update_state(update(2, removed=[1], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    assert tracker.lengths == {0: 2, 1: 3}
    logits = torch.randn(2, 5)
    assert tracker.apply(logits) is logits and tracker.is_argmax_invariant()
