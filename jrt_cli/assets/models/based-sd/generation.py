"""JRT prefix handling for `JRTRNNForCausalLM.generate()` (docs/reference_architecture.md §2.1 "Prefix padding
leaks" for the reference protocol, §3 for what differs).

`forward()` never pads: its linear-attention encoder reads each row's first `min(prefix_length, tokens)` tokens, counted
from the row's first real token (`prefix_length` may be per row). `generate()` prepares short prompts so that the
encoder region is filled, then hands over to transformers' standard `GenerationMixin.generate` (greedy, sampling, beam
search, streamers, stopping criteria and static caches are untouched). For a prompt of `L < prefix_length` real
tokens, `prefix_strategy` is

    "pad"     prepend `prefix_length - L` copies of `prefix_pad_token_id`. Convolutions and sliding attention read them
              as ordinary tokens and RoPE positions count from the first pad (the reference's protocol); the linear
              attention masks them through `linear_attention_mask`, as `prefix_pad_masking` says.
    "repeat"  fill the prefix with the prompt repeated (JRT-Prompt style), ending with the prompt itself.
    "none"    leave the prompt as it is: the encoder reads the prompt only.

Prompts of `L >= prefix_length` tokens are never changed. In a left-padded batch each row is filled on its own and the
batch is re-padded on the left; the prefill reads each row's own prefix (the per-row encoder range of `forward()`), so
every row generates as it would alone:

    row (L=3, prefix 6):    [batch pads, attention_mask 0] [fill x 3] [p0 p1 p2] -> generated tokens
    row (L=7):                                              [p0 ... p6]          -> generated tokens

The fill never reaches the caller: returned `sequences` are the caller's prompt followed by the generated tokens, the
streamer sees the caller's prompt, `scores`/`logits` cover generated tokens only (as always), and logits processors
(`repetition_penalty`, `no_repeat_ngram_size`, ...) and the caller's stopping criteria see the caller's tokens
(`CallerView`). Counting limits: `max_length`/`min_length` count the caller's prompt (they are shifted by the fill).

The cache carries what it has read (`CachedPrompt`, the attribute `cache.jrt_prompt`: the fill, the caller's tokens,
the encoder's per-row prefix), so it survives `copy.deepcopy` and `reorder_cache`. `generate(cache=out.cache,
input_ids=<out.sequences + new tokens>)` continues seamlessly; `input_ids` that do not start with the tokens the cache
read raise `ValueError` (they would be read a second time). A second turn appended this way is read causally: the JRT
encoder read the first turn's prefix only. To let the encoder read the whole conversation, generate from the full
text with a fresh cache.

This file ships with the Hub remote code: torch and transformers only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import overload

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin
from transformers.generation import (
    BaseStreamer,
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerateOutput

from .configuration_jrt import JRTRNNConfig

# How `generate()` can fill prompts shorter than the JRT prefix (`prefix_strategy`, a generation default), and the
# strategy used when neither the call nor the generation config says.
PREFIX_STRATEGIES = ("pad", "repeat", "none")
DEFAULT_PREFIX_STRATEGY = "pad"


def never_generated_ids(config: JRTRNNConfig) -> list[int]:
    """The ids generation must never emit, sorted: every id `>= config.generation_vocab_size` (LM-head rows that only
    pad the vocabulary, e.g. 50257..50263 of the released models) and `config.mask_token_id` (the [MASK] token of the
    JRT training objective). The model's generation config carries them as `suppress_tokens` (saved in
    `generation_config.json`), so transformers' own `SuppressTokensLogitsProcessor` applies them on every path."""
    ids = set() if config.generation_vocab_size is None else set(range(config.generation_vocab_size, config.vocab_size))
    if config.mask_token_id is not None:
        ids.add(config.mask_token_id)
    return sorted(ids)


