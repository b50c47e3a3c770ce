"""What keeps `jrt convert` from losing data: destination checks, pre-flight checks, staging and its cleanup.

The conversion writes into a hidden staging folder beside the destination and renames it into place once verified
(`pipeline.py`). This module decides whether a destination may be written at all, checks what can be checked before
minutes of work (writable, enough free space), turns SIGTERM into the same clean-up path as Ctrl-C, and removes the
staging and backup folders that an earlier run killed with SIGKILL left behind:

    parent/
        NAME/                          the destination (absent, or a previous conversion with its manifest)
        .NAME.tmp-<pid>-<random>/      staging of a running conversion (process <pid>)
        .NAME.old-<pid>-<random>/      the previous NAME during the swap of `--overwrite`
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import ConversionError

# The record of what a conversion wrote: every file of the output folder with its size and SHA-256. `--overwrite`
# replaces a folder only when it holds exactly these files, unchanged; anything else is the user's and is kept.
MANIFEST_NAME = "jrt_convert_manifest.json"
_MANIFEST_FORMAT = "jrt-convert-manifest/1"
_HASH_CHUNK = 16 * 2**20
# Free space kept beyond the estimated output (the model card, tokenizer and remote code are small).
_SPACE_MARGIN_BYTES = 64 * 2**20


def staging_prefix(destination: Path) -> str:
    """Name prefix of the staging folders of `destination`, for this process."""
    return f".{destination.name}.tmp-{os.getpid()}-"


def backup_name(destination: Path) -> str:
    """Name of the backup of an existing `destination` during the `--overwrite` swap, for this process."""
    return f".{destination.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sha256_of_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, hashes: dict[str, str] | None = None) -> None:
    """Record every file of the finished staging `folder` (relative path, size, SHA-256) in `folder/MANIFEST_NAME`;
    `hashes` are those already computed while writing (the weight shards), by relative path."""
    hashes = hashes or {}
    files = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name != MANIFEST_NAME:
            files[name] = {"size": path.stat().st_size, "sha256": hashes.get(name) or sha256_of_file(path)}
    manifest = {"format": _MANIFEST_FORMAT, "written_by": "jrt convert", "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class ManifestCheck:
    """Why a folder may not be replaced: its files that the manifest does not list, and those changed since."""

    unlisted: list[str]
    changed: list[str]
    manifest_problem: str | None = None

    @property
    def replaceable(self) -> bool:
        return not (self.unlisted or self.changed or self.manifest_problem)


def check_manifest(folder: Path) -> tuple[ManifestCheck, dict[str, tuple[int, int]]]:
    """Compare `folder` with the manifest a conversion wrote into it. Returns the check and the `(size, mtime_ns)` of
    each entry as checked, for a cheap `unchanged_since` right before the swap."""
    entries = sorted(folder.rglob("*"))
    names = [path.relative_to(folder).as_posix() for path in entries]
    stats = {name: _stat(path) for name, path in zip(names, entries)}
    others = [name for name, path in zip(names, entries) if name != MANIFEST_NAME and not path.is_dir()]
    folders = [name + "/" for name, path in zip(names, entries) if path.is_dir() and not path.is_symlink()]
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file() or manifest_path.is_symlink():
        return ManifestCheck(sorted(others + folders), [], f"no {MANIFEST_NAME}"), stats
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        listed = manifest["files"]
        if manifest.get("format") != _MANIFEST_FORMAT or not isinstance(listed, dict):
            raise ValueError(manifest.get("format"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ManifestCheck(sorted(others + folders), [], f"an unreadable {MANIFEST_NAME}"), stats
    unlisted, changed = [], []
    for name, path in zip(names, entries):
        if name == MANIFEST_NAME or (path.is_dir() and not path.is_symlink()):
            continue
        record = listed.get(name)
        if record is None or path.is_symlink():
            unlisted.append(name)
        elif not isinstance(record, dict) or path.stat().st_size != record.get("size") or (
            sha256_of_file(path) != record.get("sha256")
        ):
            changed.append(name)
    # Sub-folders of a conversion exist only to hold listed files (none today): any other folder is the user's.
    listed_parents = {parent for name in listed for parent in _parents(name)}
    unlisted += [name for name in folders if name.rstrip("/") not in listed_parents]
    return ManifestCheck(sorted(unlisted), sorted(changed)), stats


def unchanged_since(folder: Path, stats: dict[str, tuple[int, int]]) -> list[str]:
    """Paths of `folder` added, removed or modified since `check_manifest` returned `stats`."""
    now = {path.relative_to(folder).as_posix(): _stat(path) for path in folder.rglob("*")}
    return sorted(name for name in set(now) | set(stats) if now.get(name) != stats.get(name))


def _stat(path: Path) -> tuple[int, int]:
    info = path.lstat()
    return info.st_size, info.st_mtime_ns


def _parents(name: str) -> list[str]:
    parts = name.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _listing(names: list[str], limit: int = 10) -> str:
    """`names` for an error message, weight files first (what tells a model folder apart), at most `limit` of them."""
    names = sorted(names, key=lambda name: (not name.endswith((".safetensors", ".bin", ".pt")), name))
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_destination(source: Path | None, destination: Path, *, overwrite: bool) -> dict[str, tuple[int, int]]:
    """Refuse a destination whose replacement could lose data: the source, a folder containing it or inside it, an
    existing destination without `overwrite`, and with `overwrite` anything but an empty folder or one a previous
    conversion wrote, file for file and unchanged (`check_manifest`); the message names the files that would be lost.
    Returns the destination's entries as checked (`check_manifest`; empty when there are none)."""
    target = destination.expanduser().resolve()
    if source is not None:
        origin = source.expanduser().resolve()
        if target == origin or target in origin.parents:
            raise ConversionError(f"Destination {str(destination)!r} is the source checkpoint "
                                  f"or a folder containing it ({str(source)!r}); writing "
                                  "there would delete the source. Choose a new folder for DST.")
        if origin.is_dir() and origin in target.parents:
            raise ConversionError(f"Destination {str(destination)!r} is inside the source folder {str(source)!r}: "
                                  "the source is never written. Choose a folder outside it for DST.")
    if not destination.exists() and not destination.is_symlink():
        return {}
    if not overwrite:
        raise ConversionError(f"Destination {str(destination)!r} already exists; choose another "
                              "folder or pass --overwrite to replace it (it is replaced only "
                              "after the new conversion is complete and verified).")
    if destination.is_symlink() or not destination.is_dir():
        raise ConversionError(f"Destination {str(destination)!r} is not a folder; --overwrite replaces only a "
                              "folder that a previous conversion wrote. Remove it yourself or choose another DST.")
    if not any(destination.iterdir()):
        return {}
    check, stats = check_manifest(destination)
    if check.replaceable:
        return stats
    if check.manifest_problem is not None:
        raise ConversionError(f"Destination {str(destination)!r} was not written by `jrt convert` "
                              f"({check.manifest_problem}; it holds {_listing(check.unlisted)}), so "
                              "--overwrite will not replace it. Choose another DST, or empty it yourself.")
    reasons = []
    if check.unlisted:
        reasons.append(f"files the conversion did not write: {_listing(check.unlisted)}")
    if check.changed:
        reasons.append(f"files changed since the conversion: {_listing(check.changed)}")
    raise ConversionError(
        f"Destination {str(destination)!r} holds {'; and '.join(reasons)}. --overwrite replaces only what `jrt "
        "convert` wrote, unchanged, so nothing was touched: move those files out (or choose another DST) and run again."
    )


