"""`jrt_vllm.batch_plan`: the kind of a forward and the slots of a decode-only forward, from vLLM's metadata; and
`jrt_vllm.config.piecewise_cuda_graphs`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (`.ci/vllm` runs these tests in a venv with it)")

from vllm.v1.attention.backends.utils import NULL_BLOCK_ID  # noqa: E402

from vllm.config import CompilationConfig, CUDAGraphMode  # noqa: E402
from vllm.config.vllm import OptimizationLevel  # noqa: E402

from jrt_vllm.batch_plan import decode_slots, is_decode_only  # noqa: E402
from jrt_vllm.config import piecewise_cuda_graphs  # noqa: E402


@pytest.mark.parametrize("layout", ["1d", "2d"])
def test_decode_slots_point_padded_rows_at_the_null_block(layout):
    """vLLM's slots `(requests,)` or `(requests, 1)` int32 -> `(rows,)` int64; rows past them (a batch padded to a CUDA
    graph's size) read and write the null block, which no request owns."""
    slots = torch.tensor([5, 2, 9], dtype=torch.int32)
    metadata = SimpleNamespace(state_indices_tensor_d=slots if layout == "1d" else slots[:, None])
    assert decode_slots(metadata, 3).tolist() == [5, 2, 9]
    padded = decode_slots(metadata, 5)
    assert padded.dtype == torch.int64 and padded.tolist() == [5, 2, 9, NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert decode_slots(metadata, 2).tolist() == [5, 2]


@pytest.mark.parametrize(
    ("num_decodes", "num_prefills", "expected"), [(4, 0, True), (3, 1, False), (0, 2, False), (0, 0, False)]
)
def test_a_forward_is_decode_only_without_prefills(num_decodes, num_prefills, expected):
    """vLLM's state backends count a request without a state (a one-token prompt too) as a prefill."""
    metadata = SimpleNamespace(num_decodes=num_decodes, num_prefills=num_prefills)
    assert is_decode_only(metadata) is expected


@pytest.mark.parametrize(
    ("requested", "level", "expected"),
    [(None, "O0", "NONE"), (None, "O1", "PIECEWISE"), (None, "O2", "PIECEWISE"), (None, "O3", "PIECEWISE"),
     ("NONE", "O2", "NONE"), ("PIECEWISE", "O0", "PIECEWISE"), ("FULL", "O2", "PIECEWISE"),
     ("FULL_DECODE_ONLY", "O2", "PIECEWISE"), ("FULL_AND_PIECEWISE", "O0", "PIECEWISE")],
)
def test_only_piecewise_cuda_graphs(requested, level, expected, caplog):
    """A mode with full graphs becomes PIECEWISE, whether asked for (warned about) or the default of vLLM's
    optimization level (None: FULL_AND_PIECEWISE from O2 on, which vLLM would apply after the plugin); NONE (the
    default of O0 too) and PIECEWISE stay."""
    config = SimpleNamespace(
        compilation_config=CompilationConfig(cudagraph_mode=None if requested is None else CUDAGraphMode[requested]),
        optimization_level=OptimizationLevel[level],
    )
    with caplog.at_level("WARNING", logger="jrt_vllm.config"):
        piecewise_cuda_graphs(config)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode[expected]
    warned = [record.getMessage() for record in caplog.records if record.name == "jrt_vllm.config"]
    if requested in (None, "NONE", "PIECEWISE"):
        assert warned == []
    else:
        assert len(warned) == 1 and f"cudagraph_mode={requested} changed to PIECEWISE" in warned[0]