def suppress_never_generated(config: JRTRNNConfig, generation_config: GenerationConfig, kwargs: dict) -> None:
    """Add `never_generated_ids(config)` to the `suppress_tokens` of this call (in `kwargs`) when the generation config
    in use lacks some, e.g. a `generation_config.json` saved before they were recorded or a config changed since."""
    given = kwargs.get("suppress_tokens")
    current = set(given if given is not None else (generation_config.suppress_tokens or []))
    missing = set(never_generated_ids(config)) - current
    if missing:
        kwargs["suppress_tokens"] = sorted(current | missing)


@overload
def repeat_to_fill(prompt_ids: torch.Tensor, length: int) -> torch.Tensor: ...
@overload
def repeat_to_fill(prompt_ids: list[int], length: int) -> list[int]: ...
def repeat_to_fill(prompt_ids: torch.Tensor | list[int], length: int) -> torch.Tensor | list[int]:
    """Fill `length` tokens by repeating the prompt so that its last full copy ends at the end.

    `out[i] = prompt[(i - length) mod T]`: the result ends with the whole prompt, is preceded by as many whole
    copies as fit, and starts with the tail of one more copy when `length` is not a multiple of `T`. JRT-RNN's
    `"repeat"` prefix strategy fills its non-causal prefix this way, so that the prompt is read twice (or more)
    and generation continues right after an intact copy.

    Args:
        prompt_ids: `(T,)` tensor or list of token ids, or a `(B, T)` tensor whose rows are repeated independently
            (every row as it is: strip left padding first and call once per row when the lengths differ).
        length: Output length along the last dimension; at least `T`.

    Returns:
        `(length,)` or `(B, length)` tensor on `prompt_ids`' device and dtype, or a list for a list input.

    Example:
        >>> repeat_to_fill([1, 2, 3], 8)
        [2, 3, 1, 2, 3, 1, 2, 3]
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() not in (1, 2):
            raise ValueError(
                f"`prompt_ids` must be a (T,) or (B, T) tensor, got shape {tuple(prompt_ids.shape)}."
            )
        prompt_length = prompt_ids.shape[-1]
    elif isinstance(prompt_ids, list):
        prompt_length = len(prompt_ids)
    else:
        raise TypeError(f"`prompt_ids` must be a torch.Tensor or a list of ints, got {type(prompt_ids).__name__}.")
    if prompt_length == 0:
        raise ValueError("`prompt_ids` is empty: there is nothing to repeat.")
    if length < prompt_length:
        raise ValueError(
            f"`length` ({length}) is shorter than the prompt ({prompt_length} tokens): repeating cannot keep a "
            f"whole copy; truncate the prompt or use a longer length."
        )
    if isinstance(prompt_ids, list):
        return [prompt_ids[(i - length) % prompt_length] for i in range(length)]
    index = (torch.arange(length, device=prompt_ids.device) - length) % prompt_length  # (length,)
    return prompt_ids[..., index]  # (length,) or (B, length)


@dataclass
class PreparedPrompt:
    """A batch of prompts after the prefix strategy, in the layout the model reads.

    Attributes:
        input_ids: `(B, T')` prepared ids, or None when generating from embeddings only.
        inputs_embeds: `(B, T', hidden)` prepared embeddings, or None.
        attention_mask: `(B, T')` 1 for every token the model reads (fill included), 0 for batch padding.
        linear_attention_mask: `(B, T')` 0 at the "pad" fill (the linear attention ignores it), or None.
        original_length: T of the caller's prompt (0 for embeddings only: then no prompt ids are returned).
    """

    input_ids: torch.LongTensor | None
    inputs_embeds: torch.Tensor | None
    attention_mask: torch.LongTensor
    linear_attention_mask: torch.LongTensor | None
    original_length: int

    @property
    def length(self) -> int:
        return self.attention_mask.shape[1]


def prepare_prefix(
    input_ids: torch.LongTensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    *,
    prefix_length: int,
    strategy: str,
    prefix_pad_token_id: int | None,
    batch_pad_token_id: int,
    embed: Callable[[torch.LongTensor], torch.Tensor],
    vocab_size: int,
) -> PreparedPrompt | None:
    """Apply `strategy` to each row of a left-padded batch; None when no row needs a fill.

    Args:
        input_ids: `(B, T)` prompt ids, or None.
        inputs_embeds: `(B, T, hidden)` prompt embeddings, or None (at least one of the two is given).
        attention_mask: `(B, T)` 1 for prompt tokens, 0 for left padding; None = no padding.
        prefix_length: Encoder length `M` of the model.
        strategy: `"pad"`, `"repeat"` or `"none"`.
        prefix_pad_token_id: Fill token of `"pad"`.
        batch_pad_token_id: Id written at batch-padding positions (never read: `attention_mask` is 0 there).
        embed: The model's input embedding, to fill embeddings with the pad token.
        vocab_size: Rows of the embedding (the pad token must be one of them).
    """
    if strategy not in PREFIX_STRATEGIES:
        raise ValueError(f"`prefix_strategy` must be one of {list(PREFIX_STRATEGIES)}, got {strategy!r}.")
    reference = input_ids if input_ids is not None else inputs_embeds
    batch_size, length = reference.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones(batch_size, length, dtype=torch.long, device=reference.device)
    if attention_mask.ndim != 2 or attention_mask.shape != (batch_size, length):
        raise ValueError(
            f"`attention_mask` must be (B, T) = ({batch_size}, {length}); got {tuple(attention_mask.shape)}."
        )
    if strategy == "none" or length == 0:
        return None
    real = attention_mask.bool()
    if bool((real[:, :-1] & ~real[:, 1:]).any()):
        raise ValueError(
            "JRT generation needs left-padded prompts (padding first, then the prompt). Set "
            "`tokenizer.padding_side = 'left'` before tokenizing the batch."
        )
    lengths = real.sum(-1).tolist()
    fills = [max(prefix_length - n, 0) if n > 0 else 0 for n in lengths]
    if not any(fills):
        return None
    if strategy == "pad" and prefix_pad_token_id is None:
        raise ValueError(
            "prefix_strategy='pad' needs a pad token: pass `prefix_pad_token_id=` to generate() or set "
            "`config.prefix_pad_token_id` (220, GPT-2's ' ', in the reference)."
        )
    if strategy == "pad" and not 0 <= prefix_pad_token_id < vocab_size:
        raise ValueError(
            f"prefix_pad_token_id={prefix_pad_token_id} is not a token of this model (vocab_size={vocab_size}): "
            "pass another `prefix_pad_token_id=` or `prefix_strategy='repeat'`/`'none'` to generate()."
        )
    new_length = max(n + f for n, f in zip(lengths, fills))

    def fill_rows(tensor: torch.Tensor, pad_value: torch.Tensor, batch_pad_value: torch.Tensor) -> torch.Tensor:
        rows = []
        for row, n, f in zip(tensor, lengths, fills):
            prompt = row[length - n :]
            if strategy == "repeat":  # works for ids (L,) and embeddings (L, hidden) alike
                filled = prompt[repeat_to_fill(torch.arange(n, device=prompt.device), n + f)]
            else:
                filled = torch.cat([pad_value.expand(f, *prompt.shape[1:]), prompt])
            padding = batch_pad_value.expand(new_length - filled.shape[0], *prompt.shape[1:])
            rows.append(torch.cat([padding, filled]))
        return torch.stack(rows)

    device = reference.device
    new_ids = new_embeds = None
    pad_id = torch.tensor([0 if prefix_pad_token_id is None else prefix_pad_token_id], device=device)
    if input_ids is not None:
        new_ids = fill_rows(input_ids, pad_id, torch.tensor([batch_pad_token_id], device=device))
    if inputs_embeds is not None:
        pad_embedding = embed(pad_id).to(inputs_embeds.dtype)  # (1, hidden)
        new_embeds = fill_rows(inputs_embeds, pad_embedding, torch.zeros_like(pad_embedding))

    new_mask = torch.zeros(batch_size, new_length, dtype=torch.long, device=device)
    linear_attention_mask = torch.ones(batch_size, new_length, dtype=torch.long, device=device)
    for index, (n, f) in enumerate(zip(lengths, fills)):
        new_mask[index, new_length - n - f :] = 1
        if strategy == "pad" and f > 0:
            linear_attention_mask[index, new_length - n - f : new_length - n] = 0
    return PreparedPrompt(
        input_ids=new_ids,
        inputs_embeds=new_embeds,
        attention_mask=new_mask,
        linear_attention_mask=linear_attention_mask if strategy == "pad" else None,
        original_length=length if input_ids is not None else 0,
    )


class PromptStrippingStreamer(BaseStreamer):
    """Forwards to `streamer`, replacing the prepared prompt of the first `put` by the caller's prompt."""

    def __init__(self, streamer: BaseStreamer, prepared_length: int, original_length: int):
        self.streamer = streamer
        self.prepared_length = prepared_length
        self.original_length = original_length
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            if value.shape[-1] == self.prepared_length:
                value = value[..., value.shape[-1] - self.original_length :]
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


