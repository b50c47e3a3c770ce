"""The JRT-RNN training objective (docs/reference_architecture.md §1.5): the data collator of its batches.

A packed block of tokens `s` of length T is split at the prefix length E (`config.prefix_length`):

    position      0 .................. E-1 | E    | E+1 ............. T-1
    input_ids     s, a fraction of it      | s[E] | s
                  replaced by [MASK]       |      |
    mlm_labels    s[i] where masked,       | -100 | -100
                  -100 elsewhere           |      |
    labels        -100                     | -100 | s[E+1] ........ s[T-1]

`labels` follow the HF convention (unshifted: position t predicts `labels[t + 1]`), so next-token prediction starts
at position E. `mlm_labels` are predicted at their own position: the prefix is read non-causally, and the model
sees the [MASK] there, not the token. The model's forward (`modeling_jrt.loss.jrt_loss`) then computes

    loss = mean NTP cross-entropy + mlm_weight * mean MLM cross-entropy        (mlm_weight = 0.25)

As in the reference, target s[E] is never used and every masked token becomes [MASK] (no 80/10/10 split); a block
of T = 2049 tokens gives the reference's targets. Where this departs from it (its `y > 0` filter is not reproduced:
set `mlm_labels[mlm_labels == 0] = -100` for it; `mask_sampling="fixed"` draws an exact count per sequence, so that
gradient accumulation and DDP give the update of one large batch): docs/training.md, "The JRT objective".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from modeling_jrt import JRTRNNConfig
from modeling_jrt.loss import IGNORE_INDEX

MASK_SAMPLINGS = ("fixed", "bernoulli")
Example = Sequence[int] | torch.Tensor | Mapping[str, Any]


@dataclass
class JRTDataCollator:
    """Builds JRT training batches from packed blocks of token ids (all of one length T > prefix_length + 1).

    Each example is a sequence of token ids or a mapping with an `"input_ids"` entry (and optionally an
    `"attention_mask"`). Returns `input_ids`, `labels` and `mlm_labels`, each `(B, T)` int64, laid out as in the
    module docstring, and `prefix_length` `(B,)`: the model's forward reads it as each row's prefix and refuses a
    batch whose prefix differs from its own `config.prefix_length` (the layout would not match the encoder).
    Examples may end in padding (`attention_mask` 0, or `pad_token_id`) after at least `prefix_length + 2` real
    tokens: pads are never targets, and the batch then carries the `attention_mask` too.

    Args:
        prefix_length: length E of the non-causal prefix; must equal the model's `config.prefix_length`.
        mask_token_id: id written over the masked prefix tokens (`config.mask_token_id`).
        mlm_probability: fraction of prefix tokens to mask (0.15 in the reference).
        mask_sampling: `"fixed"` (exactly `round(mlm_probability * E)` masks per sequence) or `"bernoulli"` (the
            reference's draw); see the module docstring.
        pad_token_id: id of the padding that ends short examples (only the trailing run of it counts), or None
            (then only an example's `attention_mask` marks pads).
        seed: seed of the masks. With a seed, the masks depend only on the order in which sequences are collated
            (drawn one sequence at a time, so batch size and gradient accumulation do not change them), and every
            distributed rank and dataloader worker draws its own stream. Without one, `torch`'s global generator
            is used (seeded by `Trainer`'s `seed`).

    Example:
        >>> collator = JRTDataCollator.from_config(model.config, seed=0)
        >>> batch = collator([{"input_ids": block} for block in blocks])  # blocks: lists of 2049 token ids
        >>> model(**batch).loss.backward()
    """

    prefix_length: int
    mask_token_id: int
    mlm_probability: float = 0.15
    mask_sampling: str = "fixed"
    seed: int | None = None
    pad_token_id: int | None = None
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not _is_int(self.prefix_length) or self.prefix_length < 1:
            raise ValueError("`prefix_length` must be an integer >= 1 for the masked-LM objective (the model's "
                             f"`config.prefix_length`), got {self.prefix_length!r} "
                             f"({type(self.prefix_length).__name__}).")
        if self.mask_token_id is None:
            raise ValueError(
                "`mask_token_id` is None: the JRT objective writes a [MASK] token over 15% of the prefix. Pass the "
                "model's `config.mask_token_id` (50263 in the released JRT models), or set one in the config first "
                "and use `JRTDataCollator.from_config(model.config)`."
            )
        if not _is_int(self.mask_token_id) or self.mask_token_id < 0:
            raise ValueError(f"`mask_token_id` must be a token id (an integer >= 0), got {self.mask_token_id!r} "
                             f"({type(self.mask_token_id).__name__}).")
        for name in ("pad_token_id", "seed"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"`{name}` must be None or an integer >= 0, got {value!r} ({type(value).__name__}).")
        probability = self.mlm_probability
        if isinstance(probability, bool) or not isinstance(probability, (int, float)) or not 0.0 <= probability <= 1.0:
            raise ValueError(f"`mlm_probability` must be a number in [0, 1], got {probability!r}.")
        if self.mask_sampling not in MASK_SAMPLINGS:
            raise ValueError(f"`mask_sampling` must be one of {list(MASK_SAMPLINGS)}, got {self.mask_sampling!r}.")

    @classmethod
    def from_config(cls, config: JRTRNNConfig, **kwargs: Any) -> JRTDataCollator:
        """A collator with the model's `prefix_length` and `mask_token_id`; `kwargs` set the other fields."""
        if config.mask_token_id is None:
            raise ValueError("`config.mask_token_id` is None: the JRT objective needs a [MASK] token. Set it in the "
                             "config (50263 in the released JRT models) or pass `mask_token_id` to `JRTDataCollator` "
                             "directly.")
        if config.linear_attention_type != "prefix":
            raise ValueError(f"The JRT objective needs prefix linear attention, but `linear_attention_type` is "
                             f"{config.linear_attention_type!r}: train Based models with plain causal-LM labels.")
        return cls(prefix_length=config.prefix_length, mask_token_id=config.mask_token_id, **kwargs)

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("JRTDataCollator got no examples: a batch needs at least one block of token ids.")
        rows = [self._as_tensors(index, example) for index, example in enumerate(examples)]
        lengths = sorted({ids.numel() for ids, _ in rows})
        if len(lengths) > 1:
            raise ValueError(
                f"JRTDataCollator needs blocks of one length, got lengths {lengths}: cut the token stream with "
                "`pack_token_blocks`, or pad the examples to one length and pass their `attention_mask`."
            )
        tokens = torch.stack([ids for ids, _ in rows])  # (B, T)
        real = torch.stack([mask for _, mask in rows])  # (B, T) bool, False at pads
        seq_len = tokens.shape[1]
        if seq_len < self.prefix_length + 2:
            raise ValueError(f"Blocks of {seq_len} tokens leave no next-token target after a prefix of "
                             f"{self.prefix_length}: pack blocks of at least prefix_length + 2 = "
                             f"{self.prefix_length + 2} tokens.")
        self._check_padding(real)
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[:, : self.prefix_length] = torch.stack([self._draw_mask() for _ in range(tokens.shape[0])])
        labels = tokens.masked_fill(~real, IGNORE_INDEX)  # pads are never next-token targets
        labels[:, : self.prefix_length + 1] = IGNORE_INDEX  # the first prediction is made at position E
        batch = {
            "input_ids": tokens.masked_fill(mask, self.mask_token_id),
            "labels": labels,
            "mlm_labels": tokens.masked_fill(~mask, IGNORE_INDEX),
            "prefix_length": torch.full((tokens.shape[0],), self.prefix_length, dtype=torch.long),
        }
        if not bool(real.all()):
            batch["attention_mask"] = real.long()
        return batch

    def _as_tensors(self, index: int, example: Example) -> tuple[torch.Tensor, torch.Tensor]:
        """One example as `(T,)` int64 ids and a `(T,)` bool mask of its real (non-pad) tokens."""
        attention_mask = None
        if isinstance(example, Mapping):
            if "input_ids" not in example:
                raise ValueError(f"Example {index} has no 'input_ids' entry (keys: {sorted(example)}).")
            attention_mask = example.get("attention_mask")
            example = example["input_ids"]
        ids = torch.as_tensor(example)
        if ids.numel() == 0:
            raise ValueError(f"Example {index} is empty: every example needs at least prefix_length + 2 = "
                             f"{self.prefix_length + 2} token ids.")
        if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"Example {index} must be a 1-D sequence of integer token ids, got {tuple(ids.shape)} "
                             f"{ids.dtype}.")
        ids = ids.long()
        real = torch.ones_like(ids, dtype=torch.bool)
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask)
            if attention_mask.shape != ids.shape:
                raise ValueError(f"Example {index}: `attention_mask` has shape {tuple(attention_mask.shape)}, its "
                                 f"`input_ids` {tuple(ids.shape)}.")
            real = attention_mask != 0
        if self.pad_token_id is not None:
            # Only the trailing run counts as padding: packed streams may hold the same id (GPT-2 pads with its
            # end-of-text token) between documents.
            trailing = (ids == self.pad_token_id).flip(0).long().cumprod(0).flip(0).bool()  # (T,)
            real = real & ~trailing
        return ids, real

    def _check_padding(self, real: torch.Tensor) -> None:
        """Pads may only end a block, after the prefix and one next-token target (they are masked, not read)."""
        if bool((~real[:, :-1] & real[:, 1:]).any()):
            raise ValueError("JRTDataCollator: padding must come after the tokens (right padding); found a pad before "
                             "a token. The prefix must start each block.")
        too_short = (real.sum(-1) < self.prefix_length + 2).nonzero().flatten().tolist()
        if too_short:
            raise ValueError(f"Examples {too_short} have fewer than prefix_length + 2 = {self.prefix_length + 2} real "
                             "tokens: the prefix would hold pads and no next-token target would remain. Drop them or "
                             "use longer examples.")

    def _draw_mask(self) -> torch.Tensor:
        """(E,) bool mask of one sequence's prefix. A seed's generator is created at the first draw, inside the
        process and dataloader worker that uses it (without a seed `_generator` stays None: torch's global one)."""
        if self.seed is not None and self._generator is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            worker = torch.utils.data.get_worker_info()
            # Python hashes tuples of ints deterministically (PYTHONHASHSEED only affects str and bytes).
            stream = hash((self.seed, rank, 0 if worker is None else worker.id)) & (2**63 - 1)
            self._generator = torch.Generator().manual_seed(stream)
        if self.mask_sampling == "bernoulli":
            return torch.rand(self.prefix_length, generator=self._generator) < self.mlm_probability
        num_masked = round(self.mlm_probability * self.prefix_length)
        mask = torch.zeros(self.prefix_length, dtype=torch.bool)
        mask[torch.randperm(self.prefix_length, generator=self._generator)[:num_masked]] = True
        return mask


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pack_token_blocks(token_ids: Sequence[int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """Cuts one long token stream (documents joined with an end-of-text token) into `(N, block_size)` blocks,
    dropping the remainder, like the reference's packed Pile samples."""
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"`block_size` must be a positive integer, got {block_size!r}.")
    token_ids = torch.as_tensor(token_ids)
    is_integer = not (token_ids.is_floating_point() or token_ids.dtype == torch.bool) or token_ids.numel() == 0
    if token_ids.ndim != 1 or not is_integer:
        raise ValueError("`token_ids` must be one 1-D stream of integer token ids (documents joined with an "
                         f"end-of-text token), got {tuple(token_ids.shape)} {token_ids.dtype}.")
    token_ids = token_ids.long()
    num_blocks = token_ids.numel() // block_size
    if num_blocks == 0:
        raise ValueError(f"{token_ids.numel()} tokens make no block of {block_size}: use more text or a smaller block.")
    return token_ids[: num_blocks * block_size].view(num_blocks, block_size)


__all__ = ["MASK_SAMPLINGS", "JRTDataCollator", "pack_token_blocks"]
