"""The losses `JRTRNNForCausalLM.forward` computes: the JRT objective and the leak-free next-token targets.

    loss = mean NTP cross-entropy + mlm_weight * mean MLM cross-entropy        (mlm_weight = 0.25)

Gradient accumulation (docs/training.md): `Trainer` passes the NTP targets of a whole optimizer step as
`num_items_in_batch` = N. The NTP part is then `sum(CE) / N`, an exact global mean; `Trainer` does not count the MLM
targets, so each micro-batch adds `mlm_weight * mean_MLM(micro-batch) * n_ntp(micro-batch) / N` (exact with a fixed
mask count per sequence). The collator of JRT training batches is `jrt_train.JRTDataCollator`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .configuration_jrt import MAX_SIZES

# Label of a position without a target (PyTorch's `cross_entropy` default `ignore_index`, transformers' convention).
IGNORE_INDEX = -100


def check_prefix_length(
    prefix_length: torch.Tensor | int, batch_size: int | None = None, name: str = "prefix_length"
) -> None:
    """The one rule for every argument that sets a JRT prefix (`prefix_length=`, `prompt_lengths=`,
    `ignore_prefix_targets`): an int or a `(B,)` integer tensor, in `[0, MAX_SIZES["prefix_length"]]` in every row.
    Errors name the argument (`name`); values are read outside `torch.compile` tracing only."""
    maximum = MAX_SIZES["prefix_length"]
    if isinstance(prefix_length, torch.Tensor):
        dtype = prefix_length.dtype
        shape_ok = prefix_length.ndim == 1 and (batch_size is None or prefix_length.shape[0] == batch_size)
        if not shape_ok or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            rows = "(B,)" if batch_size is None else f"(B,) = ({batch_size},)"
            raise ValueError(f"{name} must be an int or a {rows} integer tensor of per-row lengths; got a "
                             f"{prefix_length.dtype} tensor of shape {tuple(prefix_length.shape)}.")
        # One read of the data (a host synchronisation), then the message that applies.
        if not torch.compiler.is_compiling() and bool(((prefix_length < 0) | (prefix_length > maximum)).any()):
            if bool((prefix_length < 0).any()):
                raise ValueError(f"{name} must be >= 0 in every row; got {prefix_length.tolist()}.")
            raise ValueError(f"{name} must be at most {maximum:,} in every row; got {prefix_length.tolist()}.")
    elif isinstance(prefix_length, int) and not isinstance(prefix_length, bool):
        if prefix_length < 0:
            raise ValueError(f"{name} must be >= 0; got {prefix_length}.")
        if prefix_length > maximum:
            raise ValueError(f"{name} must be at most {maximum:,} (the config's bound); got {prefix_length:,}.")
    else:
        raise TypeError(f"{name} must be an int or a (B,) LongTensor; got {type(prefix_length).__name__}.")


def ignore_prefix_targets(labels: torch.Tensor, prefix_end: torch.Tensor | int) -> torch.Tensor:
    """`labels` `(B, T)` with the targets a JRT encoder reads set to -100: index `j < prefix_end[b]` in row b.

    `prefix_end` (`check_prefix_length`'s rule): the index after each row's prefix (its first real token plus its
    prefix length). The model's loss does this itself; call it in a data collator so that `Trainer`'s
    `num_items_in_batch` counts only the scored targets.
    """
    check_prefix_length(prefix_end, labels.shape[0] if labels.ndim == 2 else None)
    return mask_before(labels, prefix_end)


def mask_before(labels: torch.Tensor, prefix_end: torch.Tensor | int) -> torch.Tensor:
    """`labels` `(B, T)` with index `j < prefix_end[b]` set to -100 in row b; `prefix_end` already checked."""
    positions = torch.arange(labels.shape[-1], device=labels.device)
    prefix_end = torch.as_tensor(prefix_end, device=labels.device).reshape(-1, 1)  # (B, 1) or (1, 1)
    return labels.masked_fill(positions[None, :] < prefix_end, IGNORE_INDEX)


def jrt_loss(
    logits: torch.Tensor, labels: torch.Tensor, mlm_labels: torch.Tensor, *, mlm_weight: float,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The JRT objective: next-token loss plus `mlm_weight` times the masked-LM loss on the prefix.

    logits `(B, T, V)`; labels `(B, T)` unshifted next-token targets; mlm_labels `(B, T)` masked-LM targets at their
    own position (-100 where none); num_items_in_batch: NTP targets of the whole optimizer step (module docstring).
    Returns `(loss, ntp_loss, mlm_loss)`: the scalar to optimise and the detached NTP and MLM means of this batch (0
    for a part with no targets).
    """
    if labels.shape != logits.shape[:2] or mlm_labels.shape != logits.shape[:2]:
        raise ValueError(f"`labels` {tuple(labels.shape)} and `mlm_labels` {tuple(mlm_labels.shape)} must both have "
                         f"the shape (batch, seq_len) of the logits {tuple(logits.shape[:2])}; with `logits_to_keep` "
                         "no loss is computed.")
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


__all__ = ["IGNORE_INDEX", "check_prefix_length", "ignore_prefix_targets", "jrt_loss", "mask_before"]
