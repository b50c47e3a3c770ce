"""The JRT prefix of a sequence's first forward: how prompts shorter than `prefix_length` are filled.

JRT-RNN's encoder reads each row's prompt non-causally, up to `prefix_length` tokens. In the first forward of a
sequence the model fills a shorter prompt to `prefix_length` itself, as `prefix_strategy` says (`"pad"`, `"repeat"`
(`repeat_to_fill`) or `"none"`: docs/prefix.md, "The rule").

The fill is internal: outputs cover the caller's positions only, and the cache keeps the plan (`PrefixPlan`) for
later forwards. Each row is filled on its own, its fill right before its first real token, the batch padding before:

    caller row, left padded (L = 3, prefix 6):          [pad pad pad pad][p0 p1 p2]
    the model's row (F = 3 columns in front):  [pad pad pad pad][f  f  f][p0 p1 p2]      F = max over rows of
    caller row, unpadded (L = 7):                       [p0 p1 p2 p3 p4 p5 p6]           (fill - left padding)
    the model's row:                           [pad pad pad][p0 p1 p2 p3 p4 p5 p6]

so the caller's column j is the model's column F + j, and a row of a batch reads exactly what it reads alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import overload

import torch

from .configuration_jrt import PREFIX_STRATEGIES, JRTRNNConfig, check_choice
from .loss import check_prefix_length


def never_generated_ids(config: JRTRNNConfig) -> list[int]:
    """The ids generation must never emit, sorted: every id `>= config.generation_vocab_size` (rows that only pad the
    vocabulary) and `config.mask_token_id`. The model's generation config carries them as `suppress_tokens`."""
    ids = set() if config.generation_vocab_size is None else set(range(config.generation_vocab_size, config.vocab_size))
    if config.mask_token_id is not None:
        ids.add(config.mask_token_id)
    return sorted(ids)


@overload
def repeat_to_fill(prompt_ids: torch.Tensor, length: int) -> torch.Tensor: ...
@overload
def repeat_to_fill(prompt_ids: list[int], length: int) -> list[int]: ...
def repeat_to_fill(prompt_ids: torch.Tensor | list[int], length: int) -> torch.Tensor | list[int]:
    """Fill `length` tokens by repeating the prompt so that its last full copy ends at the end.

    `out[i] = prompt[(i - length) mod T]` (the `"repeat"` prefix strategy), for `prompt_ids` a `(T,)` tensor or list
    of ids, or a `(B, T)` tensor whose rows are repeated as they are (padding included), and `length >= T`. Returns
    `(length,)` or `(B, length)` on `prompt_ids`' device and dtype, or a list for a list.

    Example:
        >>> repeat_to_fill([1, 2, 3], 8)
        [2, 3, 1, 2, 3, 1, 2, 3]
    """
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() not in (1, 2):
            raise ValueError(f"`prompt_ids` must be a (T,) or (B, T) tensor, got shape {tuple(prompt_ids.shape)}.")
        prompt_length = prompt_ids.shape[-1]
    elif isinstance(prompt_ids, list):
        prompt_length = len(prompt_ids)
    else:
        raise TypeError(f"`prompt_ids` must be a torch.Tensor or a list of ints, got {type(prompt_ids).__name__}.")
    if prompt_length == 0:
        raise ValueError("`prompt_ids` is empty: there is nothing to repeat.")
    if length < prompt_length:
        raise ValueError(f"`length` ({length}) is shorter than the prompt ({prompt_length} tokens): repeating cannot "
                         "keep a whole copy; truncate the prompt or use a longer length.")
    if isinstance(prompt_ids, list):
        return [prompt_ids[(i - length) % prompt_length] for i in range(length)]
    index = (torch.arange(length, device=prompt_ids.device) - length) % prompt_length  # (length,)
    return prompt_ids[..., index]  # (length,) or (B, length)


