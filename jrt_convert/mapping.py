"""Strict key accounting: every reference tensor is consumed, every tensor of our model is filled, shapes match.

`map_state_dict` applies a family's key table (`families.py`) to a normalised reference state dict and returns a plan
of our model's state dict: for each of our tensors, the reference tensor (and the row block of it) it comes from.
Nothing is copied or converted until `WeightPlan.tensor` is asked for one tensor, so a conversion holds one converted
tensor at a time. Anything that does not fit (a missing reference key, a key no table names, a shape our model does not
expect, a tensor of ours left unfilled) stops the conversion with one error that lists all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint import ConversionError
from .families import (
    _LAYER_KEY, DECAY_BUFFER_KEY, GLOBAL_KEYS, TIED_HEAD_KEY, FamilySpec, ReferenceArchitecture, layer_key_table,
)

_LISTED = 20  # keys listed per problem in an error message


def full_key_table(spec: FamilySpec, arch: ReferenceArchitecture) -> dict[str, tuple[str, ...]]:
    """Every reference key the family's checkpoint must hold -> our key(s) (several = equal row blocks)."""
    table = dict(GLOBAL_KEYS)
    for i in range(arch.num_layers):
        for source, targets in layer_key_table(spec, arch, i).items():
            table[f"transformer.layers.{i}.{source}"] = tuple(f"model.layers.{i}.{target}" for target in targets)
    return table


