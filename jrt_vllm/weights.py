"""Loading a `save_pretrained` / `jrt convert` folder's safetensors into the vLLM model, by the transformers names.

vLLM's `AutoWeightsLoader` hands each module that has a `load_weights` the tensors under its name; the mixers and the
MLP have one (`StackedWeights`, for vLLM's merged projections). The names are the transformers model's (no
`WeightsMapper`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.model_loader.weight_utils import default_weight_loader


def shard_rows(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Weight loader of a parameter split along its first dimension over the tensor-parallel ranks (the channels of
    the depthwise convolution): this rank's rows of the checkpoint's tensor."""
    rows = param.shape[0]
    param.data.copy_(loaded_weight.narrow(0, get_tensor_model_parallel_rank() * rows, rows))


class StackedWeights:
    """A module whose checkpoint projections vLLM's layers merge. `stacked_params` maps a checkpoint projection (the
    transformers model's name, e.g. "q_proj") to the merged parameter that holds it and its shard there (e.g.
    ("qkv_proj", "q"))."""

    stacked_params: dict[str, tuple[str, int | str]] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors named relative to this module -> the names of the parameters they were loaded into.

        Raises:
            ValueError: a tensor this module has no parameter for, or one whose shape differs from an unsplit
                parameter's (the folder is not this model's).
        """
        parameters = dict(self.named_parameters())
        loaded = set()
        for name, weight in weights:
            head, _, rest = name.partition(".")
            merged, shard = self.stacked_params.get(head, (None, None))
            target = name if merged is None else f"{merged}.{rest}"
            if target not in parameters:
                raise ValueError(f"{self.prefix}.{name}: the checkpoint has a tensor this model does not (its "
                                 f"parameters here: {sorted(parameters)}); is the folder a JRT-RNN / Based model of "
                                 "this config?")
            parameter = parameters[target]
            loader = getattr(parameter, "weight_loader", default_weight_loader)
            if shard is None:
                if loader is default_weight_loader and parameter.shape != weight.shape:  # a tensor no rank splits
                    raise ValueError(f"{self.prefix}.{name}: checkpoint shape {tuple(weight.shape)}, model "
                                     f"{tuple(parameter.shape)}.")
                loader(parameter, weight)
            else:
                loader(parameter, weight, shard)
            loaded.add(target)
        return loaded


__all__ = ["StackedWeights", "shard_rows"]
