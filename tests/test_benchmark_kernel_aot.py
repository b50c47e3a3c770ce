"""benchmarks/kernel_aot.py: the SASS loop parser on a hand-written listing, and one real sm_90 build (no GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "kernel_aot.py"
NO_TRITON = importlib.util.find_spec("triton") is None
pytestmark = pytest.mark.skipif(NO_TRITON, reason="triton is not installed")

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x32x16.F32.BF16 R136, R60, gdesc[UR16].tnspB, R136 ;
        /*0020*/                   FFMA R2, R3, R4, R2 ;
.L_x_1:
        /*0030*/                   STL [R1+0x14c], R153 ;
        /*0040*/              @!P2 BRA `(.L_x_1) ;
        /*0050*/                   SHFL.BFLY PT, R5, R6, 0x1, 0x1f ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   BRA `(.L_x_2) ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
"""


# line info as `nvdisasm -gi` prints it: a helper's line "inlined at" the kernel's, then the kernel's own line
SPILL_SASS = """
	//## File "/src/kernel.py", line 10
        /*0000*/                   STL [R1+0x4], R2 ;
	//## File "/src/_common.py", line 5 inlined at "/src/kernel.py", line 20
	//## File "/src/kernel.py", line 20
.L_x_0:
        /*0010*/                   LDL.64 R4, [R1+0x8] ;
	//## File "/src/_common.py", line 7
        /*0020*/                   STL.128 [R1+0x10], R8 ;
        /*0030*/              @P0 BRA `(.L_x_0) ;
	//## File "/src/kernel.py", line 30
        /*0040*/              @!P1 LDL R2, [R1+0x4] ;
        /*0050*/                   EXIT ;
"""


# a PTX loop ($L__BB0_1 .. its back branch) after a prologue: %rd2, %rd3 wgmma descriptors and %p1 a predicate
# defined before it and only read in it (invariant), %r1 and %f1 written in it too (carried), %rd1 and %rd4 not read
# in it; the second loop reads %rd4 (invariant) and %r3 (written in it)
LIVE_IN_PTX = """
.visible .entry k(
	.param .u64 k_param_0
)
{
	.reg .b32 	%r<4>;
	ld.param.b64 	%rd1, [k_param_0];
	mov.u32 	%r1, 0;
	or.b64 	%rd2, %rd1, 16;   // a descriptor
	add.s64 	%rd3, %rd1, 8;
	mov.b64 	%rd4, 7;
	setp.gt.u32 	%p1, %r1, 3;
	mov.f32 	%f1, 0f00000000;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	add.f32 	%f1, %f1, 0f3F800000;
	wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%f1}, %rd2, %rd3, %p1, 1, 1, 0, 0;
	@%p1 selp.b32 	%r2, %r1, 1, %p1;
	st.shared.b32 	[%r1], %r2;
	add.s32 	%r1, %r1, 1;
	setp.lt.u32 	%p2, %r1, 10;
	@%p2 bra 	$L__BB0_1;
	bra.uni 	$L__BB0_3;
	mov.u32 	%r3, 0;
$L__BB0_3:
	add.s64 	%rd5, %rd4, 1;
	add.s32 	%r3, %r3, 1;
	@%p2 bra 	$L__BB0_3;
	ret;
}
"""


@pytest.fixture(scope="module")
def kernel_aot(load_benchmark):
    return load_benchmark("kernel_aot")