def cache_has_state(cache: Cache) -> bool:
    """Whether any layer of `cache` already holds tokens (the generation continues a sequence)."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if any(layer.has_previous_state.values()):
                return True
        elif layer.is_initialized and layer.get_seq_length() > 0:
            return True
    return False


# Attribute of a `Cache` that holds its `CachedPrompt` (a plain attribute: `copy.deepcopy` and `reorder_cache` keep it).
CACHE_PROMPT_ATTRIBUTE = "jrt_prompt"


@dataclass
class CachedPrompt:
    """What a cache returned by `generate()` has read, stored on the cache itself (`cache.jrt_prompt`).

    Attributes:
        prepared: The prompt of the first call after the prefix strategy (the fill), or None when nothing was filled.
        tokens: `(B, N)` the caller's tokens the cache has read (prompt and generated tokens but the last one), in
            the caller's layout: a continuation must start with them.
        num_read: Columns of the model's (prepared) layout the cache has read: `N` plus the fill.
        prefix_lengths: `(B,)` tokens the JRT encoder read per row in the first call (counted from the row's first
            read token, fill included), or None for a causal (Based) model. Later calls never add to the encoder.
    """

    prepared: PreparedPrompt | None
    tokens: torch.LongTensor
    num_read: int
    prefix_lengths: torch.LongTensor | None

    @property
    def fill_length(self) -> int:
        """Columns the prepared layout adds in front of the caller's tokens."""
        return 0 if self.prepared is None else self.prepared.length - self.prepared.original_length


