"""The JRT-RNN training objective (REFERENCE.md §5): a data collator and the combined loss.

A packed block of tokens `s` of length T is split at the prefix length E (`config.prefix_length`):

    position      0 .................. E-1 | E    | E+1 ............. T-1
    input_ids     s, a fraction of it      | s[E] | s
                  replaced by [MASK]       |      |
    mlm_labels    s[i] where masked,       | -100 | -100
                  -100 elsewhere           |      |
    labels        -100                     | -100 | s[E+1] ........ s[T-1]

`labels` follow the HF convention (unshifted: position t predicts `labels[t + 1]`), so next-token prediction starts
at position E. `mlm_labels` are predicted at their own position: the prefix is read non-causally, and the model
sees the [MASK] there, not the token.

    loss = mean NTP cross-entropy + mlm_weight * mean MLM cross-entropy        (mlm_weight = 0.25)

As in the reference, target s[E] (predicted from the last prefix position) is never used, and the masked tokens are
all replaced by [MASK] (no 80/10/10 split). The reference samples 2049 tokens to supervise the 1024 positions
E..2047; a block of T = 2049 tokens here gives exactly the same targets (position 2048's prediction is unused).

Decisions (and where they differ from the reference):
- The reference's MLM loss keeps only targets `y > 0`, which also drops masked tokens whose id is 0 (GPT-2 "!").
  That is a side effect of using 0 as "no target", not a choice, so it is not replicated: every masked position is
  a target. (To reproduce it, set `mlm_labels[mlm_labels == 0] = -100` in the batch.)
- Masking draws exactly `round(mlm_probability * E)` positions per sequence by default (`mask_sampling="fixed"`)
  instead of the reference's independent Bernoulli draw per position (`mask_sampling="bernoulli"`). Both mask each
  prefix position with probability `mlm_probability` (up to the rounding); the fixed count makes the MLM mean of a batch independent of
  how it is split into micro-batches and processes (see `jrt_loss`), so gradient accumulation and DDP give the same
  update as one large batch.

Gradient accumulation and `num_items_in_batch`: `Trainer` counts the NTP targets of all micro-batches of one
optimizer step (and of all processes) as `num_items_in_batch` = N, and sums the micro-batch losses. The NTP part is
`sum(CE) / N`, an exact global mean. The MLM part has its own count, which `Trainer` does not collect, so each
micro-batch contributes `mlm_weight * mean_MLM(micro-batch) * n_ntp(micro-batch) / N`: the micro-batch MLM means
weighted by their share of the NTP targets (i.e. of the sequences, for packed blocks). With a fixed mask count per
sequence this is the exact MLM mean of the whole batch; with Bernoulli masking it is the average of the micro-batch
means, which is what the reference computes across its GPUs. Without `num_items_in_batch` (plain forward, custom
loops) the loss is the reference's `mean NTP + mlm_weight * mean MLM` over the given batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .configuration_jrt import JRTRNNConfig

IGNORE_INDEX = -100
MASK_SAMPLINGS = ("fixed", "bernoulli")

# Every `nn.Linear` of the mixers and MLPs. `JRTRNNShortConv.conv` is a depthwise Conv1d (groups = channels): a
# low-rank update of a (channels, 1, kernel) weight is meaningless, and PEFT rejects it unless the rank divides the
# number of groups. The tied `lm_head` / `embed_tokens` are left out so the adapter does not untie them.
LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj",  # sliding-window and linear attention
    "k_enc_proj", "v_enc_proj",  # JRT prefix encoder projections
    "in_proj", "out_proj",  # gated short convolution
    "gate_proj", "up_proj", "down_proj",  # SwiGLU MLP
)


def ignore_prefix_targets(labels: torch.Tensor, prefix_end: torch.Tensor | int) -> torch.Tensor:
    """`labels` `(B, T)` with the targets a JRT encoder reads set to -100: index `j < prefix_end[b]` in row b.

    `prefix_end` is an int or a `(B,)` tensor: the absolute index after each row's prefix (its first real token plus
    its prefix length; just `prefix_length` for unpadded or right-padded rows). The model's loss does this itself;
    call it in a data collator so that `Trainer`'s `num_items_in_batch` counts only the scored targets.
    """
    positions = torch.arange(labels.shape[-1], device=labels.device)
    prefix_end = torch.as_tensor(prefix_end, device=labels.device).reshape(-1, 1)  # (B, 1) or (1, 1)
    return labels.masked_fill(positions[None, :] < prefix_end, IGNORE_INDEX)


def jrt_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mlm_labels: torch.Tensor,
    *,
    mlm_weight: float,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The JRT objective: next-token loss plus `mlm_weight` times the masked-LM loss on the prefix.

    Args:
        logits: `(B, T, V)` scores.
        labels: `(B, T)` next-token targets in the HF convention (unshifted: position t predicts `labels[t + 1]`),
            -100 where there is none.
        mlm_labels: `(B, T)` masked-LM targets, predicted at their own position, -100 where there is none.
        mlm_weight: weight of the masked-LM term (0.25 in the reference).
        num_items_in_batch: NTP targets of the whole optimizer step (all micro-batches and processes), as `Trainer`
            passes it. See the module docstring for how the MLM term is normalised then.

    Returns:
        `(loss, ntp_loss, mlm_loss)`: the scalar to optimise, and the detached NTP and MLM means of this batch for
        logging. A part with no targets contributes 0.
    """
    if labels.shape != logits.shape[:2] or mlm_labels.shape != logits.shape[:2]:
        raise ValueError(
            f"`labels` {tuple(labels.shape)} and `mlm_labels` {tuple(mlm_labels.shape)} must both have the shape "
            f"(batch, seq_len) of the logits {tuple(logits.shape[:2])}; with `logits_to_keep` no loss is computed."
        )
    logits = logits.float()
    vocab_size = logits.shape[-1]
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].to(logits.device)  # (B, T)
    mlm_labels = mlm_labels.to(logits.device)
    ntp_sum = F.cross_entropy(logits.view(-1, vocab_size), shift_labels.reshape(-1), reduction="sum")
    mlm_sum = F.cross_entropy(logits.view(-1, vocab_size), mlm_labels.reshape(-1), reduction="sum")
    ntp_count = (shift_labels != IGNORE_INDEX).sum()
    mlm_count = (mlm_labels != IGNORE_INDEX).sum()
    ntp_mean = ntp_sum / ntp_count.clamp(min=1)
    mlm_mean = mlm_sum / mlm_count.clamp(min=1)
    if num_items_in_batch is None:
        loss = ntp_mean + mlm_weight * mlm_mean
    else:
        # This micro-batch's share of the step: exact NTP sum over N, MLM mean weighted by the NTP share.
        loss = (ntp_sum + mlm_weight * mlm_mean * ntp_count) / num_items_in_batch
    return loss, ntp_mean.detach(), mlm_mean.detach()