def run_tool(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run kernel_aot.py compiled (TRITON_INTERPRET unset) with `args` and `--json`; its result and JSON rows."""
    output = tmp_path / "aot.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, str(TOOL), *args, "--json", str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result, json.loads(output.read_text())


def test_sass_loops_finds_top_level_loops(kernel_aot):
    loops, whole = kernel_aot.sass_loops(SASS)
    assert [(loop["start"], loop["end"], loop["count"]) for loop in loops] == [(0x10, 0x60, 6)]
    assert loops[0]["mix"] == {"tensor": 1, "fp32": 1, "local": 1, "control": 2, "shuffle": 1}
    assert sum(whole.values()) == 10


def test_spill_lines_attributes_local_memory_to_kernel_lines(kernel_aot):
    """Each STL / LDL counts its width at the last line of the kernel's file before it (a helper's code at its call
    site), in its region: before the loop, in it, after it."""
    loops, _ = kernel_aot.sass_loops(SPILL_SASS)
    assert [(loop["start"], loop["end"]) for loop in loops] == [(0x10, 0x30)]
    rows = kernel_aot.spill_lines(SPILL_SASS, "/elsewhere/kernel.py", loops)
    assert rows == [
        dict(line=20, region="loop 0", stores=16, loads=8),
        dict(line=10, region="before", stores=4, loads=0),
        dict(line=30, region="after", stores=0, loads=4),
    ]


def test_ptx_live_in_counts_loop_invariant_and_carried_values(kernel_aot):
    """Values defined before a loop and read in it: invariant unless the loop writes them, by kind (wgmma
    descriptors, other 64-bit, 32-bit, predicates), with the 32-bit registers they need."""
    first, second = kernel_aot.ptx_live_in(LIVE_IN_PTX)
    lines = LIVE_IN_PTX.splitlines()
    assert lines[first["start"] - 1].startswith("$L__BB0_1:") and "bra \t$L__BB0_1" in lines[first["end"] - 1]
    assert first["invariant"] == dict(descriptors=2, b64=0, b32=0, predicates=1)
    assert (first["registers"], first["carried"], first["carried_registers"]) == (4, 2, 2)
    assert second["invariant"] == dict(descriptors=0, b64=1, b32=0, predicates=1)
    assert (second["registers"], second["carried"], second["carried_registers"]) == (2, 1, 1)


def test_one_sm90_build_reports_registers_spills_and_loops(tmp_path):
    """The forward kernel's first config, bf16, for sm_90: compiled from the launcher's own arguments, for inference
    and for training (the build that also stores the state after the encoder for the backward)."""
    result, rows = run_tool(
        tmp_path, "--arch", "90", "--dtype", "bf16", "--variant", "plain", "--configs", "1",
        "--kernel", "prefix_linear_attention_fwd", "--spill-lines", "100", "--live-in",
    )
    assert [row.get("training") for row in rows] == [False, True] and not any("error" in row for row in rows), rows
    for row in rows:  # the attribution accounts for every byte ptxas reports
        assert sum(entry["stores"] for entry in row["spill_lines"]) == row["spill_stores"], row["spill_lines"]
        assert sum(entry["loads"] for entry in row["spill_lines"]) == row["spill_loads"], row["spill_lines"]
    for row in rows:
        assert 16 <= row["registers"] <= 255 and row["spill_stores"] >= 0 and row["shared"] > 0
        assert len(row["loops"]) == 2 and all(loop["mix"].get("tensor", 0) > 0 for loop in row["loops"])
        assert row["estimates"]["32768"]["issue_ms"] > 0
        # the same two loops in the PTX, each reading the state (carried) and invariant values from before it
        assert len(row["live_in"]) == 2, row["live_in"]
        assert all(loop["carried_registers"] >= 64 and loop["registers"] > 0 for loop in row["live_in"]), row["live_in"]
    assert rows[1]["total_instructions"] > rows[0]["total_instructions"]  # the store
    assert "PTX loop 1 reads from before it:" in result.stdout
    assert "issue-bound ms at N=" in result.stdout and " train regs" in result.stdout


def test_plain_kernel_options_serve_every_architecture(kernel_aot):
    """A plain jit launch's num_warps / num_stages are read for each architecture, not consumed by the first one."""
    case = kernel_aot.Case("case", list, lambda *a: None, None, None, None, None)
    launch = kernel_aot.Launch(None, (), {"BT": 32, "num_warps": 8, "num_stages": 1}, (1,))
    for arch in (90, 80):
        (config,) = kernel_aot.configs_of(case, launch, arch)
        assert (config.num_warps, config.num_stages) == (8, 1)


def test_gated_based_backward_keeps_its_registers_on_sm80(tmp_path):
    """The "decay+gate" variant (the Based checkpoints' backward: the recomputing dq scan and the dk/dv scan with
    decay and gate, no encoder) builds both scans at their sm_80 defaults, with the register bound of
    `launch_options`, and ptxas keeps >= 128 registers (without `.maxnreg` the dq scan got 32 and spilled 15 KB)."""
    _, rows = run_tool(
        tmp_path, "--arch", "80", "--dtype", "bf16", "--variant", "decay+gate", "--configs", "1",
        "--kernel", "prefix_linear_attention_bwd",
    )
    assert [row["kernel"] for row in rows] == ["_pla_bwd_dq_kernel", "_pla_bwd_dkv_kernel"], rows
    for row in rows:
        assert "error" not in row and row["variant"] == "decay+gate" and row["default"], row
        assert row["config"].endswith(" r255") and row["registers"] >= 128, row
        # no encoder: the estimate runs the decoder loop only (M = 0)
        assert row["estimates"]["32768"]["issue_ms"] > 0


def test_decode_kernel_builds_without_spills_and_near_its_memory_floor(tmp_path):
    """The serving decode step (`linear_attention_decode`) for sm_90: one loop over the feature blocks, no spills,
    no shared-memory staging, and an issue estimate per step (not per prefill length) within 2x of the time it takes
    to read and write each state once (the kernel's point: no gather and write-back)."""
    result, rows = run_tool(tmp_path, "--arch", "90", "--dtype", "bf16", "--kernel", "linear_attention_decode")
    assert [row["variant"] for row in rows] == ["plain", "decay+gate"], rows  # a decode step has no key mask
    for row in rows:
        assert "error" not in row and row["spill_stores"] == row["spill_loads"] == 0, row
        assert len(row["loops"]) == 1 and row["registers"] <= 255
        step = row["estimates"]["1"]
        assert 0 < step["issue_ms"] < 2 * step["memory_ms"], step
    assert "one decode step (B=16, H=16): issue-bound" in result.stdout


def test_segmented_prefill_builds(tmp_path):
    """The sequence-parallel prefill's two kernels for sm_90 (bf16, no mask): the segment-state reduction and the
    forward's SEGMENTED build, both from the launcher's own arguments, with their loops and without an issue
    estimate (they run for one sequence, not at the paper's batch)."""
    result, rows = run_tool(
        tmp_path, "--arch", "90", "--dtype", "bf16", "--variant", "plain", "--configs", "1",
        "--kernel", "prefix_linear_attention_segments",
    )
    assert [row["kernel"] for row in rows] == ["_segment_states_kernel", "_prefix_linear_attention_fwd_kernel"], rows
    assert [row["segmented"] for row in rows] == [False, True]
    for row in rows:
        assert "error" not in row and 16 <= row["registers"] <= 255 and row["estimates"] == {}, row
        assert all(loop["mix"].get("tensor", 0) > 0 for loop in row["loops"])
    # the segment states: a decoder loop and an encoder loop; the SEGMENTED forward: its scan only (the encoder loop,
    # empty by construction there, is compiled away)
    assert [len(row["loops"]) for row in rows] == [2, 1]
    assert " segmented regs" in result.stdout and "issue-bound" not in result.stdout
