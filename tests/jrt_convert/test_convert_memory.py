"""Bounded memory: the pages of a memory-mapped checkpoint leave the resident set once a tensor is used, read back
unchanged, and memory that is not part of the file mapping is never touched."""

from __future__ import annotations

import sys

import pytest
import torch

from jrt_convert.memory import MappedPages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="pages are released with madvise and measured in /proc (Linux)"
)


def _resident_file_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_released_pages_leave_the_resident_set_and_read_back_unchanged(tmp_path):
    weights = torch.randn(16 * 2**20, generator=torch.Generator().manual_seed(0))  # 64 MiB
    torch.save({"w": weights, "b": torch.ones(3)}, tmp_path / "pytorch_model.bin")
    mapped = torch.load(tmp_path / "pytorch_model.bin", mmap=True, weights_only=True)["w"]
    pages = MappedPages(tmp_path / "pytorch_model.bin")

    before = _resident_file_bytes()
    assert float(mapped.sum()) == pytest.approx(float(weights.sum()), rel=1e-4)  # reads every page
    assert _resident_file_bytes() - before > 48 * 2**20
    touched = _resident_file_bytes()
    pages.release(mapped)
    assert touched - _resident_file_bytes() > 48 * 2**20
    assert torch.equal(mapped, weights)  # faulted in again from the file


def test_memory_outside_the_file_mapping_is_never_released(tmp_path):
    torch.save({"w": torch.ones(4)}, tmp_path / "pytorch_model.bin")
    kept = torch.load(tmp_path / "pytorch_model.bin", mmap=True, weights_only=True)  # keeps the mapping alive
    pages = MappedPages(tmp_path / "pytorch_model.bin")
    anonymous = torch.full((4 * 2**20,), 7.0)  # would read back as zeros if its pages were dropped
    pages.release(anonymous)
    assert bool((anonymous == 7.0).all()) and torch.equal(kept["w"], torch.ones(4))
