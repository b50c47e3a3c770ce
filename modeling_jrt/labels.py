"""The training-label rule: a target the JRT encoder read is never scored.

In a call with `labels`, each row's prompt ends at its first scored target (`prompt_lengths_from_labels`), and the
targets the encoder reads are set to -100 before anything computes a loss: the model's own, a `num_items_in_batch`
sum, TRL's fused LM head or a `compute_loss_func` (`apply_labels_rule`, run by the forward pre-hook
`leak_free_labels`, and by the forward itself when it is called without its hooks).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.utils import logging

from .cache import JRTRNNCache
from .configuration_jrt import JRTRNNConfig
from .inputs import check_labels
from .loss import IGNORE_INDEX, mask_before
from .prefix_fill import PrefixPlan, plan_prefix, row_spans

logger = logging.get_logger(__name__)

# Keyword arguments of transformers' loss functions (they travel in `**kwargs` of `forward`, never to the layers).
LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def leak_free_labels(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of `JRTRNNForCausalLM`: a call with `labels` gets the labels rule (`apply_labels_rule`) before
    the forward runs, so that whatever computes the loss (module docstring) scores only what the model cannot have
    read."""
    if len(args) < 6 and not isinstance(kwargs.get("labels"), torch.Tensor):
        return None  # (labels is the 6th positional argument)
    if args:  # by name, as the forward reads them (a positional attention_mask changes the plan)
        names = positional_names(type(model))[: len(args)]
        if len(names) < len(args) or any(name in kwargs for name in names):
            return None  # the forward refuses the call itself
        kwargs = {**dict(zip(names, args)), **kwargs}
    config, labels = model.config, kwargs.get("labels")
    applies = labels_rule_applies(config, kwargs.get("mlm_labels"), kwargs.get("cache"), kwargs.get("past_key_values"))
    if not isinstance(labels, torch.Tensor) or not applies:
        return None
    # The one check of the targets (`check_labels`): the forward trusts labels that come with this rule's plan.
    labels = check_labels(labels, kwargs.get("input_ids"), kwargs.get("inputs_embeds"), kwargs, config.vocab_size)
    attention_mask = kwargs.get("attention_mask")
    labels, prompt_lengths, plan, kwargs = apply_labels_rule(
        config, labels, attention_mask if isinstance(attention_mask, torch.Tensor) else None, kwargs,
        prompt_lengths=kwargs.get("prompt_lengths"), prefix_length=kwargs.get("prefix_length"),
        prefix_strategy=kwargs.get("prefix_strategy"), prefix_pad_token_id=kwargs.get("prefix_pad_token_id"),
        plan=kwargs.get("prefix_plan"),  # a caller's plan is kept, and rules the mask
    )
    # The model lays out the prefix by this plan: one plan per training step.
    return (), {**kwargs, "labels": labels, "prompt_lengths": prompt_lengths, "prefix_plan": plan}


@functools.cache
def positional_names(model_class: type) -> tuple[str, ...]:
    """The names of `model_class.forward`'s positional parameters after `self`, in order."""
    parameters = list(inspect.signature(model_class.forward).parameters.values())[1:]
    return tuple(p.name for p in parameters if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD)


def labels_rule_applies(
    config: JRTRNNConfig, mlm_labels: torch.Tensor | None, cache: object, past_key_values: object
) -> bool:
    """Whether the labels rule applies: a JRT model, a first forward (no continued cache: `cache=`, else
    `past_key_values=`), and not the JRT objective (whose collator lays out the targets itself)."""
    cache = cache if cache is not None else past_key_values
    return config.is_prefix_model and mlm_labels is None and not (isinstance(cache, JRTRNNCache) and cache.has_state)


