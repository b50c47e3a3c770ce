"""What keeps `jrt convert` from losing data: destination checks, pre-flight checks, staging and its cleanup.

The conversion writes into a hidden staging folder beside the destination and renames it into place once verified
(`pipeline.py`). This module decides whether a destination may be written at all, checks what can be checked before
minutes of work (writable, enough free space), turns SIGTERM into the same clean-up path as Ctrl-C, and removes the
staging and backup folders that an earlier run killed with SIGKILL left behind:

    parent/
        NAME/                          the destination (a previous conversion, or absent)
        .NAME.tmp-<pid>-<random>/      staging of a running conversion (process <pid>)
        .NAME.old-<pid>-<random>/      the previous NAME during the swap of `--overwrite`
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from .checkpoint import ConversionError

# Files a conversion writes (model, config, remote code, tokenizer, model card); a folder with anything else, or with
# sub-folders, was not written by `jrt convert` and is never replaced.
_CONVERSION_FILE = re.compile(
    r"^(config\.json|generation_config\.json|README\.md|model(-\d+-of-\d+)?\.safetensors"
    r"|model\.safetensors\.index\.json|[a-z_]+\.py|tokenizer(_config)?\.json|special_tokens_map\.json"
    r"|vocab\.json|merges\.txt|added_tokens\.json|chat_template\.jinja)$"
)
# Free space kept beyond the estimated output (the model card, tokenizer and remote code are small).
_SPACE_MARGIN_BYTES = 64 * 2**20


def staging_prefix(destination: Path) -> str:
    """Name prefix of the staging folders of `destination`, for this process."""
    return f".{destination.name}.tmp-{os.getpid()}-"


def backup_name(destination: Path) -> str:
    """Name of the backup of an existing `destination` during the `--overwrite` swap, for this process."""
    return f".{destination.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_conversion_output(folder: Path) -> bool:
    """Whether `folder` looks like a folder that `jrt convert` wrote: only its files (no sub-folders) and a
    `config.json` of a `jrt_rnn` model with the remote-code `auto_map`."""
    try:
        entries = list(folder.iterdir())
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict) or config.get("model_type") != "jrt_rnn" or "auto_map" not in config:
        return False
    return all(entry.is_file() and _CONVERSION_FILE.match(entry.name) for entry in entries)


def check_destination(source: Path | None, destination: Path, *, overwrite: bool) -> None:
    """Refuse a destination whose replacement could lose data.

    Refused: the source itself, a folder containing the source, an existing destination without `overwrite`, and with
    `overwrite` anything but an empty folder or a folder a previous conversion wrote (`is_conversion_output`).
    """
    target = destination.expanduser().resolve()
    if source is not None:
        origin = source.expanduser().resolve()
        if target == origin or target in origin.parents:
            raise ConversionError(
                f"Destination {str(destination)!r} is the source checkpoint or a folder containing it "
                f"({str(source)!r}); writing there would delete the source. Choose a new folder for DST."
            )
    if not destination.exists() and not destination.is_symlink():
        return
    if not overwrite:
        raise ConversionError(
            f"Destination {str(destination)!r} already exists; choose another folder or pass --overwrite to replace "
            "it (it is replaced only after the new conversion is complete and verified)."
        )
    if destination.is_symlink() or not destination.is_dir():
        raise ConversionError(
            f"Destination {str(destination)!r} is not a folder; --overwrite replaces only a folder that a previous "
            "conversion wrote. Remove it yourself or choose another DST."
        )
    if any(destination.iterdir()) and not is_conversion_output(destination):
        raise ConversionError(
            f"Destination {str(destination)!r} was not written by `jrt convert` (it holds other files or folders, or "
            "no jrt_rnn config.json with auto_map), so --overwrite will not delete it. Choose another DST, or empty "
            "it yourself."
        )


def remove_stale_staging(destination: Path) -> list[str]:
    """Remove the staging folders of `destination` whose process is gone, and settle interrupted `--overwrite` swaps.

    A backup `.NAME.old-*` of a dead process is the previous destination: it is moved back when the destination is
    missing (the run died between the two renames), else deleted. Folders of a live process are left alone.

    Returns:
        Notes saying what was removed or restored.
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
        raise ConversionError(
            f"Cannot write next to the destination {str(destination)!r} ({error.strerror or error}): choose a DST in "
            "a writable folder."
        ) from error


def check_free_space(destination: Path, needed_bytes: int) -> None:
    """Enough free space in the destination's filesystem for the converted weights (plus a small margin)."""
    free = shutil.disk_usage(destination.parent).free
    needed = needed_bytes + _SPACE_MARGIN_BYTES
    if free < needed:
        raise ConversionError(
            f"Not enough free space for {str(destination)!r}: the converted folder needs about {_gib(needed)}, the "
            f"filesystem has {_gib(free)} free. Free some space, choose another DST, or convert with --dtype bf16."
        )


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


__all__ = [
    "Terminated",
    "backup_name",
    "check_destination",
    "check_free_space",
    "check_writable",
    "is_conversion_output",
    "remove_stale_staging",
    "staging_prefix",
    "terminate_cleanly",
]
