"""Ahead-of-time build report of the Triton kernels: registers, spills, shared memory and SASS loops, no GPU needed.

Each launcher of `jrt_kernels` runs on small CPU tensors at the paper's B, H, K, V; the launch is intercepted and
compiled for sm_90 / sm_80 per autotune config and `VARIANTS` kind, from the exact arguments a GPU run would bind.
What each row reports and how: docs/kernels.md, "Inspecting the builds without a GPU".

    python benchmarks/kernel_aot.py                          # every kernel, config, arch, dtype and variant
    python benchmarks/kernel_aot.py --arch 90 --dtype bf16   # a subset
    python benchmarks/kernel_aot.py --json aot.json          # also write every row as JSON
    python benchmarks/kernel_aot.py --arch 90 --dtype bf16 --configs 1 --kernel prefix_linear_attention_bwd \
        --variant plain --spill-lines 12                     # and the 12 source lines that spill most
    python benchmarks/kernel_aot.py ... --live-in            # and each loop's loop-invariant values by kind

Needs only triton (with its bundled ptxas/nvdisasm) and torch; TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, without its warning

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import pla_bytes, pla_flops  # noqa: E402

# Per architecture: max dynamic shared memory per block (bytes), SMs, boost clock (Hz), dense bf16 peak, HBM B/s.
ARCHS = {
    90: dict(name="sm_90 (H100 SXM)", smem=232448, sms=132, clock=1.98e9, peak=989e12, bandwidth=3.35e12),
    80: dict(name="sm_80 (A100 SXM)", smem=166912, sms=108, clock=1.41e9, peak=312e12, bandwidth=2.0e12),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PAPER = dict(B=16, H=16, K=16, V=64)
PAPER_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
# Launch kinds built per case: key mask and initial state (a mask of the same kind in every row; a key-mask launch
# pair reports its one-range rows as "range+state"), and the encoder (M = N / 2 in the estimates, else 0). "decay+gate"
# is the Based checkpoints' kind (a fixed per-head decay, an input-dependent numerator gate, no encoder): the backward
# launches its dq scan in the RECOMPUTE form (the gate's gradient needs the ungated numerator).
VARIANTS = {
    "plain": dict(padded=False, encoder=True, based=False),
    "mask+state": dict(padded=True, encoder=True, based=False),
    "decay+gate": dict(padded=False, encoder=False, based=True),
}

# SASS opcode (first dot-separated part) -> class.
CLASSES = {
    "tensor": {"HMMA", "HGMMA", "IMMA", "BMMA", "QGMMA", "UTCHMMA"},
    "fp32": {"FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "MUFU", "FCHK", "FSET", "FSWZADD"},
    "convert": {"F2F", "F2FP", "F2I", "I2F", "I2FP", "HADD2", "HMUL2", "HFMA2", "PRMT"},
    "shuffle": {"SHFL"},
    "global": {"LDG", "STG", "LDGSTS", "LDGDEPBAR", "RED", "ATOM", "ATOMG", "REDG", "UTMALDG", "UTMASTG", "UBLKCP"},
    "shared": {"LDS", "STS", "LDSM", "STSM", "ATOMS"},
    "local": {"LDL", "STL"},
    "sync": {"BAR", "DEPBAR", "WARPSYNC", "WARPGROUP", "SYNCS", "MEMBAR", "ARRIVES", "FENCE", "BSYNC", "BSSY"},
    "control": {"BRA", "EXIT", "RET", "CALL", "JMP", "NOP", "BPT"},
}
OPCODE_CLASS = {opcode: name for name, opcodes in CLASSES.items() for opcode in opcodes}
CLASS_ORDER = ["tensor", "fp32", "int", "convert", "shuffle", "global", "shared", "local", "sync", "control"]


# ----------------------------------------------------------------------------------------------- capture and build


@dataclasses.dataclass
class Launch:
    """One intercepted kernel launch: the (autotuned) kernel, its arguments and its grid."""

    kernel: Autotuner | JITFunction
    args: tuple
    kwargs: dict
    grid: Callable | tuple

    @property
    def jit(self) -> JITFunction:
        return self.kernel.fn if isinstance(self.kernel, Autotuner) else self.kernel


def capture_launches(kernels: list[Autotuner | JITFunction], call: Callable[[], object]) -> list[Launch]:
    """Run `call` with the kernels' launches replaced by a recorder; return the launches in order."""
    launches: list[Launch] = []
    saved = [(kernel, kernel.__dict__.get("run")) for kernel in kernels]
    for kernel in kernels:
        def record(*args, grid, warmup=False, _kernel=kernel, **kwargs):
            launches.append(Launch(_kernel, args, kwargs, grid))

        kernel.run = record
    try:
        call()
    finally:
        for kernel, run in saved:
            if run is None:
                del kernel.run
            else:
                kernel.run = run
    return launches


