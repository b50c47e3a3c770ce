"""Checks at the model's door: the cache, the padding mask, the positions, the inputs and the labels of a forward.

Each refuses, in one line naming the argument and the fix, what would otherwise change the outputs silently or fail
deep inside a layer. Checks that read tensor values skip `torch.compile` tracing (and decode steps where they can).
"""

from __future__ import annotations

import torch

from .cache import JRTRNNCache
from .configuration_jrt import JRTRNNConfig


def resolve_cache(cache: object, past_key_values: object, config: JRTRNNConfig, batch_size: int) -> JRTRNNCache | None:
    """The cache of a forward of `batch_size` rows, from `cache=` or its older name `past_key_values=`: the one check
    of the cache. Anything but a `JRTRNNCache` of this model's layout and rows is refused with the fix."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Pass the cache once, as `cache=` or as `past_key_values=`, not both.")
    cache = cache if cache is not None else past_key_values
    if cache is None:
        return None
    if not isinstance(cache, JRTRNNCache):
        raise ValueError(f"The cache is a {type(cache).__name__}; this model keeps a constant-size recurrent state in "
                         "a `JRTRNNCache`: pass `JRTRNNCache(model.config)`, the cache a forward with "
                         "`use_cache=True` returned, or none. Methods that inject attention key/value prefixes, such "
                         "as PEFT prefix tuning (`PrefixTuningConfig`), cannot work with JRT-RNN / Based models; use "
                         "prompt tuning (`PromptTuningConfig`) or LoRA instead.")
    cache.check_layout(config)
    if cache.has_state and cache.num_rows != batch_size:
        raise ValueError(f"The cache holds {cache.num_rows} rows but the input has {batch_size}: continue with the "
                         "same rows, or reshape the cache first (`cache.batch_repeat_interleave(n)`, "
                         "`cache.reorder_cache(rows)`).")
    return cache


def check_attention_mask(
    attention_mask: torch.Tensor, batch_size: int, seq_len: int, cache: JRTRNNCache | None, *,
    for_generation: bool = False,
) -> None:
    """The one check of a padding mask: it covers the cached and this forward's tokens, holds 0 / 1 only, no hole in
    a row's run of tokens, and the padding the cache read (values outside decode steps and torch.compile tracing).
    `for_generation`: a `generate()` prompt's mask, checked for what generation adds: every row has a token, and
    padding is on the left (generation appends at the right end)."""
    if attention_mask.ndim != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(f"`attention_mask` must be a 2D (batch_size, past + seq_len) = ({batch_size}, ...) padding "
                         f"mask, got shape {tuple(attention_mask.shape)}.")
    if torch.compiler.is_compiling():
        return
    if for_generation:
        if attention_mask.shape[1] == 0:
            return
        empty = (attention_mask == 0).all(-1)
        if bool(empty.any()):
            raise ValueError(f"Rows {empty.nonzero().flatten().tolist()} of the batch are empty (their "
                             "`attention_mask` is all 0): give every row at least one token.")
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("generate() needs left-padded prompts (padding first, then the prompt): set "
                             "`tokenizer.padding_side = 'left'` before tokenizing the batch.")
        return
    past = 0 if cache is None else cache.num_read
    if attention_mask.shape[1] != past + seq_len:
        raise ValueError(f"`attention_mask` has {attention_mask.shape[1]} columns but the cache holds {past} tokens "
                         f"and the input {seq_len}: pass one mask column per token, cached and new ({past + seq_len}).")
    if past > 0 and seq_len == 1:
        return
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("`attention_mask` must hold only 0 (padding) and 1 (token); got other values. Pass a binary "
                         "mask (`mask.ne(0).long()` if any nonzero value means a token).")
    real = attention_mask.bool()
    columns = torch.arange(real.shape[1], device=real.device)
    start, tokens = real.long().argmax(-1), real.sum(-1)
    holed = ((columns >= start[:, None]) & (columns < (start + tokens)[:, None])) != real
    if bool(holed.any()):
        rows = holed.any(-1).nonzero().flatten().tolist()
        raise ValueError(f"Rows {rows[:8]} of `attention_mask` have padding between real tokens: give each row its "
                         "tokens in one run (left or right padding only). Padding inside a row would be neither "
                         "removed nor read: drop those tokens from the row instead.")
    if past > 0 and cache.real_tokens is not None:
        read = cache.real_tokens.to(real.device)
        if not bool((real[:, :past].sum(-1) == read).all()):
            raise ValueError("`attention_mask` marks other tokens as padding among those the cache already read than "
                             f"the forwards that read them did (real tokens per row: {read.tolist()[:8]} read, "
                             f"{real[:, :past].sum(-1).tolist()[:8]} in this mask): a read token cannot be removed; "
                             "pass the mask the cache was built with, then the new tokens' columns.")


def check_one_sequence_per_row(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Refuse packed rows: positions `(B or 1, T)` that restart between two real tokens of a row."""
    restarts = position_ids[..., 1:] < position_ids[..., :-1]
    if attention_mask is not None:
        real = attention_mask.to(position_ids.device).bool()
        restarts = restarts & real[:, 1:] & real[:, :-1]
    if bool(restarts.any()):
        raise ValueError("`position_ids` restart inside a row: packed sequences (several documents in one row, e.g. "
                         "TRL's `packing=True` / padding-free batches) are not supported: the convolutions, the "
                         "sliding window and the recurrent state would carry one document into the next, and the JRT "
                         "prefix is the row's first prompt only. Train with one sequence per row (`packing=False`).")