def row_spans(
    attention_mask: torch.Tensor | None, batch_size: int, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(start, tokens)`, both `(B,)` int64: each row's run `[start, start + tokens)` of real tokens in the last
    `length` columns of `attention_mask` (`(B, S)`; None: every token is real); start 0 for a row without any."""
    if attention_mask is None:
        start = torch.zeros(batch_size, dtype=torch.long, device=device)
        return start, torch.full((batch_size,), length, dtype=torch.long, device=device)
    real = attention_mask[:, attention_mask.shape[1] - length :].to(device).bool()
    return real.long().argmax(-1), real.sum(-1)


def check_prefix_strategy(strategy: object) -> str:
    return check_choice("prefix_strategy", strategy, PREFIX_STRATEGIES)


@dataclass
class PrefixPlan:
    """Each row's JRT prefix in the first forward of a sequence (`plan_prefix`): what the fill, the encoder read, the
    labels rule, generation and `jrt_vllm` read, and the cache keeps (`JRTRNNCache.prefix`).

    Caller's columns, each `(B,)` int64:
        start: the row's first token (after left padding; 0 with right padding or none).
        tokens: the row's tokens (one run from `start`).
        prompt: the prompt, from `start`: `min(prompt_lengths, tokens)`, all of the row's tokens by default.
        target: the prefix length P of the row.
        encoder_tokens: the caller's tokens the encoder reads, `min(prompt, P)`.
        fill: the tokens the model puts right before `start`, `P - encoder_tokens` when the strategy fills and the
            prompt is not empty, else 0.
    The model's columns (the caller's column `j` is the model's `fill_columns + j`):
        fill_columns: F, the columns in front of the caller's (the widest `fill - start`).
        read_start, read_end: `(B,)` row b's encoder reads the model's columns `[read_start, read_end)`: its fill,
            then its first `encoder_tokens` tokens (padding never enters the encoder).
        read_width: M, the leading columns the encoder projections are computed for (`max(read_end)`; every column
            under torch.compile, a static shape).
    And:
        strategy: `"pad"`, `"repeat"` or `"none"`.
        pad_token_id: the fill token of `"pad"`.
    """

    start: torch.Tensor
    tokens: torch.Tensor
    prompt: torch.Tensor
    target: torch.Tensor
    encoder_tokens: torch.Tensor
    fill: torch.Tensor
    read_start: torch.Tensor
    read_end: torch.Tensor
    fill_columns: int
    read_width: int
    strategy: str
    pad_token_id: int | None

    @property
    def encoder_end(self) -> torch.Tensor:
        """`(B,)` the caller's column right after each row's encoder read: labels before it are never scored."""
        return self.start + self.encoder_tokens

    @property
    def prefix_lengths(self) -> torch.Tensor:
        """`(B,)` tokens each row's encoder reads, its fill included."""
        return self.read_end - self.read_start

    def positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The caller's `(B, T)` RoPE positions in the model's layout `(B, F + T)`: the fill counts back from each
        row's first token, the columns in front of it are 0 (padding)."""
        if self.fill_columns == 0:
            return position_ids
        position_ids = position_ids.expand(self.start.shape[0], -1)
        first = position_ids.gather(1, self.start[:, None])  # (B, 1) position of each row's first token
        columns = torch.arange(self.fill_columns + position_ids.shape[1], device=position_ids.device)[None]
        row_start = (self.fill_columns + self.start)[:, None]
        in_front = torch.where(columns >= row_start - self.fill[:, None], first - (row_start - columns), 0)
        return torch.cat([in_front[:, : self.fill_columns], position_ids], dim=1)

    def check_rows(self, batch_size: int) -> PrefixPlan:
        """This plan, if it was made for `batch_size` rows (a caller's `prefix_plan=`): else a ValueError."""
        if tuple(self.start.shape) != (batch_size,):
            raise ValueError(f"prefix_plan was made for {self.start.shape[0]} rows; this batch has {batch_size}: make "
                             "it for this batch (`plan_prefix(config, attention_mask, batch_size, seq_len, device)`).")
        return self

    def select_rows(self, index: torch.Tensor) -> PrefixPlan:
        """The plan of the rows `index` `(B',)` (beam search, `batch_repeat_interleave`): the columns stay."""
        rows = {f.name: getattr(self, f.name).index_select(0, index.to(self.start.device))
                for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **rows)


def plan_prefix(
    config: JRTRNNConfig, attention_mask: torch.Tensor | None, batch_size: int, length: int, device: torch.device, *,
    prefix_length: int | torch.Tensor | None = None, prompt_lengths: int | torch.Tensor | None = None,
    strategy: str | None = None, pad_token_id: int | None = None,
) -> PrefixPlan:
    """The prefix of each row of a first forward of `(B, T)` tokens under `attention_mask` (its last T columns; None:
    no padding): `prefix_length` and `prompt_lengths` are ints or `(B,)` (`check_prefix_length`; no prompt lengths:
    the whole row), filled as `strategy` says with `pad_token_id`. None arguments take the config's values."""
    prefix_length = config.prefix_length if prefix_length is None else prefix_length
    strategy = check_prefix_strategy(config.prefix_strategy if strategy is None else strategy)
    pad_token_id = config.prefix_pad_token_id if pad_token_id is None else pad_token_id
    check_prefix_length(prefix_length, batch_size)
    if prompt_lengths is not None:
        check_prefix_length(prompt_lengths, batch_size, name="prompt_lengths")
    start, tokens = row_spans(attention_mask, batch_size, length, device)
    prompt = tokens if prompt_lengths is None else torch.as_tensor(prompt_lengths, device=device).long().minimum(tokens)
    target = torch.as_tensor(prefix_length, device=device).long().expand(batch_size)
    encoder_tokens = torch.minimum(prompt, target)
    fills = (prompt > 0) & (strategy != "none")
    fill = torch.where(fills, target - encoder_tokens, torch.zeros_like(target))
    # Known without reading the data (an int P, no `prompt_lengths`): what torch.compile needs as static shapes.
    known = prompt_lengths is None and not isinstance(prefix_length, torch.Tensor)
    compiling = torch.compiler.is_compiling()
    # 1. Columns in front of the caller's: the widest (fill - left padding); max(P - T, 0) while compiling.
    if strategy == "none":
        fill_columns = 0
    elif compiling and known:
        fill_columns = max(prefix_length - length, 0)
    else:
        fill_columns = int((fill - start).clamp(min=0).max()) if batch_size > 0 else 0
    if strategy == "pad" and not compiling and bool((fill > 0).any()):
        if pad_token_id is None:
            raise ValueError("prefix_strategy='pad' needs a fill token: pass `prefix_pad_token_id=` or set "
                             "`config.prefix_pad_token_id` (220, GPT-2's ' ', in the released models).")
        if not 0 <= pad_token_id < config.vocab_size:
            raise ValueError(f"prefix_pad_token_id={pad_token_id} is not a token of this model "
                             f"(vocab_size={config.vocab_size}): pass another `prefix_pad_token_id=`, or "
                             "`prefix_strategy='repeat'`/`'none'`.")
    # 2. The encoder's read in the model's columns: the fill right before the row's first token, then its prompt.
    read_start = start + fill_columns - fill
    read_end = read_start + fill + encoder_tokens
    if compiling:
        read_width = fill_columns + length
    elif known and attention_mask is None:
        read_width = fill_columns + min(prefix_length, length)
    else:
        read_width = int(read_end.max()) if batch_size > 0 else 0
    return PrefixPlan(
        start=start, tokens=tokens, prompt=prompt, target=target, encoder_tokens=encoder_tokens, fill=fill,
        read_start=read_start, read_end=read_end, fill_columns=fill_columns, read_width=read_width,
        strategy=strategy, pad_token_id=pad_token_id,
    )


def fill_prefix(
    plan: PrefixPlan, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None, linear_attention_mask: torch.Tensor | None = None,
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The batch in the model's layout, each row's prompt filled as `plan` (of the same mask) says.

    `input_ids` `(B, T)` or `inputs_embeds` `(B, T, hidden)` (the other None), `attention_mask` and
    `linear_attention_mask` `(B, T)` or None; `embed`: the model's input embedding (to embed the pad token). Returns
    the four over the model's `F + T` columns: the attention mask 1 for the fill too, the linear-attention mask 0 at
    a `"pad"` fill; the inputs as they are when nothing is filled.
    """
    reference = input_ids if input_ids is not None else inputs_embeds
    batch_size, length = reference.shape[:2]
    device = reference.device
    fill_columns, start, fill = plan.fill_columns, plan.start, plan.fill
    compiling = torch.compiler.is_compiling()
    if plan.strategy == "none" or (fill_columns == 0 and not compiling and not bool((fill > 0).any())):
        return input_ids, inputs_embeds, attention_mask, linear_attention_mask
    # The model's layout: F columns in front; row b's fill at columns [F + start_b - fill_b, F + start_b).
    width = fill_columns + length
    columns = torch.arange(width, device=device)[None, :]  # (1, T')
    fill_start = (fill_columns + start - fill)[:, None]  # (B, 1)
    is_fill = (columns >= fill_start) & (columns < (fill_columns + start)[:, None])  # (B, T')
    caller_mask = (
        torch.ones(batch_size, length, dtype=torch.bool, device=device) if attention_mask is None
        else attention_mask.to(device).bool()
    )
    mask = torch.cat([caller_mask.new_zeros(batch_size, fill_columns), caller_mask], dim=1) | is_fill
    # Caller column each model column reads: itself (shifted), or for "repeat" fills the prompt token whose copy
    # ends right before the prompt: prompt[(k - fill) mod prompt] for the k-th fill token.
    source = (columns - fill_columns).clamp(min=0).expand(batch_size, width)
    if plan.strategy == "repeat":
        k = columns - fill_start
        repeated = start[:, None] + torch.remainder(k - fill[:, None], plan.prompt.clamp(min=1)[:, None])
        source = torch.where(is_fill, repeated, source)
    pad_fill = is_fill if plan.strategy == "pad" else None
    pad_id = plan.pad_token_id or 0
    if input_ids is not None:
        input_ids = torch.gather(input_ids.to(device), 1, source)
        if pad_fill is not None:
            input_ids = torch.where(pad_fill, torch.full_like(input_ids, pad_id), input_ids)
    if inputs_embeds is not None:
        index = source[:, :, None].expand(-1, -1, inputs_embeds.shape[-1])
        inputs_embeds = torch.gather(inputs_embeds, 1, index)
        if pad_fill is not None:
            pad = embed(torch.full((1, 1), pad_id, dtype=torch.long, device=device)).to(inputs_embeds.dtype)
            inputs_embeds = torch.where(pad_fill[:, :, None], pad, inputs_embeds)
    if linear_attention_mask is not None:
        linear_attention_mask = torch.nn.functional.pad(linear_attention_mask, (fill_columns, 0), value=1)
    if pad_fill is not None:  # the linear attention ignores the "pad" fill as keys
        keys = (~pad_fill).long()
        linear_attention_mask = keys if linear_attention_mask is None else keys * linear_attention_mask
    return input_ids, inputs_embeds, mask.long(), linear_attention_mask


__all__ = [
    "PREFIX_STRATEGIES", "PrefixPlan", "check_prefix_strategy", "fill_prefix", "never_generated_ids", "plan_prefix",
    "repeat_to_fill", "row_spans",
]
