"""Nothing in the repository root shadows a third-party import name.

Running from a checkout puts its root first on `sys.path`. A top-level regular package named like a third-party
module (e.g. a `kernels/` folder with an `__init__.py`, which transformers probes for Hugging Face's kernel hub)
then breaks `from transformers import Trainer` and `import peft` with circular-import errors.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import importlib.util, sys, sysconfig
from transformers import Trainer
import peft
root = sys.argv[1]
# A venv may live in the checkout (`.ci/run` makes .venv there): what it installed is third-party, not the root's.
installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
for name in ("kernels", "convert", "cli", "benchmarks", "examples", "experiments", "synthetic", "docs", "tests"):
    spec = importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None) if spec is not None else None
    if origin is not None and origin.startswith(root) and not any(origin.startswith(path) for path in installed):
        raise SystemExit(f"{name!r} resolves to {origin}, inside the repository root")
print("ok")
"""


def test_transformers_and_peft_import_from_the_repository_root():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    process = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ROOT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.strip().endswith("ok")


def test_every_top_level_package_is_an_installed_name():
    """A folder in the root with an `__init__.py` is one of the distribution's own packages (its import name)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    top_level = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert top_level <= {name.split(".")[0] for name in packages}, top_level