def configs_of(case: Case, launch: Launch, arch: int) -> list[triton.Config]:
    """The configs `arch` would autotune over (the case's own list per architecture, else the autotuner's), or the
    launch's own options for a plain jit kernel."""
    if case.configs is not None:
        return case.configs(arch, launch.jit.__name__, launch.kwargs)
    if isinstance(launch.kernel, Autotuner):
        return list(launch.kernel.configs)
    options = {name: launch.kwargs[name] for name in ("num_warps", "num_stages") if name in launch.kwargs}
    return [triton.Config({}, **options)]


def compile_launch(launch: Launch, config: triton.Config, arch: int):
    """Compile one launch with one config for `arch` exactly as triton's JIT would; returns the CompiledKernel."""
    fn = launch.jit
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**launch.kwargs, **config.all_kwargs()}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill bytes and stack frame from `ptxas -v` with the flags triton uses."""
    from triton.backends.nvidia.compiler import get_ptxas

    gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as handle:
            handle.write(ptx)
        command = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu_name}", path,
                   "-o", path + ".o"]
        log = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    fields = dict(registers=r"Used (\d+) registers", spill_stores=r"(\d+) bytes spill stores",
                  spill_loads=r"(\d+) bytes spill loads", stack=r"(\d+) bytes stack frame")
    matches = {key: re.search(pattern, log) for key, pattern in fields.items()}
    return {key: int(match.group(1)) if match else 0 for key, match in matches.items()}


# ------------------------------------------------------------------------------------------------------ SASS loops

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(sass: str) -> list[tuple[int, str, int | None]]:
    """nvdisasm text -> [(address, opcode, branch target's address (-1: not found) or None)]."""
    instructions = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        label = _LABEL.match(line.strip())
        if label:
            pending.append(label.group(1))
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        address = int(match.group(1), 16)
        labels.update(dict.fromkeys(pending, address))
        pending = []
        target = _TARGET.search(match.group(4))
        instructions.append((address, match.group(2), target.group(1) if target else ""))
    return [(address, opcode, labels.get(target, -1) if target else None) for address, opcode, target in instructions]


def _top_level(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (start, end) ranges not nested in another, in order."""
    return sorted({r for r in ranges if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in ranges)})


def sass_loops(sass: str) -> tuple[list[dict], dict[str, int]]:
    """Top-level loops (ranges closed by a backward branch, not nested in another) and the whole kernel's mix.

    Returns ([{"start", "end", "count", "mix"} per loop in address order], mix of the whole kernel), where a mix
    maps an instruction class to its count.
    """
    instructions = parse_sass(sass)
    # a backward branch closes a loop (`target < address`: not the trailing `BRA self` trap)
    ranges = [(target, address) for address, opcode, target in instructions
              if opcode == "BRA" and target is not None and 0 <= target < address]
    classes = [(address, OPCODE_CLASS.get(opcode, "int")) for address, opcode, _ in instructions]
    loops = []
    for start, end in _top_level(ranges):
        mix = collections.Counter(name for address, name in classes if start <= address <= end)
        loops.append(dict(start=start, end=end, count=sum(mix.values()), mix=dict(mix)))
    return loops, dict(collections.Counter(name for _, name in classes))


_LOCATION = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LOCAL = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?(STL|LDL)(\S*)\s")
_LOCAL_BYTES = {".64": 8, ".128": 16, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}


def spill_lines(sass: str, source_file: str, loops: list[dict]) -> list[dict]:
    """Local-memory traffic (the spills) per line of `source_file` and region, from nvdisasm's `-gi` line info.

    Each STL / LDL counts at the last line of `source_file` named before it (code inlined from a helper in another
    file: its call site) and in its region: "before" the first loop, "loop i" (`sass_loops`' loops), "between" or
    "after" them. Returns [{"line", "region", "stores", "loads"}] in bytes, largest total first. A value stored before
    a loop and loaded inside it is loop-invariant work the compiler hoisted and could not keep in registers.
    """
    line = 0
    traffic: dict[tuple[int, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for text in sass.splitlines():
        location = _LOCATION.match(text)
        if location:
            if os.path.basename(location.group(1)) == os.path.basename(source_file):
                line = int(location.group(2))
            continue
        access = _LOCAL.match(text)
        if not access:
            continue
        address, opcode, suffix = int(access.group(1), 16), access.group(2), access.group(3)
        width = next((size for name, size in _LOCAL_BYTES.items() if name in suffix), 4)
        region = "after"
        for index, loop in enumerate(loops):
            if address < loop["start"]:
                region = "before" if index == 0 else "between"
                break
            if address <= loop["end"]:
                region = f"loop {index}"
                break
        traffic[line, region][opcode == "LDL"] += width
    rows = [dict(line=line, region=region, stores=stores, loads=loads)
            for (line, region), (stores, loads) in traffic.items()]
    return sorted(rows, key=lambda row: -(row["stores"] + row["loads"]))


# ------------------------------------------------------------------------------------------------------ PTX live-ins

_PTX_LABEL = re.compile(r"^(\$L__\w+):")
_PTX_BRANCH = re.compile(r"^(?:@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__\w+);")
_PTX_REGISTER = re.compile(r"%(?:rd|fd|rs|r|f|p|b|h)\d+\b")
# instructions that write no register (their first operand is an address, a label or nothing)
_PTX_NO_DESTINATION = ("st.", "bra", "bar.", "barrier.", "ret", "exit", "fence", "membar", "prefetch", "red.",
                       "cp.async", "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group", "stmatrix", "trap")


def _ptx_registers(values: set[str]) -> int:
    """The 32-bit registers a set of PTX values needs: 2 per 64-bit value, none for predicates (their own file)."""
    return sum(2 if r.startswith(("%rd", "%fd")) else 0 if r.startswith("%p") else 1 for r in values)


def _ptx_instruction(line: str) -> tuple[str, list[str], list[str]] | None:
    """(opcode, registers written, registers referenced) of one PTX instruction line, or None for anything else
    (labels, directives, comments, braces)."""
    text = line.split("//", 1)[0].strip()
    if not text or text[0] in ".{}$" or text.endswith(":"):
        return None
    guard = text.split(" ", 1)[0] if text.startswith("@") else ""  # a guard predicate is read, not written
    opcode, _, operands = text[len(guard):].strip().partition(" ")
    operands = operands.strip()
    referenced = _PTX_REGISTER.findall(guard + " " + operands)
    if opcode.startswith(_PTX_NO_DESTINATION):
        return opcode, [], referenced
    first = operands[1:operands.index("}")] if operands.startswith("{") else operands.split(",", 1)[0]
    return opcode, _PTX_REGISTER.findall(first), referenced


def ptx_live_in(ptx: str) -> list[dict]:
    """What each top-level PTX loop reads from before it: the values defined before the loop and referenced in it.

    A loop runs from a label to a later branch back to it. Values the loop also writes are "carried" (state,
    accumulators, the induction variable); the others are loop-invariant, held for the loop's whole length, and
    counted by kind: "descriptors" (wgmma shared-memory matrix descriptors), "b64" (other 64-bit values), "b32"
    and "predicates" (their own register file). Returns [{"start", "end" (PTX line numbers, 1-based), "invariant":
    {kind: count}, "registers" (32-bit registers the invariant values need), "carried", "carried_registers"}].
    """
    lines = ptx.splitlines()
    labels = {}
    ranges = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        label = _PTX_LABEL.match(text)
        if label:
            labels[label.group(1)] = number
            continue
        branch = _PTX_BRANCH.match(text)
        if branch and branch.group(1) in labels:
            ranges.append((labels[branch.group(1)], number))
    parsed = [_ptx_instruction(line) for line in lines]
    out = []
    for start, end in _top_level(ranges):
        before = {register for entry in parsed[: start - 1] if entry for register in entry[1]}
        inside = [entry for entry in parsed[start - 1: end] if entry]
        inside_written = {register for _, written, _ in inside for register in written}
        inside_read = {register for _, _, referenced in inside for register in referenced}
        descriptor_operands = {register for opcode, _, referenced in inside if opcode.startswith("wgmma.mma_async")
                               for register in referenced if register.startswith("%rd")}
        live = before & (inside_read | inside_written)
        invariant = live - inside_written
        kinds = dict.fromkeys(("descriptors", "b64", "b32", "predicates"), 0)
        for register in invariant:
            if register.startswith("%p"):
                kinds["predicates"] += 1
            elif register in descriptor_operands:
                kinds["descriptors"] += 1
            elif register.startswith(("%rd", "%fd")):
                kinds["b64"] += 1
            else:
                kinds["b32"] += 1
        carried = live & inside_written
        out.append(dict(start=start, end=end, invariant=kinds, registers=_ptx_registers(invariant),
                        carried=len(carried), carried_registers=_ptx_registers(carried)))
    return out


# ------------------------------------------------------------------------------------------------------ the cases


@dataclasses.dataclass
class Case:
    """A kernel launch to build: how to trigger it, and its per-program loop trip counts and grid at a shape.

    `launch(dtype, variant)` runs the launcher on a `VARIANTS` kind's inputs; `trips(kernel, meta, T, M)` gives the
    trip count of each top-level loop of the named kernel, `programs(meta, B, H, T, M)` the grid size, and
    `flops(T, M)` / `bytes(T, M, element_size)` the floors of all the case's launches per (batch, head).
    `configs(arch, kernel, kwargs)` lists what that architecture autotunes over or launches with, default first.
    """

    name: str
    kernels: Callable[[], list]
    launch: Callable[[torch.dtype, str], None]
    trips: Callable[[str, dict, int, int], list[int]] | None = None  # these four: None where `estimated` is False
    programs: Callable[[dict, int, int, int, int], int] | None = None
    flops: Callable[[int, int], float] | None = None
    bytes: Callable[[int, int, int], float] | None = None
    configs: Callable[[int, str, dict], list[triton.Config]] | None = None  # per (arch, kernel, launch kwargs)
    decode: bool = False  # one token per program: estimates for one step (T = 1), not per prefill length
    estimated: bool = True  # False: registers, spills and loops only (no issue estimate at the paper shape)


def _value_block_programs(meta: dict, B: int, H: int, T: int, M: int) -> int:
    """The prefill scans' grid: a program per (value block, batch, head)."""
    return math.ceil(PAPER["V"] / meta.get("BV", PAPER["V"])) * B * H


def _forward_case() -> Case:
    from jrt_kernels import prefix_linear_attention as module

    def launch(dtype: torch.dtype, variant: str) -> None:
        inputs = _variant_inputs(variant, dtype)
        # inference, then training: the forward that also stores what the backward reads (1 / (den + eps) and the
        # state after the encoder)
        for training in (False, True):
            module._prefix_linear_attention_fwd(*inputs, True, 1e-12, training)

    return Case(
        "prefix_linear_attention_fwd", launch=launch, programs=_value_block_programs,
        kernels=lambda: [module._kernel_for(torch.device("cpu"), PAPER["V"])],  # the autotuner a CPU launch takes
        trips=lambda kernel, meta, T, M: [math.ceil(M / meta["BT"]), math.ceil(T / meta["BT"])],
        flops=lambda T, M: pla_flops(T, M, PAPER["K"], PAPER["V"]),
        bytes=lambda T, M, size: pla_bytes(T, M, PAPER["K"], PAPER["V"], size),
        configs=lambda arch, kernel, kwargs: module.configs_for_architecture(arch // 10),
    )


def _backward_case() -> Case:
    from jrt_kernels import prefix_linear_attention_backward as module
    from jrt_kernels.prefix_linear_attention import encoder_state_numel

    def launch(dtype: torch.dtype, variant: str) -> None:
        q, k, v, k_enc, v_enc, start, end, mask, state, log_decay, gate = _variant_inputs(variant, dtype)
        B, T, H, _ = q.shape
        do = torch.randn_like(v)
        y = torch.randn_like(v)  # the forward's output, saved by the op's autograd
        # and what the op's autograd saves with it: the state after the encoder and 1 / (den + eps)
        saved = dict(inverse_denominator=torch.ones(B, T, H))
        if k_enc is not None:
            saved["encoder_state"] = torch.zeros(B, H, encoder_state_numel(PAPER["K"], PAPER["V"]))
        module.prefix_linear_attention_backward(q, k, v, k_enc, v_enc, do, state, encoder_start=start,
                                                encoder_end=end, key_mask=mask, initial_state=state,
                                                log_decay=log_decay, gate=gate, output=y, **saved)

    def trips(kernel: str, meta: dict, T: int, M: int) -> list[int]:
        encoder, decoder = math.ceil(M / meta["BT"]), math.ceil(T / meta["BT"])
        if "dq" in kernel:  # from the forward's encoder state (ENCODER_STATE) the dq scan has no encoder loop
            return [decoder] if meta.get("ENCODER_STATE") else [encoder, decoder]
        return [decoder, encoder]

    def configs(arch: int, kernel: str, kwargs: dict) -> list[triton.Config]:
        # the configs_for_architecture entry the backward launcher takes for this launch of `kernel`
        scan = "dkv" if "dq" not in kernel else "dq_recompute" if kwargs.get("RECOMPUTE") else "dq"
        constexprs = (module.dq_constexprs if "dq" in kernel else module.dkv_constexprs)(arch // 10)
        return [triton.Config({"BT": BT, **constexprs}, num_warps=warps, num_stages=1,
                              **module.launch_options(arch // 10))
                for BT, warps in module.configs_for_architecture(arch // 10)[scan]]

    return Case(
        "prefix_linear_attention_bwd", lambda: [module._pla_bwd_dq_kernel, module._pla_bwd_dkv_kernel], launch,
        trips=trips, programs=_value_block_programs, configs=configs,
        # dq (with the state rebuilt) + dk/dv: about 2 forwards
        flops=lambda T, M: 2 * pla_flops(T, M, PAPER["K"], PAPER["V"]),
        bytes=lambda T, M, size: 2 * pla_bytes(T, M, PAPER["K"], PAPER["V"], size),
    )


def _variant_inputs(variant: str, dtype: torch.dtype, B: int = PAPER["B"], T: int = 64, M: int = 32) -> tuple:
    """(q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, initial_state, log_decay, gate) of a `VARIANTS`
    kind, at the paper's H, K and V."""
    H, K, V = PAPER["H"], PAPER["K"], PAPER["V"]
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    kind = VARIANTS[variant]
    M = M if kind["encoder"] else 0
    k_enc = torch.randn(B, M, H, K, dtype=dtype) if M else None
    v_enc = torch.randn(B, M, H, V, dtype=dtype) if M else None
    start, end = torch.zeros(B, dtype=torch.long), torch.full((B,), M, dtype=torch.long)
    mask = torch.ones(B, T, dtype=torch.bool) if kind["padded"] else None
    state = torch.zeros(B, H, 1 + K + K * K, V + 1) if kind["padded"] else None
    log_decay = torch.log(torch.linspace(0.9, 0.999, H)) if kind["based"] else None
    gate = torch.rand(B, T, H, dtype=dtype) if kind["based"] else None
    return q, k, v, k_enc, v_enc, start, end, mask, state, log_decay, gate


def _decode_case() -> Case:
    """The serving decode step (`jrt_kernels.linear_attention_decode`): B requests' states updated at their slots in
    a pool. "plain" is JRT-RNN / Based without decay, "decay+gate" the Based decay variant; no key mask or encoder."""
    from jrt_kernels import linear_attention_decode as module

    K, V = PAPER["K"], PAPER["V"]
    F = 1 + K + K * K

    def launch(dtype: torch.dtype, variant: str) -> None:
        if variant == "mask+state":  # a decode step has neither
            return
        B, H = PAPER["B"], PAPER["H"]
        q, k = torch.randn(B, H, K, dtype=dtype), torch.randn(B, H, K, dtype=dtype)
        v = torch.randn(B, H, V, dtype=dtype)
        pool = torch.zeros(2 * B, H, F, V + 1)
        slots = torch.arange(B) * 2
        based = VARIANTS[variant]["based"]
        log_decay, gate = (torch.full((H,), -0.1), torch.rand(B, H, dtype=dtype)) if based else (None, None)
        module._linear_attention_decode(q, k, v, pool, slots, log_decay, gate, 1e-12)

    return Case(
        "linear_attention_decode", lambda: [module._linear_attention_decode_kernel], launch, decode=True,
        trips=lambda kernel, meta, T, M: [math.ceil(F / meta["BF"])], programs=lambda meta, B, H, T, M: B * H,
        flops=lambda T, M: 6 * F * (V + 1),  # decay, rank-1 update and read of the state
        bytes=lambda T, M, size: 2 * F * (V + 1) * 4 + (2 * K + 2 * V) * size,  # the state read and written once
    )


def _segments_case() -> Case:
    """The sequence-parallel prefill (inference): `_segment_states_kernel` and the forward kernel's SEGMENTED build,
    on T = 128 in segments of 64 tokens. No issue estimate: it runs for one sequence, not at the paper's B = 16."""
    from jrt_kernels import prefix_linear_attention as module

    def launch(dtype: torch.dtype, variant: str) -> None:
        inputs = _variant_inputs(variant, dtype, B=1, T=128, M=64)
        module._prefix_linear_attention_fwd(*inputs, True, 1e-12, False, module.SEGMENT_ALIGN)

    return Case(
        "prefix_linear_attention_segments", launch=launch, estimated=False,
        kernels=lambda: [module._kernel_for(torch.device("cpu"), PAPER["V"], module._segment_states_kernel),
                         module._kernel_for(torch.device("cpu"), PAPER["V"])],
        configs=lambda arch, kernel, kwargs: module.configs_for_architecture(arch // 10),
    )


def all_cases() -> list[Case]:
    return [_forward_case(), _backward_case(), _decode_case(), _segments_case()]


# ------------------------------------------------------------------------------------------------------ the report


def build_row(case: Case, launch: Launch, config: triton.Config, arch: int, dtype: str, variant: str,
              spill_lines_kept: int = 0) -> dict:
    """Compile one (launch, config, arch) and measure it; a build error becomes the row's `error`. The row's
    "spill_lines" are the `spill_lines_kept` source lines of the kernel that spill most (`spill_lines`)."""
    meta = {**launch.kwargs, **config.kwargs}
    encoder = VARIANTS[variant]["encoder"]
    if launch.kwargs.get("MASK") == 1:  # the forward's launch for the rows whose key mask is one range
        variant = "range+state"
    options = f" w{config.num_warps} s{config.num_stages}" + (f" r{config.maxnreg}" if config.maxnreg else "")
    row = dict(kernel=launch.jit.__name__, arch=arch, dtype=dtype, variant=variant,
               config=" ".join(f"{key}={value}" for key, value in config.kwargs.items()) + options,
               num_warps=config.num_warps, training=bool(launch.kwargs.get("SAVE_FOR_BACKWARD")),
               segmented=bool(launch.kwargs.get("SEGMENTED")))
    started = time.perf_counter()
    try:
        compiled = compile_launch(launch, config, arch)
    except Exception as error:  # noqa: BLE001 -- any compiler failure is reported, not fatal
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        return row
    row.update(ptxas_report(compiled.asm["ptx"], arch))
    row["shared"] = compiled.metadata.shared
    row["smem_ok"] = compiled.metadata.shared <= ARCHS[arch]["smem"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", "-gi", handle.name], check=True, capture_output=True, text=True).stdout
    loops, whole = sass_loops(sass)
    row["loops"] = loops
    if spill_lines_kept:
        row["spill_lines"] = spill_lines(sass, launch.jit.fn.__code__.co_filename, loops)[:spill_lines_kept]
    row["live_in"] = ptx_live_in(compiled.asm["ptx"])
    row["total_instructions"] = sum(whole.values())
    row["compile_s"] = round(time.perf_counter() - started, 1)
    row["estimates"] = estimates(case, row, meta, arch, dtype, encoder) if case.estimated else {}
    return row


def estimates(case: Case, row: dict, meta: dict, arch: int, dtype: str, encoder: bool = True
              ) -> dict[int, dict[str, float]]:
    """Issue-bound time, tensor-core and memory floors (ms) at the paper shape for each N (M = N / 2, or 0 without an
    encoder): issue = (instructions outside the loops + each loop's trip count x length) x num_warps x programs /
    (SMs x 4 schedulers x clock), a lower bound (docs/kernels.md); floors = FLOPs / bf16 peak, bytes / bandwidth."""
    spec = ARCHS[arch]
    size = DTYPES[dtype].itemsize
    in_loops = sum(loop["count"] for loop in row["loops"])
    out = {}
    for T in (1,) if case.decode else PAPER_LENGTHS:
        M = T // 2 if encoder and not case.decode else 0
        trips = case.trips(row["kernel"], meta, T, M)
        if len(trips) != len(row["loops"]):
            out[T] = dict(issue_ms=float("nan"))
            continue
        per_warp = row["total_instructions"] - in_loops + sum(t * loop["count"] for t, loop in zip(trips, row["loops"]))
        programs = case.programs(meta, PAPER["B"], PAPER["H"], T, M)
        issue = per_warp * row["num_warps"] * programs / (spec["sms"] * 4 * spec["clock"])
        tensor = case.flops(T, M) * PAPER["B"] * PAPER["H"] / spec["peak"]
        memory = case.bytes(T, M, size) * PAPER["B"] * PAPER["H"] / spec["bandwidth"]
        out[T] = dict(issue_ms=issue * 1e3, tensor_ms=tensor * 1e3, memory_ms=memory * 1e3)
    return out


def format_row(row: dict, show_live_in: bool = False) -> str:
    head = f"{row['kernel'].strip('_'):<28} sm_{row['arch']} {row['dtype']:<4} {row['variant']:<11} {row['config']:<22}"
    if "error" in row:
        return f"{head} BUILD ERROR {row['error']}"
    smem = f"{row['shared'] / 1024:6.1f}KB" + ("" if row["smem_ok"] else " OVER")
    head += " default" if row.get("default") else " " * 8
    head += " train" if row.get("training") else ""  # the training forward (stores what the backward reads)
    head += " segmented" if row.get("segmented") else ""  # the forward's build for the sequence-parallel prefill
    text = (f"{head} regs {row['registers']:3d} spill st/ld {row['spill_stores']:6d}/{row['spill_loads']:6d} B "
            f"smem {smem} instr {row['total_instructions']}")
    for index, loop in enumerate(row["loops"]):
        mix = " ".join(f"{name} {loop['mix'][name]}" for name in CLASS_ORDER if loop["mix"].get(name))
        text += f"\n    loop {index}: {loop['count']:5d} instr | {mix}"
    if show_live_in:
        for index, loop in enumerate(row["live_in"]):
            kinds = loop["invariant"]
            text += (f"\n    PTX loop {index} reads from before it: {sum(kinds.values())} loop-invariant values = "
                     f"{loop['registers']} registers ({kinds['descriptors']} wgmma descriptors, {kinds['b64']} other "
                     f"64-bit, {kinds['b32']} 32-bit; and {kinds['predicates']} predicates), {loop['carried']} "
                     f"loop-carried = {loop['carried_registers']} registers")
    if row.get("spill_lines"):
        text += "\n    spill st/ld B by source line: " + ", ".join(
            f"{entry['line']} ({entry['region']}) {entry['stores']}/{entry['loads']}" for entry in row["spill_lines"])
    if row["estimates"] and 1 in row["estimates"]:  # a decode step
        step = row["estimates"][1]
        text += (f"\n    one decode step (B={PAPER['B']}, H={PAPER['H']}): issue-bound {step['issue_ms'] * 1e3:.3g} "
                 f"us, floors: tensor {step['tensor_ms'] * 1e3:.3g} us, memory {step['memory_ms'] * 1e3:.3g} us")
    elif row["estimates"]:
        last = row["estimates"][PAPER_LENGTHS[-1]]
        text += "\n    issue-bound ms at N=" + " ".join(
            f"{T // 1024}k:{row['estimates'][T]['issue_ms']:.3g}" for T in PAPER_LENGTHS)
        if "tensor_ms" in last:
            text += f" | N=32k floors: tensor {last['tensor_ms']:.3g} ms, memory {last['memory_ms']:.3g} ms"
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="*", default=sorted(ARCHS, reverse=True), choices=sorted(ARCHS))
    parser.add_argument("--dtype", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--variant", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                        help="launch kinds (default: all): " + ", ".join(VARIANTS))
    parser.add_argument("--kernel", nargs="*", default=None,
                        help="cases: prefix_linear_attention_fwd, prefix_linear_attention_bwd, "
                        "linear_attention_decode, prefix_linear_attention_segments (default: all)")
    parser.add_argument("--configs", type=int, default=None, help="only the first N autotune configs")
    parser.add_argument("--json", default=None, help="also write every row to this JSON file")
    parser.add_argument("--spill-lines", type=int, default=0, metavar="N",
                        help="also print the N source lines (and regions) with the most spill traffic")
    parser.add_argument("--live-in", action="store_true",
                        help="also print what each PTX loop holds from before it (loop-invariant values by kind)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("kernel_aot.py compiles real GPU code: unset TRITON_INTERPRET (it makes triton.jit interpret on CPU).")

    print(f"triton {triton.__version__}, torch {torch.__version__}; paper shape B={PAPER['B']} H={PAPER['H']} "
          f"K={PAPER['K']} V={PAPER['V']}, M=N/2 (decay+gate: 0); issue bound = instructions x warps x programs / "
          "(SMs x 4 x clock)")
    for arch in args.arch:
        spec = ARCHS[arch]
        print(f"  {spec['name']}: {spec['sms']} SMs, {spec['clock'] / 1e9:.2f} GHz, smem/block {spec['smem']} B")
    rows = []
    for case in all_cases():
        if args.kernel and case.name not in args.kernel:
            continue
        for dtype, variant in itertools.product(args.dtype, args.variant):
            for launch in capture_launches(case.kernels(), lambda: case.launch(DTYPES[dtype], variant)):
                for arch in args.arch:
                    for index, config in enumerate(configs_of(case, launch, arch)[: args.configs]):
                        row = build_row(case, launch, config, arch, dtype, variant, args.spill_lines)
                        row["default"] = index == 0
                        print(format_row(row, args.live_in), flush=True)
                        rows.append(row)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
