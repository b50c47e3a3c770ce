"""The repository stands alone: every Markdown document a tracked file names exists in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Documents the code writes at run time (reports of the synthetic harness, a model card), not ones it cites.
GENERATED = {"results.md", "README.md"}


def _tracked_text_files() -> list[Path]:
    try:
        listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    suffixes = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".json", ".txt", ""}
    return [ROOT / name for name in listing.splitlines() if Path(name).suffix in suffixes and (ROOT / name).is_file()]


def test_every_cited_document_exists():
    present = {path.name for path in ROOT.rglob("*.md") if ".git" not in path.parts}
    missing = {}
    for path in _tracked_text_files():
        if path.name == "CHANGELOG.md":
            continue
        for name in re.findall(r"\b([A-Za-z_][A-Za-z0-9_-]*\.md)\b", path.read_text(encoding="utf-8", errors="ignore")):
            if name not in present and name not in GENERATED:
                missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"documents cited but not in the repository: {missing}"