@dataclass
class JRTDataCollator:
    """Builds JRT training batches from packed blocks of token ids (all of one length T > prefix_length + 1).

    Each example is a sequence of token ids or a mapping with an `"input_ids"` entry. Returns `input_ids`, `labels`
    and `mlm_labels`, each `(B, T)` int64, laid out as in the module docstring, and `prefix_length` `(B,)`: the
    model's forward reads it as each row's prefix and refuses a batch whose prefix differs from its own
    `config.prefix_length` (the layout would not match the encoder).

    Args:
        prefix_length: length E of the non-causal prefix; must equal the model's `config.prefix_length`.
        mask_token_id: id written over the masked prefix tokens (`config.mask_token_id`).
        mlm_probability: fraction of prefix tokens to mask (0.15 in the reference).
        mask_sampling: `"fixed"` masks exactly `round(mlm_probability * E)` random prefix positions per sequence
            (exact under gradient accumulation, see the module docstring); `"bernoulli"` masks each position
            independently, as the reference.
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
    _generator: torch.Generator | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.prefix_length < 1:
            raise ValueError(f"`prefix_length` must be >= 1 for the masked-LM objective, got {self.prefix_length}.")
        if not 0.0 <= self.mlm_probability <= 1.0:
            raise ValueError(f"`mlm_probability` must be in [0, 1], got {self.mlm_probability}.")
        if self.mask_sampling not in MASK_SAMPLINGS:
            raise ValueError(f"`mask_sampling` must be one of {list(MASK_SAMPLINGS)}, got {self.mask_sampling!r}.")

    @classmethod
    def from_config(cls, config: JRTRNNConfig, **kwargs: Any) -> JRTDataCollator:
        """A collator with the model's `prefix_length` and `mask_token_id`; `kwargs` set the other fields."""
        if config.mask_token_id is None:
            raise ValueError(
                "`config.mask_token_id` is None: the JRT objective needs a [MASK] token. Set it in the config "
                "(50263 in the released JRT models) or pass `mask_token_id` to `JRTDataCollator` directly."
            )
        if config.linear_attention_type != "prefix":
            raise ValueError(
                f"The JRT objective needs prefix linear attention, but `linear_attention_type` is "
                f"{config.linear_attention_type!r}: train Based models with plain causal-LM labels."
            )
        return cls(prefix_length=config.prefix_length, mask_token_id=config.mask_token_id, **kwargs)

    def __call__(self, examples: Sequence[Sequence[int] | torch.Tensor | Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        tokens = torch.stack([self._as_tensor(example) for example in examples])  # (B, T)
        seq_len = tokens.shape[1]
        if seq_len < self.prefix_length + 2:
            raise ValueError(
                f"Blocks of {seq_len} tokens leave no next-token target after a prefix of {self.prefix_length}: "
                f"pack blocks of at least prefix_length + 2 = {self.prefix_length + 2} tokens."
            )
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        mask[:, : self.prefix_length] = torch.stack([self._draw_mask() for _ in range(tokens.shape[0])])
        labels = tokens.clone()
        labels[:, : self.prefix_length + 1] = IGNORE_INDEX  # the first prediction is made at position E
        return {
            "input_ids": tokens.masked_fill(mask, self.mask_token_id),
            "labels": labels,
            "mlm_labels": tokens.masked_fill(~mask, IGNORE_INDEX),
            "prefix_length": torch.full((tokens.shape[0],), self.prefix_length, dtype=torch.long),
        }

    @staticmethod
    def _as_tensor(example: Sequence[int] | torch.Tensor | Mapping[str, Any]) -> torch.Tensor:
        if isinstance(example, Mapping):
            example = example["input_ids"]
        return torch.as_tensor(example, dtype=torch.long)

    def _draw_mask(self) -> torch.Tensor:
        """(E,) bool mask of one sequence's prefix."""
        generator = self._get_generator()
        if self.mask_sampling == "bernoulli":
            return torch.rand(self.prefix_length, generator=generator) < self.mlm_probability
        num_masked = round(self.mlm_probability * self.prefix_length)
        mask = torch.zeros(self.prefix_length, dtype=torch.bool)
        mask[torch.randperm(self.prefix_length, generator=generator)[:num_masked]] = True
        return mask

    def _get_generator(self) -> torch.Generator | None:
        """Created at the first call, inside the process and dataloader worker that uses it."""
        if self.seed is None:
            return None
        if self._generator is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            worker = torch.utils.data.get_worker_info()
            # Python hashes tuples of ints deterministically (PYTHONHASHSEED only affects str and bytes).
            stream = hash((self.seed, rank, 0 if worker is None else worker.id)) & (2**63 - 1)
            self._generator = torch.Generator().manual_seed(stream)
        return self._generator


def pack_token_blocks(token_ids: Sequence[int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """Cuts one long token stream (documents joined with an end-of-text token) into `(N, block_size)` blocks,
    dropping the remainder, like the reference's packed Pile samples."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    num_blocks = token_ids.numel() // block_size
    if num_blocks == 0:
        raise ValueError(f"{token_ids.numel()} tokens make no block of {block_size}: use more text or a smaller block.")
    return token_ids[: num_blocks * block_size].view(num_blocks, block_size)


def default_lora_config(**overrides: Any):
    """A `peft.LoraConfig` for JRT-RNN / Based models: rank 8, alpha 16, on every Linear projection.

    Targets `LORA_TARGET_MODULES` (attention, prefix-encoder, convolution-block and MLP projections). The depthwise
    convolution cannot take LoRA (its weight is one kernel per channel, and PEFT rejects grouped convolutions); it
    stays frozen unless you list `"conv"` in `modules_to_save`. Keyword arguments override any `LoraConfig` field.

    Example:
        >>> from peft import get_peft_model
        >>> model = get_peft_model(model, default_lora_config(r=16))
    """
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError("`default_lora_config` needs PEFT: `pip install peft`.") from error
    values = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGET_MODULES), task_type="CAUSAL_LM")
    values.update(overrides)
    return LoraConfig(**values)


__all__ = [
    "IGNORE_INDEX",
    "LORA_TARGET_MODULES",
    "JRTDataCollator",
    "default_lora_config",
    "ignore_prefix_targets",
    "jrt_loss",
    "pack_token_blocks",
]