def cached_prompt(cache: Cache | None) -> CachedPrompt | None:
    """The `CachedPrompt` of a cache that `generate()` returned, or None."""
    return None if cache is None else getattr(cache, CACHE_PROMPT_ATTRIBUTE, None)


@dataclass
class CallerView:
    """Maps the model's `input_ids` (prepared prompt, then generated tokens) to what the caller sees (the caller's
    prompt, then the generated tokens), so that logits processors and stopping criteria never see the fill.

    Attributes:
        caller_ids: `(B, T)` the caller's `input_ids` of this call.
        prepared_length: Columns of the prepared prompt that replace them in the model's `input_ids`.
    """

    caller_ids: torch.LongTensor
    prepared_length: int

    def __call__(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """`(B', T')` model ids -> `(B', T + T' - prepared_length)` caller ids (rows expanded for beams/samples)."""
        caller = _expand_rows(self.caller_ids, input_ids.shape[0]).to(input_ids.device)
        return torch.cat([caller, input_ids[:, self.prepared_length :]], dim=1)


class CallerViewLogitsProcessor(LogitsProcessor):
    """Runs `processors` (all of `generate()`'s, built-in ones such as `repetition_penalty` included) on the caller's
    view of the tokens, so that the JRT fill never counts as a previous token."""

    def __init__(self, processors: LogitsProcessorList, view: CallerView):
        self.processors = processors
        self.view = view

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.processors(self.view(input_ids), scores)


class CallerViewStoppingCriteria(StoppingCriteria):
    """A caller's stopping criterion, run on the caller's view of the tokens."""

    def __init__(self, criterion: StoppingCriteria, view: CallerView):
        self.criterion = criterion
        self.view = view

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.criterion(self.view(input_ids), scores, **kwargs)


def _expand_rows(tensor: torch.Tensor | None, batch_size: int) -> torch.Tensor | None:
    """Repeat each row so that `tensor` has `batch_size` rows (num_return_sequences / beams expand the batch)."""
    if tensor is None or tensor.shape[0] == batch_size:
        return tensor
    if batch_size % tensor.shape[0] != 0:
        raise ValueError(
            f"Cannot continue from this cache: it holds {tensor.shape[0]} prompts, the new input has {batch_size} rows."
        )
    return tensor.repeat_interleave(batch_size // tensor.shape[0], dim=0)


def _check_continuation(record: CachedPrompt, input_ids: torch.LongTensor | None) -> None:
    """A call on a cache with state must pass the tokens the cache read, then new ones: anything else would be read a
    second time on top of the old state."""
    read = record.tokens.shape[1]
    how = (
        "pass the sequences the previous generate() returned (plus any new tokens) with this cache, or start a new "
        "prompt with a fresh cache (or a `copy.deepcopy` of a cache saved before it was used)."
    )
    if input_ids is None:
        raise ValueError(f"This cache has already read {read} tokens: continuing from it needs `input_ids`; {how}")
    if input_ids.shape[1] <= read:
        raise ValueError(
            f"This cache has already read {read} tokens, but `input_ids` has only {input_ids.shape[1]}: {how}"
        )
    expected = _expand_rows(record.tokens, input_ids.shape[0]).to(input_ids.device)
    if not torch.equal(input_ids[:, :read], expected):
        raise ValueError(f"`input_ids` do not start with the {read} tokens this cache was built from: {how}")


def _continued_prompt(
    prepared: PreparedPrompt, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Ids and mask of a continuation in the prepared layout: prepared prompt + the caller's tokens after its prompt."""
    batch_size = input_ids.shape[0]
    new_tokens = input_ids[:, prepared.original_length :]
    if attention_mask is None:
        new_mask = torch.ones_like(new_tokens)
    else:
        new_mask = attention_mask[:, prepared.original_length :].to(prepared.attention_mask.dtype)
    ids = torch.cat([_expand_rows(prepared.input_ids, batch_size), new_tokens], dim=1)
    mask = torch.cat([_expand_rows(prepared.attention_mask, batch_size), new_mask], dim=1)
    return ids, mask


def _restore_caller_prompt(
    output: GenerateOutput | torch.LongTensor, caller_ids: torch.LongTensor | None, prepared_length: int
) -> GenerateOutput | torch.LongTensor:
    """Replace the prepared prompt at the start of the returned sequences by the caller's prompt."""
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    generated = sequences[:, prepared_length:]
    if caller_ids is not None:
        generated = torch.cat([_expand_rows(caller_ids, sequences.shape[0]).to(generated.device), generated], dim=1)
    if isinstance(output, torch.Tensor):
        return generated
    output.sequences = generated
    return output


def _shift_length_limits(kwargs: dict, generation_config: GenerationConfig, shift: int) -> None:
    """Keep explicit `max_length`/`min_length` counting the caller's prompt when the prompt grows by `shift`."""
    for name, new_tokens_name in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
        if kwargs.get(new_tokens_name) is not None:
            continue
        if kwargs.get(name) is not None:
            kwargs[name] += shift
        elif getattr(generation_config, new_tokens_name, None) is None and getattr(generation_config, name, None):
            kwargs[name] = getattr(generation_config, name) + shift


def _encoder_lengths(config: JRTRNNConfig, attention_mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """`(B,)` tokens each row's encoder reads in the prefill: min(prefix_length, the row's tokens)."""
    if attention_mask is None:
        return torch.full((ids.shape[0],), min(config.prefix_length, ids.shape[1]), dtype=torch.long, device=ids.device)
    return attention_mask.sum(-1).clamp(max=config.prefix_length).to(device=ids.device, dtype=torch.long)


def bos_prompt(config: JRTRNNConfig, generation_config: GenerationConfig, device: torch.device) -> torch.LongTensor:
    """The `(1, 1)` prompt `[bos_token_id]` that `generate()` starts from when given no input (as transformers does)."""
    bos = generation_config.bos_token_id if generation_config.bos_token_id is not None else config.bos_token_id
    if bos is None:
        raise ValueError(
            "generate() got no prompt and the model has no `bos_token_id` to start from: pass `input_ids` or set "
            "`bos_token_id` in the generation config."
        )
    return torch.tensor([[bos]], dtype=torch.long, device=device)


def generate_with_prefix(
    model: GenerationMixin,
    base_generate: Callable,
    inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    streamer: BaseStreamer | None,
    prefix_strategy: str | None,
    prefix_pad_token_id: int | None,
    kwargs: dict,
) -> GenerateOutput | torch.LongTensor:
    """`JRTRNNForCausalLM.generate`: prefix strategy and caller's view around `GenerationMixin.generate`, and the
    `CachedPrompt` on the returned cache. Everything else (assisted decoding on this stateful model, unknown
    arguments, suppressed ids) is transformers' own handling."""
    config: JRTRNNConfig = model.config
    effective_config = generation_config if generation_config is not None else model.generation_config
    suppress_never_generated(config, effective_config, kwargs)
    if inputs is not None:
        if kwargs.get("input_ids") is not None:  # the prompt twice: transformers' own error
            return base_generate(inputs, generation_config=generation_config, **kwargs)
        kwargs["input_ids"] = inputs  # with `inputs_embeds` too: the ids of those embeddings, as in transformers
    input_ids = kwargs.get("input_ids")
    inputs_embeds = kwargs.get("inputs_embeds")
    if input_ids is None and inputs_embeds is None:
        input_ids = kwargs["input_ids"] = bos_prompt(config, effective_config, model.device)
    if (input_ids if input_ids is not None else inputs_embeds).shape[1] == 0:
        raise ValueError(
            "generate() got an empty prompt (0 tokens): pass at least one token, or no prompt at all to start "
            "from `bos_token_id`."
        )
    attention_mask = kwargs.get("attention_mask")
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    is_prefix = config.linear_attention_type == "prefix" and "linear_attention" in config.layer_types

    def run(prepared_length: int, **overrides) -> GenerateOutput | torch.LongTensor:
        """The standard generate on the model's layout; processors and criteria see the caller's layout."""
        call_kwargs = {**kwargs, **overrides}
        if input_ids is not None and prepared_length != input_ids.shape[1]:
            view = CallerView(input_ids, prepared_length)
            call_kwargs["caller_view"] = view
            criteria = call_kwargs.get("stopping_criteria")
            if criteria:
                call_kwargs["stopping_criteria"] = StoppingCriteriaList(
                    [CallerViewStoppingCriteria(criterion, view) for criterion in criteria]
                )
        return base_generate(
            generation_config=generation_config,
            logits_processor=logits_processor,
            streamer=call_kwargs.pop("streamer", streamer),
            **call_kwargs,
        )

    def remember(output, returned_cache: Cache | None, prepared: PreparedPrompt | None, prefix_lengths) -> None:
        """Store what the returned cache has read on the cache itself."""
        if returned_cache is None or input_ids is None or inputs_embeds is not None:
            return
        sequences = output if isinstance(output, torch.Tensor) else output.sequences  # caller's layout
        fill = 0 if prepared is None else prepared.length - prepared.original_length
        setattr(returned_cache, CACHE_PROMPT_ATTRIBUTE, CachedPrompt(
            prepared=prepared, tokens=sequences[:, :-1], num_read=sequences.shape[1] - 1 + fill,
            prefix_lengths=prefix_lengths,
        ))

    # 1. Continuing from a cache that holds a sequence: check it, put the prepared prompt back in front.
    if cache is not None and cache_has_state(cache):
        record = cached_prompt(cache)
        if record is None:
            raise ValueError(
                "This cache already holds a sequence that generate() did not record (e.g. from a plain forward), so "
                "the tokens it read are unknown and would be read twice: generate from the prompt with a fresh "
                "cache, or continue from a cache that generate() returned."
            )
        if inputs_embeds is not None:
            raise ValueError("Continuing from a cache needs `input_ids` (the returned sequences plus new tokens).")
        _check_continuation(record, input_ids)
        ids, mask = input_ids, attention_mask
        if record.prepared is not None:
            ids, mask = _continued_prompt(record.prepared, input_ids, attention_mask)
            _shift_length_limits(kwargs, effective_config, record.fill_length)
        output = run(ids.shape[1], input_ids=ids, attention_mask=mask)
        output = _restore_caller_prompt(output, input_ids, ids.shape[1])
        remember(output, cache, record.prepared, record.prefix_lengths)
        return output

    # 2. A new prompt: fill the encoder prefix as `prefix_strategy` says (prefix linear attention only).
    strategy = prefix_strategy or getattr(effective_config, "prefix_strategy", None) or DEFAULT_PREFIX_STRATEGY
    if strategy not in PREFIX_STRATEGIES:
        raise ValueError(f"`prefix_strategy` must be one of {list(PREFIX_STRATEGIES)}, got {strategy!r}.")
    prompt = input_ids if input_ids is not None else inputs_embeds
    if not is_prefix or prompt is None:
        output = run(0 if prompt is None else prompt.shape[1])
        remember(output, cache if cache is not None else getattr(output, "cache", None), None, None)
        return output
    pad_id = config.prefix_pad_token_id if prefix_pad_token_id is None else prefix_pad_token_id
    batch_pad_id = effective_config.pad_token_id if effective_config.pad_token_id is not None else config.pad_token_id
    prepared = prepare_prefix(
        input_ids,
        inputs_embeds,
        attention_mask,
        prefix_length=config.prefix_length,
        strategy=strategy,
        prefix_pad_token_id=pad_id,
        batch_pad_token_id=batch_pad_id if batch_pad_id is not None else (pad_id or 0),
        embed=model.get_input_embeddings(),
        vocab_size=config.vocab_size,
    )
    prompt_length = prepared.length if prepared is not None else prompt.shape[1]
    overrides = {}
    if prepared is not None:
        _shift_length_limits(kwargs, effective_config, prepared.length - prepared.original_length)
        overrides["attention_mask"] = prepared.attention_mask
        if prepared.input_ids is not None:
            overrides["input_ids"] = prepared.input_ids
        if prepared.inputs_embeds is not None:
            overrides["inputs_embeds"] = prepared.inputs_embeds
        if prepared.linear_attention_mask is not None:
            overrides["linear_attention_mask"] = prepared.linear_attention_mask
        if streamer is not None:
            overrides["streamer"] = PromptStrippingStreamer(streamer, prepared.length, prepared.original_length)
    # Per-row prefix of the prefill. Without a cache every step recomputes the whole sequence: the same per-row
    # prefix keeps the encoder on the prompt (it would otherwise grow into the generated tokens).
    prefix_lengths = _encoder_lengths(config, overrides.get("attention_mask", attention_mask), prompt)
    kwargs.setdefault("prefix_length", prefix_lengths)
    prepared_length = prompt_length if prepared is None or prepared.input_ids is not None else 0
    output = run(prepared_length if input_ids is not None else 0, **overrides)
    output = _restore_caller_prompt(output, input_ids, prepared_length) if prepared is not None else output
    remember(output, cache if cache is not None else getattr(output, "cache", None), prepared, prefix_lengths)
    return output


def prefill_segments(total: int, past: int, chunk_size: int, encoder_end: int = 0) -> list[tuple[int, int]]:
    """The `[start, end)` column ranges of a chunked prefill of the columns `past <= c < total`.

    The first forward is the only one the JRT encoder reads, so it spans at least the encoder region `encoder_end`
    (for a left-padded batch the largest `pads_b + prefix_b`; 0 for a causal model or a cache that already holds a
    state), and at least `chunk_size` columns; the rest goes in chunks of `chunk_size`.

    Example:
        >>> prefill_segments(total=30, past=0, chunk_size=4, encoder_end=11)
        [(0, 11), (11, 15), (15, 19), (19, 23), (23, 27), (27, 30)]
    """
    if chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be a positive number of tokens, got {chunk_size}.")
    segments, start = [], past
    end = min(max(encoder_end, past + chunk_size), total)
    while start < total:
        segments.append((start, end))
        start, end = end, min(end + chunk_size, total)
    return segments


def chunked_prefill(
    model: GenerationMixin,
    input_ids: torch.LongTensor,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    is_first_iteration: bool,
    encoder_end: int,
):
    """`GenerationMixin._prefill` with `prefill_chunk_size` for JRT-RNN: the forwards of `prefill_segments`.

    Unlike transformers' loop, the first forward covers the whole encoder region of every row (`encoder_end`), the
    tokens the cache has read are counted from its `CachedPrompt` (a purely recurrent cache has no sequence length),
    and each forward gets its own columns of the prompt's `linear_attention_mask` and of `inputs_embeds`.

    Args:
        input_ids: `(B, T)` the whole sequence in the model's layout (`(B, 0)` when generating from embeddings).
        model_kwargs: generate's model kwargs (`cache` is updated in place, as transformers does).
        encoder_end: the columns the encoder reads in the first forward (0 when it reads nothing).

    Returns:
        The model output of the last forward (its logits give the first generated token).
    """
    cache = model_kwargs["cache"]
    inputs_embeds = model_kwargs.get("inputs_embeds") if is_first_iteration else None
    total = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
    record = cached_prompt(cache)
    past = record.num_read if record is not None and cache_has_state(cache) else 0
    attention_mask = model_kwargs.get("attention_mask")
    position_ids = model_kwargs.get("position_ids")
    linear_attention_mask = model_kwargs.get("linear_attention_mask")
    model_forward = (
        model.get_compiled_call(generation_config.compile_config)
        if model._valid_auto_compile_criteria(model_kwargs, generation_config)
        else model.__call__
    )
    outputs = None
    for start, end in prefill_segments(total, past, generation_config.prefill_chunk_size, encoder_end):
        kwargs = {**model_kwargs, "cache": cache}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask[:, :end]
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[..., start:end]
        if inputs_embeds is not None:
            kwargs["inputs_embeds"] = inputs_embeds[:, start:end]
        kwargs.pop("linear_attention_mask", None)
        if linear_attention_mask is not None:
            aligned = align_linear_attention_mask(linear_attention_mask, end, end - start)
            if aligned is not None:
                kwargs["linear_attention_mask"] = aligned
        model_inputs = model.prepare_inputs_for_generation(
            input_ids[:, start:end], next_sequence_length=end - start, is_first_iteration=is_first_iteration, **kwargs
        )
        outputs = model_forward(**model_inputs, return_dict=True)
        cache = model_kwargs["cache"] = outputs.cache
    return outputs


def align_linear_attention_mask(
    linear_attention_mask: torch.Tensor, total_length: int, input_length: int
) -> torch.Tensor | None:
    """The columns of a prompt's `(B, T0)` linear-attention mask for the `input_length` tokens a forward reads, when
    the sequence so far has `total_length` tokens (generated tokens are never masked). None when nothing is masked."""
    extra = total_length - linear_attention_mask.shape[1]
    if extra > 0:
        linear_attention_mask = torch.nn.functional.pad(linear_attention_mask, (0, extra), value=1)
    aligned = linear_attention_mask[:, total_length - input_length : total_length]
    return None if bool(aligned.all()) else aligned


__all__ = [
    "CACHE_PROMPT_ATTRIBUTE",
    "DEFAULT_PREFIX_STRATEGY",
    "PREFIX_STRATEGIES",
    "CachedPrompt",
    "CallerView",
    "CallerViewLogitsProcessor",
    "CallerViewStoppingCriteria",
    "PreparedPrompt",
    "PromptStrippingStreamer",
    "align_linear_attention_mask",
    "cache_has_state",
    "cached_prompt",
    "chunked_prefill",
    "never_generated_ids",
    "generate_with_prefix",
    "prefill_segments",
    "prepare_prefix",
    "repeat_to_fill",
    "suppress_never_generated",
]
