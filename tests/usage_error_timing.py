"""Run a `jrt` command in a fresh interpreter and time it: usage errors must answer before the heavy imports (torch,
transformers, lm-eval's models), in well under 2 s beyond the interpreter's own start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Seconds a usage error may take beyond starting the interpreter (the errors answer in about 0.1 s; importing torch
# alone takes longer than this on the test machines).
USAGE_ERROR_SECONDS = 2.0

HEAVY_MODULES = ("torch", "transformers", "datasets", "lm_eval.models")

_CHILD = """
import sys
from jrt_cli.main import main
code = main(sys.argv[2:])
heavy = sorted(name for name in sys.argv[1].split(",") if name in sys.modules)
print("heavy imports:", ",".join(heavy) or "none", file=sys.stderr)
sys.exit(code)
"""


def _run(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    return run, time.perf_counter() - start


def run_jrt(
    argv: list[str], cwd: Path = ROOT, heavy: tuple[str, ...] = HEAVY_MODULES
) -> tuple[int, str, float, float]:
    """(exit code, stderr without the import report, seconds taken, seconds the interpreter takes to start), after
    asserting that none of the `heavy` modules was imported."""
    _, startup = _run(["-c", "pass"], cwd)
    run, seconds = _run(["-c", _CHILD, ",".join(heavy), *argv], cwd)
    lines = run.stderr.splitlines()
    assert lines and lines[-1] == "heavy imports: none", run.stderr
    return run.returncode, "\n".join(lines[:-1]) + "\n", seconds, startup
