"""Reading a reference checkpoint safely: `config.json` plus `pytorch_model.bin` or a Lightning `.ckpt`.

The released checkpoints are pickles (docs/reference_architecture.md §2), read with `torch.load(weights_only=True)`
only (tensors and plain containers; anything else is refused, so a checkpoint cannot run code). `normalise_keys` then
does what the reference loader does to every family's keys; the family-specific renames and the checked-then-dropped
keys (tied head, decay buffer) are in `mapping.py`, the key tables in `families.py`.
"""

from __future__ import annotations

import pickle
import re
import struct
import zipfile
from pathlib import Path

import torch

from .memory import MappedPages, NoRelease
from .source_files import ConversionError


def load_state_dict_safely(
    path: Path, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], MappedPages | NoRelease]:
    """Tensors of a `pytorch_model.bin` or a Lightning `.ckpt`, read with `torch.load(weights_only=True)`; a value
    that does not fit `dtype` (the conversion's target) is refused here, by name.

    A zip checkpoint (torch >= 1.6) is memory-mapped: its tensors are read from the file when used. A legacy (pre-zip)
    pickle cannot be mapped and is read whole.

    Returns:
        (the raw state dict (for a Lightning checkpoint, its `state_dict` entry), the handle that releases the
        memory-mapped pages of a used tensor).
    """
    kind = check_file_integrity(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=kind == "zip")
    except pickle.UnpicklingError as error:
        # What the pickle imports decides, not the words of one torch release (they changed: "Unsupported global",
        # "... whose module ... is blocked"): a global outside torch's weights-only allow list is an object refused.
        foreign = _foreign_globals(path, kind)
        if not foreign and not _refused_object(error):
            raise _damaged(path, kind, error, weights_only="WeightsUnpickler error" in str(error)) from error
        named = f" ({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''})" if foreign else ""
        raise ConversionError(f"Refusing to load {str(path)!r}: it contains Python objects "
                              f"other than tensors and plain containers{named}, and unpickling "
                              "those could run arbitrary code (the file is only read with "
                              "`torch.load(weights_only=True)`). If you trust the file, "
                              f"{_EXTRACT_WEIGHTS} torch says: {_unpickler_reason(error)}") from error
    except _READ_ERRORS as error:  # a damaged file makes the unpickler fail in many ways
        raise _damaged(path, kind, error) from error
    is_lightning = isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict)
    state_dict = loaded["state_dict"] if is_lightning else loaded
    if not isinstance(state_dict, dict):
        raise ConversionError(f"{str(path)!r} holds a {type(state_dict).__name__}, not a state dict (a mapping "
                              "of names to tensors) or a Lightning checkpoint with a 'state_dict' entry.")
    not_tensors = sorted(str(k) for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ConversionError(f"{str(path)!r}: these state-dict entries are not tensors: {not_tensors}.")
    pages = MappedPages(path) if kind == "zip" else NoRelease()
    check_tensor_values(path, {k: v for k, v in state_dict.items() if "metrics" not in k}, dtype, pages)
    return state_dict, pages


# What a damaged legacy pickle (or a damaged zip record) can raise inside torch.load.
_READ_ERRORS = (EOFError, RuntimeError, zipfile.BadZipFile, IndexError, KeyError, ValueError, TypeError,
                AttributeError, struct.error, OverflowError, MemoryError)
_REAL_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# How to convert a trusted checkpoint that holds Python objects besides tensors.
_EXTRACT_WEIGHTS = (
    "extract the weights in a separate step, e.g. `python -c \"import torch; ck = torch.load('FILE', "
    "weights_only=False); torch.save(ck.get('state_dict', ck), 'pytorch_model.bin')\"`, and convert that."
)


def check_tensor_values(
    path: Path, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None,
    pages: MappedPages | NoRelease | None = None,
) -> None:
    """Refuse, naming the tensors, anything but dense real floating point (complex, integer, boolean, sparse), NaN or
    Inf values, and values that overflow `dtype` (1e5 in float16, 1e300 in float32).

    One tensor at a time, with its minimum and maximum only (no converted copy), releasing each tensor's mapped pages
    once checked (`pages`): memory stays bounded.
    """
    pages = pages or NoRelease()
    wrong_kind, non_finite, overflow = [], [], []
    largest = 0.0
    for key, tensor in state_dict.items():
        if tensor.layout != torch.strided:
            wrong_kind.append(f"{key!r} ({str(tensor.layout).removeprefix('torch.')} {tensor.dtype})")
            continue
        if tensor.dtype not in _REAL_FLOATS:
            wrong_kind.append(f"{key!r} ({tensor.dtype})")
            continue
        if tensor.numel() == 0:
            continue
        low, high = torch.aminmax(tensor)
        ends = torch.stack([low, high])
        pages.release(tensor)
        if not bool(torch.isfinite(ends).all()):
            non_finite.append(key)
        elif dtype is not None and not bool(torch.isfinite(ends.to(dtype)).all()):
            overflow.append(key)
            largest = max(largest, float(ends.abs().max()))
    if wrong_kind:
        raise ConversionError(f"{str(path)!r}: these tensors are not dense real floating point, as model "
                              f"weights are: {_names(wrong_kind)}. Only float32, float64, float16 and bfloat16 "
                              "weights can be converted; check that the file is the model's checkpoint.")
    if non_finite:
        raise ConversionError(f"{str(path)!r}: these tensors hold NaN or Inf values: {_names(non_finite)}. "
                              "The checkpoint is damaged or diverged; a converted model would give NaN logits.")
    if overflow:
        limit = torch.finfo(dtype).max
        fix = ("convert with --dtype bfloat16 or float32, which reach 3.4e+38" if limit < torch.finfo(torch.float32).max
               else "the checkpoint is damaged or diverged")
        raise ConversionError(f"{str(path)!r}: these tensors hold values beyond "
                              f"{str(dtype).removeprefix('torch.')}'s range (+-{limit:.4g}; largest magnitude "
                              f"found {largest:.4g}): {_names(overflow)}. They would become Inf: {fix}.")


def _names(names: list[str], limit: int = 20) -> str:
    shown = [name if name.startswith("'") else repr(name) for name in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return "[" + ", ".join(shown) + "]" + more


def _refused_object(error: pickle.UnpicklingError) -> bool:
    """Whether torch's message says its weights-only unpickler refused a Python object (the fallback when the pickle's
    imports cannot be read, `_foreign_globals`)."""
    text = str(error).lower()
    return any(marker in text for marker in ("unsupported global", "unsupported class", "is blocked"))


# The pickle opcodes that import a module attribute (a class or a function the unpickler would call).
_IMPORT_OPCODES = {"GLOBAL", "INST", "STACK_GLOBAL"}
_STRING_OPCODES = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
# What a state dict's pickle imports when torch's own allow list cannot be read (a torch without the private helper).
_PLAIN_GLOBALS = {"collections.OrderedDict", "builtins.set", "builtins.frozenset", "_codecs.encode"}
_DOTTED_NAME = re.compile(r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")


def _foreign_globals(path: Path, kind: str) -> list[str]:
    """The classes and functions the checkpoint's pickle imports that `torch.load(weights_only=True)` does not allow,
    in order of appearance, by `module.name` (read with `pickletools`, nothing is executed); [] when there are none
    or the pickle is too damaged to read that far."""
    allowed = _allowed_globals()
    found: list[str] = []
    for name in _pickled_globals(path, kind):
        is_allowed = name in allowed if allowed else name.startswith("torch.") or name in _PLAIN_GLOBALS
        if not is_allowed and name not in found:
            found.append(name)
    return found


def _allowed_globals() -> set[str]:
    """`module.name` of the globals torch's weights-only unpickler accepts (its defaults and `add_safe_globals`)."""
    try:
        from torch import _weights_only_unpickler as unpickler

        return set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals())
    except (ImportError, AttributeError, TypeError):
        return set()


def _pickled_globals(path: Path, kind: str) -> list[str]:
    """`module.name` of every GLOBAL / INST / STACK_GLOBAL in the checkpoint's object pickle (`data.pkl` of a zip
    checkpoint; the pickles of a legacy file up to its storages); [] when a pickle does not parse to its STOP (damaged
    bytes can look like an import)."""
    import io
    import pickletools

    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as archive:
                names = [name for name in archive.namelist() if name.endswith("data.pkl") and name.count("/") <= 1]
                streams = [io.BytesIO(archive.read(names[0]))] if names else []
                count = 1
        else:
            streams, count = [open(path, "rb")], 4  # magic number, protocol, system info, then the objects
    except (OSError, zipfile.BadZipFile, KeyError):
        return []
    found: list[str] = []
    for stream in streams:
        with stream:
            for _ in range(count):
                strings: list[str] = []  # the strings pushed so far: STACK_GLOBAL takes its module and name from them
                memo: dict[int, str | None] = {}
                top: str | None = None  # the string on top of the stack, if the last push was one
                try:
                    for opcode, arg, _position in pickletools.genops(stream):
                        name = opcode.name
                        if name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):  # they leave the stack as it is
                            memo[len(memo) if name == "MEMOIZE" else arg] = top
                            continue
                        top = None
                        if name in _STRING_OPCODES:
                            top = arg if isinstance(arg, str) else str(arg)
                        elif name in ("BINGET", "LONG_BINGET", "GET"):
                            top = memo.get(arg)
                        elif name == "STACK_GLOBAL" and len(strings) >= 2:
                            found.append(f"{strings[-2]}.{strings[-1]}")
                        elif name in ("GLOBAL", "INST"):
                            found.append(str(arg).replace(" ", ".", 1))
                        if top is not None:
                            strings.append(top)
                except Exception:  # damaged bytes: what they seem to import is no evidence (nothing is unpickled)
                    return []
    return [name for name in found if _DOTTED_NAME.match(name)]


def _damaged(path: Path, kind: str, error: BaseException, weights_only: bool = False) -> ConversionError:
    if weights_only:  # torch's weights-only unpickler stopped: damaged bytes, or an object it does not name
        return ConversionError(f"Cannot read {str(path)!r} with `torch.load(weights_only=True)` "
                               f"({_unpickler_reason(error)}): the {_KINDS[kind]} is damaged, or it holds "
                               "Python objects other than tensors and plain containers. If it is damaged, "
                               f"download or copy it again; if you trust the file, {_EXTRACT_WEIGHTS}")
    reason = str(error).splitlines()[0] if str(error).strip() else "unexpected end of file"
    return ConversionError(f"Cannot read {str(path)!r} ({type(error).__name__}: {reason}): the {_KINDS[kind]} "
                           "is truncated, damaged or not a checkpoint. Download or copy it again.")


_KINDS = {"zip": "torch zip checkpoint", "legacy": "legacy torch.save pickle"}
# A Git LFS pointer: what a clone without `git lfs` (or an interrupted `git lfs pull`) leaves instead of the weights.
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
# Legacy (pre-zip) torch.save files start with a pickle of this magic number (torch.serialization.MAGIC_NUMBER).
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def check_file_integrity(path: Path) -> str:
    """`"zip"` or `"legacy"`: what the weights file is. Refused: an empty file, a Git LFS pointer, bytes that are
    neither a torch zip archive nor a legacy torch.save pickle, and a zip checkpoint whose records fail their CRC-32 (a
    damaged download or copy; legacy pickles carry no checksum)."""
    size = path.stat().st_size
    if size == 0:
        raise ConversionError(f"{str(path)!r} is empty (0 bytes): the download or copy is incomplete; fetch it again.")
    with open(path, "rb") as handle:
        head = handle.read(64)
    if head.startswith(_LFS_POINTER):
        raise ConversionError(f"{str(path)!r} is a Git LFS pointer file ({size} bytes), not the weights: download "
                              "the real file (`git lfs pull` in the clone, or `hf download REPO pytorch_model.bin`).")
    if not zipfile.is_zipfile(path):
        if head.startswith(b"\x80") and _LEGACY_MAGIC in head[:32]:
            return "legacy"
        if head.startswith(b"PK\x03\x04"):
            raise ConversionError(f"Cannot read {str(path)!r} (a zip archive without its end, {size:,} bytes): "
                                  "the torch zip checkpoint is truncated or damaged. Download or copy it again.")
        raise ConversionError(f"{str(path)!r} is not a PyTorch checkpoint: it is neither a torch zip "
                              f"archive nor a legacy torch.save pickle (it starts with {head[:8]!r}). "
                              "The file is damaged or not a checkpoint; download or copy it again.")
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise ConversionError(f"Cannot read {str(path)!r} as a torch zip checkpoint "
                              f"({error}): the file is damaged; fetch it again.") from error
    if damaged is not None:
        raise ConversionError(f"{str(path)!r} is damaged: its record {damaged!r} fails the CRC-32 check (a "
                              "corrupted download or copy). Fetch the file again; nothing was converted.")
    return "zip"


def normalise_keys(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(state dict, dropped keys): a leading `model.` (the Lightning module's attribute) stripped and the Lightning
    metric counters (keys containing `metrics`) dropped, as the reference loader does (docs/reference_architecture.md
    §2.1)."""
    normalised: dict[str, torch.Tensor] = {}
    dropped: list[str] = []
    for key, tensor in state_dict.items():
        name = key.removeprefix("model.")
        if "metrics" in name:
            dropped.append(key)
            continue
        if name in normalised:
            raise ConversionError(f"Key {name!r} appears twice after stripping the 'model.' prefix (from {key!r}).")
        normalised[name] = tensor
    return normalised, dropped


def _unpickler_reason(error: BaseException) -> str:
    """The line of torch's long weights-only message that names the refused object."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "unsupported" in line.lower() or "WeightsUnpickler error" in line or "is blocked" in line:
            return line
    return lines[0] if lines else type(error).__name__


__all__ = ["ConversionError", "check_file_integrity", "check_tensor_values", "load_state_dict_safely", "normalise_keys"]
