"""How transformers' own `generate()` feeds the model (`prepare_inputs_for_generation`), and its step checks."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.utils import logging

from .cache import JRTRNNCache
from .compat import leave_static_cache_unused
from .inputs import check_attention_mask
from .prefix_fill import plan_prefix

logger = logging.get_logger(__name__)


FIRST_FORWARD_ARGUMENTS = ("prefix_length", "prompt_lengths", "prefix_strategy", "prefix_pad_token_id")
"""`forward` arguments that lay out the JRT prefix of a sequence's first forward (`prefix_fill.plan_prefix`)."""


class JRTRNNGenerationMixin:
    """The generation hook of `JRTRNNForCausalLM` (mixed in before transformers' `GenerationMixin`)."""

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, next_sequence_length: int | None = None, cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False, past_key_values: Cache | None = None, use_cache: bool | None = None,
        **kwargs,
    ) -> dict:
        """The inputs of one forward of `generate()` (transformers' public hook; nothing else is overridden).

        - A cache transformers built for the call is replaced by a `JRTRNNCache`; only unread tokens are fed.
        - RoPE positions are the model's own: `generate()`'s `position_ids` are not forwarded.
        - Decode steps feed the newest token alone, without mask or host read: fixed shapes for a compiled decode.
        - `use_cache=False` recomputes each step, a JRT model's first forward still returns a cache for its
          `PrefixPlan` (not with `prompt_lengths`), so the encoder never reads a generated token.
        - `prefill_chunk_size`: a first chunk that does not hold every row's prefix is read again with the next
          (`JRTRNNCache.pending_prefill`), so chunked and one-shot prefills read the same prefix.
        """
        # `cache=` and `past_key_values=` both reach here when a caller names the cache the other release's way;
        # generate() then measured `next_sequence_length` against its own (empty) cache: slice by our count instead.
        if isinstance(past_key_values, JRTRNNCache) and cache is not None and cache is not past_key_values:
            cache, past_key_values = past_key_values, cache
        if isinstance(cache, JRTRNNCache) and past_key_values is not None and past_key_values is not cache:
            next_sequence_length = next_sequence_length if next_sequence_length == 1 else None
            if is_first_iteration and next_sequence_length is None:
                # generate() sliced nothing: the input is the caller's whole sequence, which must extend the cache's.
                given = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
                width = attention_mask.shape[1] if attention_mask is not None else given
                if cache.num_read and width <= cache.num_read:
                    raise ValueError(stale_cache_message(cache.num_read, width))
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, JRTRNNCache):
            if isinstance(cache, StaticCache):
                leave_static_cache_unused(cache)
            elif not isinstance(cache, DynamicCache):
                logger.warning_once(
                    f"generate() built a {type(cache).__name__} (`cache_implementation`); JRT-RNN / Based keep a "
                    "constant-size `JRTRNNCache` of their own instead (the recurrent state and a window of "
                    "`sliding_window - 1` keys), which is what this generation uses."
                )
            cache = None
        reads_embeds = inputs_embeds is not None and (is_first_iteration or cache is None or not cache.has_state)
        if (
            reads_embeds and input_ids is not None and input_ids.shape[1] == 0 and attention_mask is not None
            and attention_mask.shape[1] < inputs_embeds.shape[1] and (cache is None or not cache.has_state)
        ):
            # generate(inputs_embeds=..., attention_mask=..., prefill_chunk_size=...) without `input_ids`: transformers
            # cuts the prompt into chunks by `input_ids` (empty here) and hands over the mask of no column at all.
            raise ValueError(f"`attention_mask` covers {attention_mask.shape[1]} of the {inputs_embeds.shape[1]} "
                             "positions of `inputs_embeds`: transformers' chunked prefill cuts the prompt by "
                             "`input_ids`, so with `prefill_chunk_size` pass the embeddings' `input_ids` too (or no "
                             "`prefill_chunk_size`).")
        sequence = inputs_embeds if reads_embeds else input_ids
        model_inputs: dict = {}

        decoding = False
        if use_cache is False:
            # Uncached generation: full recomputes; the first forward's cache carries the plan (docs/generate.md).
            new, mask, forward_cache = sequence, attention_mask, None
            states_prompts = kwargs.get("prompt_lengths") is not None
            model_inputs["use_cache"] = cache is None and self.config.is_prefix_model and not states_prompts
            if cache is not None and cache.prefix is not None:
                plan = cache.prefix
                model_inputs.update(prompt_lengths=plan.prompt, prefix_strategy=plan.strategy,
                                    prefix_pad_token_id=plan.pad_token_id)
                kwargs = {k: v for k, v in kwargs.items() if k not in ("prefix_strategy", "prefix_pad_token_id")}
        else:
            cache = JRTRNNCache(self.config) if cache is None else cache
            decoding = next_sequence_length == 1 and not is_first_iteration and cache.has_state and not reads_embeds
            if decoding:
                # A decode step: the newest token, no mask (it is real; the cache keeps the flags of what it read).
                new, mask = sequence[:, -1:].contiguous(), None
                cache.pending_prefill = None
            else:
                new = unread_columns(sequence, cache.num_read, attention_mask, next_sequence_length, reads_embeds)
                check_generation_cache(cache, sequence, attention_mask, next_sequence_length, reads_embeds,
                                       is_first_iteration)
                mask = attention_mask
            forward_cache = cache
            model_inputs["use_cache"] = True
            if not decoding and cache.pending_prefill is not None:
                # The previous forward was a prefill chunk whose prompt may go on: read it again with this chunk.
                new, mask, forward_cache = cache.take_pending_prefill(new, mask, self.config)
            if next_sequence_length is None and not forward_cache.has_state and self.config.is_prefix_model:
                # A first prefill chunk (generate() gives no length for those): read again with the next one unless it
                # holds every row's whole prefix (the encoder reads a prompt in one forward).
                plan = plan_prefix(self.config, mask, new.shape[0], new.shape[1], new.device,
                                   prefix_length=kwargs.get("prefix_length"), strategy="none")
                holds_every_prefix = bool((plan.encoder_tokens >= plan.target).all())
                forward_cache.pending_prefill = None if holds_every_prefix else (new, mask)
        model_inputs["inputs_embeds" if reads_embeds else "input_ids"] = new
        if forward_cache is not None:
            # Under the name every transformers release (and PEFT's prompt learning, which reads it) knows.
            model_inputs["past_key_values"] = forward_cache
        if mask is not None:
            model_inputs["attention_mask"] = mask
        # The JRT prefix arguments shape a sequence's first forward only: a decode step gets none (the cache holds the
        # prefix it laid out), so a compiled step does not depend on them.
        skipped = ("labels", "position_ids") + (FIRST_FORWARD_ARGUMENTS if decoding else ())
        model_inputs.update({k: v for k, v in kwargs.items() if k not in model_inputs and k not in skipped})
        device = self.device
        if device.type != "meta":
            model_inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model_inputs.items()}
        return model_inputs


