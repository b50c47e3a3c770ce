"""`JRTTrainer`: a transformers `Trainer` that also logs the two parts of the JRT objective.

The model's forward with `mlm_labels` returns the combined loss (`ntp_loss + mlm_weight * mlm_loss`) and both parts
(`outputs.ntp_loss`, `outputs.mlm_loss`). `Trainer` logs only the combined loss; this subclass keeps each training
micro-batch's parts and logs their means (this process's, since the last log) next to `loss`.
"""

from __future__ import annotations

import torch
from transformers import Trainer

LOSS_PARTS = ("ntp_loss", "mlm_loss")


class JRTTrainer(Trainer):
    """A `Trainer` that logs `ntp_loss` and `mlm_loss` with `loss`. Use it with `JRTDataCollator`, whose batches
    carry `mlm_labels`; on batches without them the model returns no parts and nothing extra is logged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_parts: dict[str, list[torch.Tensor]] = {name: [] for name in LOSS_PARTS}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            for name, values in self.loss_parts.items():
                part = outputs.get(name) if isinstance(outputs, dict) else None  # a ModelOutput is a dict
                if part is not None:
                    values.append(part.detach())
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            for name, values in self.loss_parts.items():
                if values:
                    logs[name] = round(torch.stack(values).mean().item(), 4)
                    values.clear()
        super().log(logs, *args, **kwargs)