def check_inputs(
    config: JRTRNNConfig, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> tuple[int, int]:
    """(B, T) of the forward's input, after checking its shape at the model's door."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None and input_ids.ndim != 2:
        raise ValueError(f"`input_ids` must be (batch_size, seq_len) token ids, got shape {tuple(input_ids.shape)}.")
    if inputs_embeds is not None and (inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != config.hidden_size):
        raise ValueError(f"`inputs_embeds` must be (batch_size, seq_len, hidden_size={config.hidden_size}), got shape "
                         f"{tuple(inputs_embeds.shape)}.")
    if input_ids is not None and (input_ids.dtype.is_floating_point or input_ids.dtype.is_complex):
        raise ValueError(f"`input_ids` must be integer token ids, got {input_ids.dtype}: pass `input_ids.long()`, or "
                         "the vectors as `inputs_embeds`.")
    reference = input_ids if input_ids is not None else inputs_embeds
    if reference.shape[1] == 0:
        raise ValueError(f"The input has 0 tokens (shape {tuple(reference.shape[:2])}): pass at least one token; "
                         "`generate()` without a prompt starts from `bos_token_id`.")
    if reference.shape[0] == 0:
        raise ValueError(f"The input has 0 rows (shape {tuple(reference.shape[:2])}): pass a batch of at least one "
                         "row.")
    if input_ids is not None and input_ids.shape[1] > 1 and not torch.compiler.is_compiling():
        # A prompt, not a decode step (a check reads the data: a host synchronisation per call).
        outside = (input_ids < 0) | (input_ids >= config.vocab_size)
        if bool(outside.any()):
            raise ValueError(f"`input_ids` holds ids outside the vocabulary [0, {config.vocab_size}): "
                             f"{sorted(set(input_ids[outside].tolist()))[:8]}. Tokenize with this model's tokenizer.")
    return reference.shape[0], reference.shape[1]


def check_labels(
    labels: torch.Tensor | None, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, kwargs: dict,
    vocab_size: int,
) -> torch.Tensor | None:
    """`labels` as int64, after the one check of a forward's targets: `labels` and `kwargs["shift_labels"]`
    (pre-shifted, made int64 in `kwargs`, only with `labels`) are `(B, T)` like the input, ids in `[0, vocab_size)`
    or -100; `kwargs["num_items_in_batch"]` is positive. Values are read outside torch.compile tracing only."""
    inputs = input_ids if isinstance(input_ids, torch.Tensor) else inputs_embeds
    shape = None if not isinstance(inputs, torch.Tensor) else tuple(inputs.shape[:2])
    for name, targets in (("labels", labels), ("shift_labels", kwargs.get("shift_labels"))):
        if targets is None:
            continue
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise ValueError(f"`{name}` must be integer token ids (-100 where nothing is scored), got {targets.dtype}.")
        if shape is not None and tuple(targets.shape) != shape:
            what = ("one target per input token (the model shifts them; -100 where nothing is scored)"
                    if name == "labels" else "column t holds the target of position t (labels[:, t + 1]), the last "
                    "-100 (`labels[:, 1:]` alone is one column short)")
            raise ValueError(f"`{name}` {tuple(targets.shape)} must have the shape (batch, seq_len) of the input, "
                             f"{shape}: {what}.")
        if torch.compiler.is_compiling():
            continue
        outside = (targets != -100) & ((targets < 0) | (targets >= vocab_size))
        if bool(outside.any()):
            raise ValueError(f"`{name}` holds ids outside the vocabulary [0, {vocab_size}) that are not -100 "
                             f"(ignored): {sorted(set(targets[outside].tolist()))[:8]}. Use this model's tokenizer, "
                             "and -100 where nothing is scored.")
    if kwargs.get("shift_labels") is not None:
        if labels is None:
            raise ValueError("`shift_labels` without `labels`: pass the unshifted `labels` (B, T) as well (the model "
                             "masks the targets its JRT encoder reads by their position in the input).")
        kwargs["shift_labels"] = kwargs["shift_labels"].long()
    items = kwargs.get("num_items_in_batch")
    if items is not None and not torch.compiler.is_compiling() and bool(torch.as_tensor(items) <= 0):
        raise ValueError("`num_items_in_batch` must be > 0 (the scored targets of the whole accumulated batch), got "
                         f"{items}.")
    return None if labels is None else labels.long()


__all__ = ["check_attention_mask", "check_inputs", "check_labels", "check_one_sequence_per_row", "resolve_cache"]
