"""The torch range pyproject declares is the one CI runs: its floor is the release `.ci/torch_releases` marks oldest
(run by `.ci/torch_matrix`, which `.ci/run` calls, next to the newest torch on PyPI), and the README names the same
floor."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declared_floor() -> str:
    match = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert match, "pyproject.toml declares no `torch>=` floor"
    return match.group(1)


def _releases() -> list[list[str]]:
    lines = (ROOT / ".ci" / "torch_releases").read_text(encoding="utf-8").splitlines()
    return [fields for fields in (line.split("#")[0].split() for line in lines) if fields]


def test_the_torch_floor_is_the_oldest_release_ci_runs():
    floor = _declared_floor()
    releases = _releases()
    oldest = [fields[0] for fields in releases if fields[1:] == ["oldest"]]
    assert len(oldest) == 1, releases
    assert oldest[0] == floor or oldest[0].startswith(floor + "."), (floor, oldest)
    assert ["newest"] in releases, "CI no longer runs the newest torch"
    assert "bash .ci/torch_matrix" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_the_readme_names_the_declared_floor():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert set(re.findall(r"torch>=([0-9.]+)", readme)) == {_declared_floor()}