def remove_stale_staging(destination: Path) -> list[str]:
    """Remove the staging folders of `destination` whose process is gone, and settle interrupted `--overwrite` swaps;
    returns notes saying what was removed or restored.

    A backup `.NAME.old-*` of a dead process is the previous destination: it is moved back when the destination is
    missing (the run died between the two renames), else deleted. Folders of a live process are left alone.
    """
    parent = destination.parent
    if not parent.is_dir():
        return []
    notes = []
    pattern = re.compile(rf"^\.{re.escape(destination.name)}\.(tmp|old)-(\d+)-\w+$")
    for entry in sorted(parent.iterdir()):
        match = pattern.match(entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink() or _process_alive(int(match.group(2))):
            continue
        if match.group(1) == "old" and not destination.exists():
            os.replace(entry, destination)
            notes.append(f"restored {destination} from the backup {entry.name} of an interrupted --overwrite")
            continue
        shutil.rmtree(entry)
        notes.append(f"removed {entry.name}, left behind by an interrupted conversion")
    return notes


def check_writable(destination: Path) -> None:
    """The destination's parent can be created and written (checked by creating and removing a file)."""
    parent = destination.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{destination.name}.probe-"):
            pass
    except OSError as error:
        raise ConversionError(f"Cannot write next to the destination {str(destination)!r} "
                              f"({error.strerror or error}): choose a DST in a writable folder.") from error


def check_free_space(destination: Path, needed_bytes: int) -> None:
    """Enough free space in the destination's filesystem for the converted weights (plus a small margin)."""
    free = shutil.disk_usage(destination.parent).free
    needed = needed_bytes + _SPACE_MARGIN_BYTES
    if free < needed:
        raise ConversionError(f"Not enough free space for {str(destination)!r}: the converted folder "
                              f"needs about {_gib(needed)}, the filesystem has {_gib(free)} free. "
                              "Free some space, choose another DST, or convert with --dtype bf16.")


class Terminated(SystemExit):
    """Raised by the SIGTERM handler: exits with status 128 + SIGTERM, after the `finally`/`except` clean-ups."""


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """Within the block, SIGTERM (sent by `timeout`, Slurm, `docker stop`) raises `Terminated` like Ctrl-C raises
    KeyboardInterrupt, so the staging folder is removed. Outside the main thread signals cannot be caught: no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


__all__ = ["MANIFEST_NAME", "ManifestCheck", "Terminated", "backup_name", "check_destination", "check_free_space",
           "check_manifest", "check_writable", "remove_stale_staging", "sha256_of_file", "staging_prefix",
           "terminate_cleanly", "unchanged_since", "write_manifest"]
