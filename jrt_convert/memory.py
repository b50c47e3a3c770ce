"""Reading a memory-mapped file tensor by tensor in bounded memory.

A memory-mapped checkpoint costs no memory until it is read, but every page read stays in the process's resident set
(RSS) until the mapping goes away: reading a 5.5 GB checkpoint once, tensor by tensor, would still end at 5.5 GB.
`MappedPages.release(tensor)` tells the kernel that the pages under a tensor that has been used are not needed any more
(`madvise(MADV_DONTNEED)`). The pages are clean copies of the file, so nothing is lost: a later read faults them in
again from the file (or the page cache). Only pages inside a read-only file mapping are ever released, never
anonymous memory (which MADV_DONTNEED would zero).

Linux only; elsewhere `release` does nothing and the conversion simply uses more memory.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from modeling_jrt.huge_pages import libc_madvise

_MADV_DONTNEED = 4  # Linux
_PAGE = mmap.PAGESIZE


class MappedPages:
    """The address ranges at which this process maps `path` (from /proc/self/maps), and a way to drop read pages."""

    def __init__(self, path: Path):
        self._madvise = libc_madvise()
        self._ranges: list[tuple[int, int]] = []
        if self._madvise is None:
            return
        target = os.path.realpath(path)
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].strip() == target:
                        start, end = (int(value, 16) for value in fields[0].split("-"))
                        self._ranges.append((start, end))
        except OSError:
            self._ranges = []

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the resident pages under `tensor`'s data, if they lie inside the file mapping."""
        if not self._ranges or tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()  # the whole record: releasing a neighbour's pages early costs a re-read
        first, last = _whole_pages(storage.data_ptr(), storage.nbytes())
        if last <= first or not any(low <= first and last <= high for low, high in self._ranges):
            return
        self._madvise(first, last - first, _MADV_DONTNEED)


class NoRelease:
    """`MappedPages` for a source that is not memory-mapped (a legacy pickle read whole): nothing to release."""

    def release(self, tensor: torch.Tensor) -> None:
        return None


def release_mapping(buffer: mmap.mmap, offset: int, length: int) -> None:
    """Drop the resident pages of `buffer[offset:offset + length]` (a read-only file mapping made with `mmap`)."""
    first, last = _whole_pages(offset, length)
    if last > first and hasattr(buffer, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED, first, last - first)


def _whole_pages(start: int, length: int) -> tuple[int, int]:
    """The first and the end address of the whole pages inside `[start, start + length)`: the neighbours' edges stay."""
    return -(-start // _PAGE) * _PAGE, (start + length) // _PAGE * _PAGE


__all__ = ["MappedPages", "NoRelease", "release_mapping"]