def apply_labels_rule(
    config: JRTRNNConfig, labels: torch.LongTensor, attention_mask: torch.Tensor | None, loss_kwargs: dict, *,
    prompt_lengths: torch.Tensor | None, prefix_length: int | torch.Tensor | None, prefix_strategy: str | None,
    prefix_pad_token_id: int | None, plan: PrefixPlan | None = None,
) -> tuple[torch.LongTensor, torch.Tensor | None, PrefixPlan, dict]:
    """The labels rule (checked labels `(B, T)`): unless a `plan` is given (the hook's, or a caller's), each row's
    prompt ends at its first scored target unless `prompt_lengths` are given, and the prefix is planned from it; the
    targets the plan's encoder reads are set to -100 (in `shift_labels` too). Returns the masked labels, the prompt
    lengths, the plan and `loss_kwargs`.
    """
    planned, derived = plan is None, plan is None and prompt_lengths is None
    if derived:
        prompt_lengths = prompt_lengths_from_labels(labels, attention_mask)
    if planned:
        plan = plan_prefix(config, attention_mask, *labels.shape, labels.device, prefix_length=prefix_length,
                           prompt_lengths=prompt_lengths, strategy=prefix_strategy, pad_token_id=prefix_pad_token_id)
    masked = mask_before(labels, plan.check_rows(labels.shape[0]).encoder_end)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is not None:  # pre-shifted: column t holds the target at index t + 1
        loss_kwargs = {**loss_kwargs, "shift_labels": mask_before(shift_labels, (plan.encoder_end - 1).clamp(min=0))}
    if planned and loss_kwargs.get("num_items_in_batch") is not None and bool(((labels != masked)[:, 1:]).any()):
        logger.warning_once(
            "The labels of this batch include targets that the JRT encoder reads (inside each row's prefix): the "
            "loss ignores them, but `num_items_in_batch` (from Trainer) still counts them, which scales the loss "
            "down. Set them to -100 in the data collator (`jrt_train.ignore_prefix_targets`, or "
            "`labels[:, :prefix_length] = -100` for unpadded blocks), or use `JRTDataCollator`."
        )
    if derived and not torch.compiler.is_compiling():
        # Rows whose labels ignore their first token only (completion-only labels of a one-token prompt look like
        # `labels=input_ids`) and then lose targets the encoder reads.
        first_ignored = labels[torch.arange(labels.shape[0], device=labels.device), plan.start] == IGNORE_INDEX
        lost = ((labels != masked) & (labels != IGNORE_INDEX))[:, 1:].any(-1)
        if bool((first_ignored & lost).any()):
            logger.warning_once(
                "Some rows' labels ignore only their first token, as completion-only labels of a one-token prompt do: "
                "that cannot be told from `labels=input_ids`, so the default JRT prefix applies and the targets "
                "inside it are not scored. Pass `prompt_lengths=1` (per row, a (B,) tensor) to make the prompt the "
                "prefix."
            )
    return masked, prompt_lengths, plan, loss_kwargs


def prompt_lengths_from_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`(B,)` prompt of each row of a training batch: the tokens before its first scored target, counted from its
    first real token. A row whose first possible target is scored, or that has none, keeps its whole length."""
    batch_size, length = labels.shape
    start, _ = row_spans(attention_mask, batch_size, length, labels.device)
    columns = torch.arange(length, device=labels.device)[None]
    scored = (labels != IGNORE_INDEX) & (columns > start[:, None])  # targets: label index >= first token + 1
    first = torch.where(scored, columns, length).min(-1).values  # (B,) first scored label index, T if none
    has_leading_ignored = (first > start + 1) & (first < length)
    return torch.where(has_leading_ignored, first - start, length)


def check_jrt_objective_prefix(config: JRTRNNConfig, prefix_length: int | torch.Tensor | None) -> None:
    """The JRT objective's batch layout follows the collator's prefix length: it must be the model's."""
    if prefix_length is None:
        return
    values = prefix_length.unique().tolist() if isinstance(prefix_length, torch.Tensor) else [prefix_length]
    if values != [config.prefix_length]:
        raise ValueError(f"This JRT training batch was built for prefix_length {values}, but the model's "
                         f"config.prefix_length is {config.prefix_length}: build the collator with "
                         "`JRTDataCollator.from_config(model.config)` (or give it the model's prefix_length).")


__all__ = [
    "LOSS_KWARGS", "apply_labels_rule", "check_jrt_objective_prefix", "labels_rule_applies", "leak_free_labels",
    "prompt_lengths_from_labels",
]
