"""Safetensors shards written as the tensors are produced, one tensor in memory at a time.

`PreTrainedModel.save_pretrained` needs the whole state dict in memory and builds each shard's bytes before writing
it. A conversion instead knows every tensor's name, shape and dtype before it reads a single weight (the model is
built on the meta device), so it can plan the shards, write each shard's header first and then append the tensors
one by one as `produce(name)` returns them. The files are ordinary safetensors files with the names and the index
(`model.safetensors.index.json`) that `save_pretrained` writes, so `from_pretrained` loads them as usual.

    model-00001-of-00002.safetensors = [8-byte header length][JSON header, space-padded to 8 bytes][tensor bytes...]

The SHA-256 of every file is computed while it is written; the caller re-reads the files to verify them and records
the hashes in the conversion's manifest (`safety.write_manifest`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch

# safetensors' names of the dtypes a conversion writes (and reads back to check).
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: str | int) -> int:
    """Bytes in a size such as `5GB`, `500MiB`, `200KB` or `1000000` (decimal units are powers of 10, `*iB` of 2).

    Raises:
        ValueError: the size is not a positive number with one of the units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = value, ""
    else:
        match = _SIZE.match(str(value))
        if match is None or (match.group(2) or "").upper() not in _UNITS:
            raise ValueError(f"{value!r} is not a size: write a number with one of the units "
                             "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 5GB or 500MiB).")
        number, unit = float(match.group(1)), (match.group(2) or "").upper()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{value!r} is not a positive size; give e.g. 5GB.")
    return size


def tensor_bytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def plan_shards(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, max_shard_size: int
) -> list[tuple[str, list[str]]]:
    """Split the tensors, in order, into shards of at most `max_shard_size` bytes (a larger tensor gets a shard of its
    own), as `save_pretrained` does. Returns `[(file name, [tensor names])]`."""
    groups: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, shape in shapes.items():
        size = tensor_bytes(shape, dtype)
        if current and current_size + size > max_shard_size:
            groups.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not groups:
        groups.append(current)
    if len(groups) == 1:
        return [(WEIGHTS_NAME, groups[0])]
    count = len(groups)
    return [(f"model-{i + 1:05d}-of-{count:05d}.safetensors", group) for i, group in enumerate(groups)]


def write_shards(
    folder: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, max_shard_size: int,
    produce: Callable[[str], torch.Tensor], written: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Write the tensors of `shapes` (name -> shape, in order; shards as `plan_shards`) into `folder`; returns each
    file's SHA-256. `produce(name)` returns a tensor of exactly `dtype` and that shape; it is written, hashed and
    dropped before the next call, then `written(name)` is called (to release what produced it)."""
    plan = plan_shards(shapes, dtype, max_shard_size)
    hashes: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    for file_name, names in plan:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            size = tensor_bytes(shapes[name], dtype)
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shapes[name]), "data_offsets": [offset, offset + size]
            }
            offset += size
            weight_map[name] = file_name
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        digest = hashlib.sha256()
        with open(folder / file_name, "wb") as handle:
            for chunk in (struct.pack("<Q", len(encoded)), encoded):
                handle.write(chunk)
                digest.update(chunk)
            for name in names:
                tensor = produce(name)
                assert tensor.dtype == dtype and tuple(tensor.shape) == tuple(shapes[name]), (name, tensor.shape)
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                handle.write(data.data)
                digest.update(data.data)
                del tensor, data
                if written is not None:
                    written(name)
        hashes[file_name] = digest.hexdigest()
    if len(plan) > 1:
        total = sum(tensor_bytes(shape, dtype) for shape in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return hashes


__all__ = ["INDEX_NAME", "SAFETENSORS_DTYPES", "WEIGHTS_NAME", "parse_size", "plan_shards", "tensor_bytes",
           "write_shards"]