def apply_family_renames(
    state_dict: dict[str, torch.Tensor], spec: FamilySpec, arch: ReferenceArchitecture
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The renames the family's reference loader performs (docs/reference_architecture.md §2.1, "Key renames"):
    [JRT]'s replaces `conv1` by `conv` in every key; a bare `mixer.conv.weight` of a convolution layer is read as
    `mixer.conv.conv.weight`."""
    renamed: dict[str, torch.Tensor] = {}
    conv_layers = {i for i, kind in enumerate(arch.layer_kinds) if kind == "conv"}
    conv1_renames = bare_conv_renames = 0
    for key, tensor in state_dict.items():
        name = key.replace("conv1", "conv") if spec.renames_conv1 else key
        conv1_renames += name != key
        layer = _LAYER_KEY.match(name)
        if name.endswith(".mixer.conv.weight") and layer and int(layer.group(1)) in conv_layers and tensor.dim() == 3:
            name = name.removesuffix("conv.weight") + "conv.conv.weight"
            bare_conv_renames += 1
        if name in renamed:
            raise ConversionError(f"Two reference keys map to {name!r} after the loader's renames (one is {key!r}).")
        renamed[name] = tensor
    notes = []
    if conv1_renames:
        notes.append(f"renamed 'conv1' -> 'conv' in {conv1_renames} keys, as the JRT loader does")
    if bare_conv_renames:
        notes.append(f"read {bare_conv_renames} 'mixer.conv.weight' keys as 'mixer.conv.conv.weight'")
    return renamed, notes


@dataclass(frozen=True)
class TensorSource:
    """Where one of our tensors comes from: row block `block` of `blocks` equal blocks of reference tensor `key`."""

    key: str
    block: int = 0
    blocks: int = 1


class WeightPlan:
    """Our model's tensors, each produced on demand from the (lazily read) reference tensors."""

    def __init__(self, source: dict[str, torch.Tensor], sources: dict[str, TensorSource]):
        self._source = source
        self.sources = sources

    def source_tensor(self, key: str) -> torch.Tensor:
        """The reference tensor our tensor `key` comes from (to release its memory-mapped pages once written)."""
        return self._source[self.sources[key].key]

    def tensor(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Our tensor `key` in `dtype` (a view of the reference tensor when nothing needs converting)."""
        origin = self.sources[key]
        tensor = self._source[origin.key]
        if origin.blocks > 1:
            tensor = tensor.chunk(origin.blocks, dim=0)[origin.block]
        return tensor.to(dtype)

    def release(self) -> None:
        """Drop the references to the reference tensors (and with them the memory map of the checkpoint)."""
        self._source = {}


def map_state_dict(
    state_dict: dict[str, torch.Tensor], spec: FamilySpec, arch: ReferenceArchitecture,
    target_shapes: dict[str, torch.Size],
) -> tuple[WeightPlan, list[str]]:
    """The plan (without the tied `lm_head.weight`) and notes about renamed and dropped keys, from a reference state
    dict after `normalise_keys` and our model's `state_dict()` shapes (the tied head included)."""
    source, notes = apply_family_renames(state_dict, spec, arch)
    table = full_key_table(spec, arch)
    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "shape": [], "unfilled": []}

    consumed = set(table)
    if TIED_HEAD_KEY in source:
        consumed.add(TIED_HEAD_KEY)
        embedding = source.get("transformer.embeddings.word_embeddings.weight")
        if embedding is not None and not torch.equal(source[TIED_HEAD_KEY], embedding):
            problems["shape"].append(
                f"{TIED_HEAD_KEY} differs from the word embeddings, but every released model ties them "
                "(tie_word_embeddings=True)"
            )
    if DECAY_BUFFER_KEY in source:
        consumed.add(DECAY_BUFFER_KEY)
        notes.append(_check_decay_buffer(source[DECAY_BUFFER_KEY], arch, problems["shape"]))

    sources: dict[str, TensorSource] = {}
    for source_key, target_keys in table.items():
        if source_key not in source:
            problems["missing"].append(source_key)
            continue
        tensor = source[source_key]
        if len(target_keys) > 1 and (tensor.dim() == 0 or tensor.shape[0] % len(target_keys)):
            problems["shape"].append(
                f"{source_key} {tuple(tensor.shape)}: rows not divisible into {len(target_keys)} blocks {target_keys}"
            )
            continue
        block_shape = (tensor.shape[0] // len(target_keys), *tensor.shape[1:]) if tensor.dim() else tensor.shape
        for block, target_key in enumerate(target_keys):
            expected = target_shapes.get(target_key)
            if expected is None:
                problems["unfilled"].append(f"{target_key} (named by the key table, absent from the model)")
            elif tuple(block_shape) != tuple(expected):
                problems["shape"].append(f"{source_key} {tuple(tensor.shape)} -> {target_key} expects {tuple(expected)}"
                                         + (f" per block of {len(target_keys)}" if len(target_keys) > 1 else ""))
            else:
                sources[target_key] = TensorSource(source_key, block, len(target_keys))
    problems["unexpected"] = sorted(k for k in source if k not in consumed)
    named_targets = {key for keys in table.values() for key in keys}
    problems["unfilled"] += sorted(k for k in target_shapes if k != TIED_HEAD_KEY and k not in named_targets)
    if any(problems.values()):
        raise ConversionError(_describe(problems, spec))
    return WeightPlan(source, sources), notes


def _check_decay_buffer(buffer: torch.Tensor, arch: ReferenceArchitecture, shape_problems: list[str]) -> str:
    """The fixed-decay buffer log(1 - 2**(c - h)) is recomputed by our model: check that it is the expected one."""
    if tuple(buffer.shape) != (arch.num_heads,):
        shape_problems.append(f"{DECAY_BUFFER_KEY} {tuple(buffer.shape)} expects ({arch.num_heads},)")
        return f"dropped {DECAY_BUFFER_KEY}"
    heads = torch.arange(arch.num_heads, dtype=torch.float64)
    expected = torch.log1p(-torch.pow(2.0, arch.decay_const - heads))
    if not torch.allclose(buffer.double(), expected, rtol=1e-4, atol=1e-6):
        shape_problems.append(f"{DECAY_BUFFER_KEY} holds {buffer.tolist()}, not log(1 - 2**(decay_const - h)) with "
                              f"decay_const={arch.decay_const:g}: check decay_const in config.json")
    return f"dropped {DECAY_BUFFER_KEY} (a constant: log(1 - 2**(decay_const - h)), decay_const={arch.decay_const:g})"


def _describe(problems: dict[str, list[str]], spec: FamilySpec) -> str:
    titles = {
        "missing": "reference keys missing from the checkpoint",
        "unexpected": "reference keys that no key table of the family uses",
        "shape": "tensors whose shape does not fit",
        "unfilled": "tensors of the converted model left unfilled",
    }
    lines = [f"The checkpoint does not match the {spec.name!r} family's key table:"]
    for kind, keys in problems.items():
        if keys:
            shown = "\n    ".join(keys[:_LISTED])
            more = f"\n    ... and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
            lines.append(f"  {len(keys)} {titles[kind]}:\n    {shown}{more}")
    lines.append("Check --family and that config.json belongs to these weights.")
    return "\n".join(lines)


__all__ = ["TensorSource", "WeightPlan", "apply_family_renames", "full_key_table", "map_state_dict"]
