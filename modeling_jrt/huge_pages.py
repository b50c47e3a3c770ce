"""Transparent huge pages for large new CPU tensors (Linux): `advise_huge_pages`, what the chunked scan does with its
output (docs/prefill.md §4.2)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

# glibc's largest mmap threshold (64-bit): the advice only ever covers a mapping of the tensor's own.
HUGE_PAGE_MIN_BYTES = 32 << 20
_HUGE_PAGE = 2 << 20


@functools.cache
def libc_madvise():
    """libc's `madvise(address, length, advice)` (ints), or None where there is none to call (not Linux, no libc).
    Also what `jrt_convert` drops the read pages of a mapped checkpoint with."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back a new CPU tensor of at least `HUGE_PAGE_MIN_BYTES` with transparent huge pages: a fault on
    its 2 MiB-aligned part then maps 2 MiB, not one 4 KiB page (where THP is in `madvise` mode). No value changes."""
    if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() < HUGE_PAGE_MIN_BYTES:
        return
    madvise = libc_madvise()
    if madvise is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    start = tensor.untyped_storage().data_ptr()
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = (start + tensor.untyped_storage().nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if last > first:
        madvise(first, last - first, mmap.MADV_HUGEPAGE)  # advice: a failure changes nothing


__all__ = ["HUGE_PAGE_MIN_BYTES", "advise_huge_pages", "libc_madvise"]
