"""The training-label rule: a target the JRT encoder read is never scored.

In a call with `labels`, each row's prompt ends at its first scored target (completion-only labels make the prompt
the prefix, `prompt_lengths_from_labels`), and the targets inside the prefix the encoder reads (`encoder_end`) are
set to -100 before anything computes a loss: the model's own, a `num_items_in_batch` sum, TRL's fused LM head or a
`compute_loss_func` (`leak_free_labels`, a forward pre-hook of `JRTRNNForCausalLM`).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from .cache import JRTRNNCache
from .configuration_jrt import JRTRNNConfig
from .inputs import check_labels
from .loss import IGNORE_INDEX, mask_before
from .prefix_fill import plan_prefix, row_spans

logger = logging.get_logger(__name__)

# Keyword arguments of transformers' loss functions (they travel in `**kwargs` of `forward`, never to the layers).
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def leak_free_labels(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of `JRTRNNForCausalLM` (a public `nn.Module` hook): in a call with `labels` (and no
    `mlm_labels`), add each row's `prompt_lengths` (`prompt_lengths_from_labels`) and set to -100 the labels of the
    targets the JRT encoder will read, so that whatever computes the loss from this call's outputs, the model's own
    loss, `num_items_in_batch`-style sums, TRL's fused LM head (which replaces `forward` and calls the backbone
    without labels) or a `compute_loss_func`, scores only what the model cannot have read."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or kwargs.get("mlm_labels") is not None:
        return None
    if not model.config.is_prefix_model:
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, JRTRNNCache) and cache.has_state:
        return None
    # The one check of the targets (`check_labels`): the forward trusts labels that come with this rule's plan.
    kwargs = dict(kwargs)
    labels = check_labels(labels, args[0] if args else kwargs.get("input_ids"), kwargs.get("inputs_embeds"), kwargs,
                          model.config.vocab_size)
    attention_mask = kwargs.get("attention_mask")
    attention_mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    derived = kwargs.get("prompt_lengths") is None
    if derived:
        kwargs["prompt_lengths"] = prompt_lengths_from_labels(labels, attention_mask)
    plan = plan_prefix(
        model.config, attention_mask, *labels.shape, labels.device, prefix_length=kwargs.get("prefix_length"),
        prompt_lengths=kwargs["prompt_lengths"], strategy=kwargs.get("prefix_strategy"),
        pad_token_id=kwargs.get("prefix_pad_token_id"),
    )
    masked, kwargs = ignore_encoder_targets(labels, plan.encoder_end, kwargs)  # labels, shift_labels, the warning
    if derived and not torch.compiler.is_compiling():
        warn_one_token_prompts(labels, masked, plan.start)
    # The model lays out the prefix by this plan and masks nothing again: one plan per training step.
    return args, {**kwargs, "labels": masked, "prefix_plan": plan}


def warn_one_token_prompts(labels: torch.Tensor, masked: torch.Tensor, start: torch.Tensor) -> None:
    """Warn when a row's labels ignore its first token only and then score targets the encoder reads: completion-only
    labels of a one-token prompt look exactly like `labels=input_ids` after the shift (the first label is never a
    target), so the default prefix applies and those targets go unscored. `start`: `(B,)` each row's first token."""
    rows = torch.arange(labels.shape[0], device=labels.device)
    first_ignored = labels[rows, start] == IGNORE_INDEX
    lost = ((labels != masked) & (labels != IGNORE_INDEX))[:, 1:].any(-1)
    if bool((first_ignored & lost).any()):
        logger.warning_once(
            "Some rows' labels ignore only their first token, as completion-only labels of a one-token prompt do: "
            "that cannot be told from `labels=input_ids`, so the default JRT prefix applies and the targets inside "
            "it are not scored. Pass `prompt_lengths=1` (per row, a (B,) tensor) to make the prompt the prefix."
        )


def prompt_lengths_from_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`(B,)` prompt of each row of a training batch: the tokens before its first scored target (the first label
    that is not -100 after the shift), counted from the row's first real token, so that the encoder never reads a
    token it is scored on. A row whose first possible target is scored (`labels=input_ids`) keeps the default
    (its whole length); so does a row without any scored target. None when no row has a leading ignored run."""
    batch_size, length = labels.shape
    start, _ = row_spans(attention_mask, batch_size, length, labels.device)
    columns = torch.arange(length, device=labels.device)[None]
    scored = (labels != IGNORE_INDEX) & (columns > start[:, None])  # targets: label index >= first token + 1
    first = torch.where(scored, columns, length).min(-1).values  # (B,) first scored label index, T if none
    has_leading_ignored = (first > start + 1) & (first < length)
    full = torch.full_like(first, length)
    return torch.where(has_leading_ignored, first - start, full)


def encoder_end(
    config: JRTRNNConfig,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_lengths: torch.Tensor | None,
    prefix_length: int | torch.Tensor | None,
    cache: object,
) -> torch.Tensor | None:
    """`(B,)` label index where each row's encoder read ends, in the caller's columns (the targets before it are
    never scored; `PrefixPlan.encoder_end`), or None when the encoder read nothing of these tokens (causal model,
    continued cache)."""
    if not config.is_prefix_model or (isinstance(cache, JRTRNNCache) and cache.has_state):
        return None
    # Only the encoder's tokens matter here, not the fill (no fill token is checked: the forward checks its own).
    plan = plan_prefix(config, attention_mask, *labels.shape, labels.device, prefix_length=prefix_length,
                       prompt_lengths=prompt_lengths, strategy="none")
    return plan.encoder_end


def ignore_encoder_targets(
    labels: torch.LongTensor, prefix_end: torch.Tensor, kwargs: dict
) -> tuple[torch.LongTensor, dict]:
    """`labels` (and `shift_labels`, if given) without the targets the encoder read (index < `prefix_end`, a plan's
    `encoder_end`: checked when it was planned, so not again)."""
    masked = mask_before(labels, prefix_end)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is not None:  # pre-shifted: column t holds the target at index t + 1
        kwargs = {**kwargs, "shift_labels": mask_before(shift_labels, (prefix_end - 1).clamp(min=0))}
    if kwargs.get("num_items_in_batch") is not None and bool(((labels != masked)[:, 1:]).any()):
        logger.warning_once(
            "The labels of this batch include targets that the JRT encoder reads (inside each row's prefix): the "
            "loss ignores them, but `num_items_in_batch` (from Trainer) still counts them, which scales the loss "
            "down. Set them to -100 in the data collator (`jrt_train.ignore_prefix_targets`, or "
            "`labels[:, :prefix_length] = -100` for unpadded blocks), or use `JRTDataCollator`."
        )
    return masked, kwargs


def check_jrt_objective_prefix(config: JRTRNNConfig, prefix_length: int | torch.Tensor | None) -> None:
    """The JRT objective's batch layout follows the collator's prefix length: it must be the model's."""
    if prefix_length is None:
        return
    values = prefix_length.unique().tolist() if isinstance(prefix_length, torch.Tensor) else [prefix_length]
    if values != [config.prefix_length]:
        raise ValueError(
            f"This JRT training batch was built for prefix_length {values}, but the model's "
            f"config.prefix_length is {config.prefix_length}: build the collator with "
            "`JRTDataCollator.from_config(model.config)` (or give it the model's prefix_length)."
        )


__all__ = [
    "LOSS_KWARGS",
    "check_jrt_objective_prefix",
    "encoder_end",
    "ignore_encoder_targets",
    "leak_free_labels",
    "prompt_lengths_from_labels",
    "warn_one_token_prompts",
]