def unread_columns(
    sequence: torch.Tensor, read: int, attention_mask: torch.Tensor | None, next_sequence_length: int | None,
    reads_embeds: bool,
) -> torch.Tensor:
    """The columns of `sequence` (`(B, T)` ids or `(B, T, hidden)` embeddings of a `generate()` step) that a cache
    which has read `read` of the caller's columns has not read yet.

    `generate()` passes the full sequence, or the new tokens with a mask over the full sequence, and
    `next_sequence_length` except for prefill chunks. Embeddings are the full sequence, up to the mask's columns."""
    total = sequence.shape[1]
    mask_width = attention_mask.shape[1] if attention_mask is not None else None
    if reads_embeds:
        return sequence[:, read : mask_width or total]
    if next_sequence_length is not None:
        return sequence[:, total - next_sequence_length :]
    if (total == mask_width) if mask_width is not None else (total > read):
        return sequence[:, read:]  # the full sequence: skip what the cache holds
    return sequence  # only the new tokens (a prefill chunk, or new tokens with the full mask)


def stale_cache_message(read: int, width: int) -> str:
    return (
        f"This cache has read {read} tokens, but `input_ids` has {width}: continue with the full sequence (the tokens "
        "the cache read, then the new ones), or generate from a fresh cache."
    )


def check_generation_cache(
    cache: JRTRNNCache, sequence: torch.Tensor, attention_mask: torch.Tensor | None, next_sequence_length: int | None,
    reads_embeds: bool, is_first_iteration: bool | None,
) -> None:
    """Refuse, in one line, a `generate()` step that cannot continue `cache`: input with fewer columns than the cache
    read, a beam-search cache (its rows are beams), a right-padded batch."""
    read = cache.num_read
    mask_width = attention_mask.shape[1] if attention_mask is not None else None
    # Fewer columns than the cache read: generate() says so by a length <= 0, a mask by its width.
    short = next_sequence_length != 1 and (
        (next_sequence_length is not None and next_sequence_length <= 0)
        or (mask_width is not None and mask_width <= read)
    )
    if read and not reads_embeds and short:
        width = sequence.shape[1] if mask_width is None else mask_width
        raise ValueError(stale_cache_message(read, width))
    if read and cache.holds_beams and is_first_iteration:
        raise ValueError("This cache comes from beam search: its rows hold the beams of the last step, not the "
                         "sequences generate() returned, so it cannot continue them. Continue from a greedy or "
                         "sampling cache, or generate again from the returned sequences with a fresh cache.")
    if not read and next_sequence_length is not None and attention_mask is not None:
        check_attention_mask(attention_mask, sequence.shape[0], attention_mask.shape[1], None, for_generation=True)


__all__ = [
    "FIRST_FORWARD_ARGUMENTS", "JRTRNNGenerationMixin", "check_generation_cache", "stale_cache_message",
    "unread_columns",
]
