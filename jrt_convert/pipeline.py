"""Reference checkpoint -> Hub-ready HF folder: the conversion pipeline.

    check options -> read config.json (bounded sizes) -> tokenizer -> memory-map the weights (weights_only) and check
    each tensor -> detect family -> translate config -> strict key mapping onto a model on the meta device
    -> write to a temporary folder (safetensors shards one tensor at a time, config with auto_map, generation config,
       remote code, tokenizer, model card) -> verify (hashes, reload, one forward) -> manifest -> move into place

The peak memory is about one copy of the weights; a failed run leaves no output folder and never writes the source
(docs/convert.md, "What the converter guarantees"; staging and `--overwrite` in `safety.py`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM
from modeling_jrt.configuration_jrt import PREFIX_PAD_MASKINGS
from modeling_jrt.prefix_fill import never_generated_ids

from .checkpoint import load_state_dict_safely, normalise_keys
from .families import (
    FAMILY_SPECS, GPT2_PREFIX_PAD_TOKEN_ID, RELEASED_CHECKPOINTS, FamilySpec, ReferenceArchitecture,
    check_layers_against_weights, detect_family, read_architecture, translate_config,
)
from .hub import download_reference_checkpoint, is_repo_id
from .mapping import map_state_dict
from .memory import release_mapping
from .model_card import citation_section, front_matter
from .safety import (
    backup_name, check_destination, check_free_space, check_writable, remove_stale_staging, sha256_of_file,
    staging_prefix, terminate_cleanly, unchanged_since, write_manifest,
)
from .shards import SAFETENSORS_DTYPES, parse_size, tensor_bytes, write_shards
from .source_files import ConversionError, find_weights_file, load_reference_config

# Weight dtypes of a conversion, by torch's names (as `from_pretrained(dtype=...)` and the other commands spell them).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The verification forward: a few ordinary GPT-2 ids (all < 257, so it also fits tiny test vocabularies).
_VERIFY_IDS = [40, 101, 220, 84, 111, 119, 46, 10, 65]


@dataclass
class ConversionResult:
    """What `convert_checkpoint` did: where, which family and why, and every translation worth knowing."""

    destination: Path
    source: str
    family: str
    evidence: str
    config: JRTRNNConfig
    num_parameters: int
    files: list[str]
    notes: list[str] = field(default_factory=list)


def convert_checkpoint(
    source: str | Path,
    destination: str | Path,
    *,
    family: str = "auto",
    dtype: str = "float32",
    tokenizer: str | None = None,
    prefix_pad_masking: str = "reference",
    prefix_pad_token_id: int | None = None,
    max_shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> ConversionResult:
    """Convert a released HazyResearch JRT-RNN / Based checkpoint to a folder `from_pretrained` loads.

    Args:
        source: a local folder holding the reference `config.json` and `pytorch_model.bin` (or one Lightning
            `.ckpt`), a weights file next to its `config.json`, or a Hub repo id such as
            `hazyresearch/JRT-360M-30B` (downloaded when the network allows).
        destination: the output folder; must not exist unless `overwrite`.
        family: `"auto"` (detected, see `families.detect_family`), `"jrt"`, `"based-jrt-release"` or
            `"based-original"`.
        dtype: `"float32"` (the released weights), `"bfloat16"` or `"float16"`.
        tokenizer: a local folder or Hub id of the GPT-2 tokenizer to ship; default: GPT-2 from the local Hub cache
            when present (never downloaded implicitly), else no tokenizer files.
        prefix_pad_masking: `"reference"` (pads of the JRT prefix keep the reference's constant-term leak, which
            reproduces the published evaluation) or `"strict"` (pads contribute nothing).
        prefix_pad_token_id: the token that fills a short JRT prefix; default: the id of `" "` in the given tokenizer,
            else GPT-2's `" "` (220). A checkpoint with a vocabulary of 220 tokens or fewer needs it.
        max_shard_size: safetensors shard size (e.g. `"5GB"`); larger models are written as several shards.
        overwrite: replace an existing destination that a previous conversion wrote, file for file and unchanged (its
            manifest says so); only once the new folder is complete and verified.

    Raises:
        OptionError: an option that cannot work, before anything is read (the CLI's usage error, exit 2).
        ConversionError: for any checkpoint that cannot be converted as asked, with the reason and the fix.
    """
    # 0. Options, before anything is read or allocated.
    torch_dtype, shard_bytes, destination = check_options(
        destination, family=family, dtype=dtype, tokenizer=tokenizer, prefix_pad_masking=prefix_pad_masking,
        prefix_pad_token_id=prefix_pad_token_id, max_shard_size=max_shard_size,
    )
    # 1. Pre-flight: settle what an interrupted run left, refuse destinations that could lose data, check writability.
    cleanup_notes = remove_stale_staging(destination)
    given_source = Path(str(source)).expanduser()
    check_destination(given_source if given_source.exists() else None, destination, overwrite=overwrite)
    check_writable(destination)

    # 2. The config (bounded sizes), the tokenizer, then the weights, memory-mapped and checked tensor by tensor.
    local_source, name_hint = _resolve_source(str(source))
    checked = check_destination(local_source, destination, overwrite=overwrite)
    weights_path = find_weights_file(local_source)
    reference_config = load_reference_config(weights_path.parent)
    arch = read_architecture(reference_config)
    tok, tokenizer_note = _load_tokenizer(tokenizer, arch)
    raw, pages = load_state_dict_safely(weights_path, dtype=torch_dtype)
    state_dict, dropped_keys = normalise_keys(raw)
    del raw
    check_layers_against_weights(arch, list(state_dict))
    detection = detect_family(reference_config, arch, list(state_dict), requested=family, name_hint=name_hint)
    spec = FAMILY_SPECS[detection.family]
    pad_id, pad_notes = _prefix_pad_token_id(prefix_pad_token_id, tok, arch, spec)
    config_kwargs, notes = translate_config(
        arch, spec, prefix_pad_masking=prefix_pad_masking, dtype=torch_dtype, prefix_pad_token_id=pad_id
    )
    config = JRTRNNConfig(**config_kwargs)
    config.architectures = ["JRTRNNForCausalLM"]

    # 3. Plan every tensor on the meta device (no weight is copied yet), then check the free space for it.
    with torch.device("meta"):
        model = JRTRNNForCausalLM(config).to(torch_dtype)  # the dtype that save_pretrained writes into config.json
    target_shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    plan, key_notes = map_state_dict(state_dict, spec, arch, target_shapes)
    del state_dict
    notes += pad_notes + key_notes + cleanup_notes
    if dropped_keys:
        notes.append(f"dropped {len(dropped_keys)} Lightning metric counters (keys containing 'metrics')")
    # The tied LM head is not saved: it is the embedding.
    shapes = {name: shape for name, shape in target_shapes.items() if name in plan.sources}
    needed_bytes = sum(tensor_bytes(shape, torch_dtype) for shape in shapes.values())
    check_free_space(destination, needed_bytes)
    model.generation_config = reference_generation_config(config)

    # 4. Write to a staging folder (the shards one tensor at a time), verify, move into place (see `safety.py`).
    destination.parent.mkdir(parents=True, exist_ok=True)
    with terminate_cleanly():
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(destination), dir=destination.parent))
        try:
            with _disk_full_reported(destination, needed_bytes):
                # Config (with `auto_map`), generation config and the remote code, without weights: the model is on
                # the meta device. (First: save_pretrained removes weight files it finds in the folder.)
                model.save_pretrained(staging, state_dict={})
                _write_token_ids(staging / "config.json", config)
                hashes = write_shards(
                    staging, shapes, torch_dtype, shard_bytes, lambda name: plan.tensor(name, torch_dtype),
                    written=lambda name: pages.release(plan.source_tensor(name)),
                )
                plan.release()  # the memory map of the checkpoint goes with its last tensor
                if tok is not None:
                    tok.save_pretrained(staging)
                (staging / "README.md").write_text(
                    render_model_card(name_hint, spec, detection.evidence, arch, config, dtype, notes,
                                      has_tokenizer=tok is not None),
                    encoding="utf-8",
                )
            verify_folder(staging, hashes, model)  # it only reads: its errors are not a full disk
            with _disk_full_reported(destination, needed_bytes):
                write_manifest(staging, hashes)
            files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
            _apply_umask(staging)
            _move_into_place(staging, destination, overwrite=overwrite, checked=checked)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return ConversionResult(
        destination=destination, source=str(source), family=spec.name, evidence=detection.evidence, config=config,
        num_parameters=model.num_parameters(), files=files, notes=notes + ([tokenizer_note] if tokenizer_note else []),
    )


# Token ids every converted config.json states itself, whatever JRTRNNConfig's defaults are or become.
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "prefix_pad_token_id", "mask_token_id")


def _write_token_ids(path: Path, config: JRTRNNConfig) -> None:
    """Write the token ids into `config.json` explicitly (save_pretrained may leave out values equal to defaults)."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    saved.update({name: getattr(config, name) for name in _TOKEN_ID_FIELDS})
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class OptionError(ConversionError):
    """An option of `convert_checkpoint` that cannot work, found before anything is read (a usage error)."""


def check_options(
    destination: str | Path, *, family: str = "auto", dtype: str = "float32", tokenizer: str | None = None,
    prefix_pad_masking: str = "reference", prefix_pad_token_id: int | None = None, max_shard_size: str | int = "5GB",
    overwrite: bool = False,
) -> tuple[torch.dtype, int, Path]:
    """The option checks `convert_checkpoint` starts with, on their own (the CLI runs them before `--push-to-hub`'s
    Hub check). Raises `OptionError`; returns (target dtype, shard size in bytes, absolute destination)."""
    if dtype not in DTYPES:
        raise OptionError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}.")
    if family != "auto" and family not in FAMILY_SPECS:
        raise OptionError(f"Unknown family {family!r}; choose 'auto' or one of {list(FAMILY_SPECS)}.")
    if prefix_pad_masking not in PREFIX_PAD_MASKINGS:
        raise OptionError(f"prefix_pad_masking must be one of {list(PREFIX_PAD_MASKINGS)}, got {prefix_pad_masking!r}.")
    if prefix_pad_token_id is not None and (
        not isinstance(prefix_pad_token_id, int) or isinstance(prefix_pad_token_id, bool) or prefix_pad_token_id < 0
    ):
        raise OptionError(f"--prefix-pad-token-id must be a token id (an integer >= 0), got {prefix_pad_token_id!r}.")
    try:
        shard_bytes = parse_size(max_shard_size)
    except ValueError as error:
        raise OptionError(f"--max-shard-size: {error}") from error
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        looks_like_path = path.exists() or tokenizer.startswith(("/", ".", "~")) or tokenizer.count("/") > 1
        if looks_like_path and not path.is_dir():
            raise OptionError(f"--tokenizer {tokenizer!r} is not an existing folder; give a folder "
                              "holding a tokenizer, or a Hub id such as 'gpt2' or 'openai-community/gpt2'.")
        if not looks_like_path and not (is_repo_id(tokenizer) or _BARE_HUB_ID.match(tokenizer)):
            raise OptionError(f"--tokenizer {tokenizer!r} is neither an existing folder nor a Hub id such as 'gpt2' or "
                              "'openai-community/gpt2'.")
    # An absolute path: `.` and `..` have no name to derive the staging folders' names from.
    absolute = Path(os.path.abspath(Path(destination).expanduser()))
    if not absolute.name:
        raise OptionError(f"Destination {str(destination)!r} is the filesystem root; choose a folder for DST.")
    return DTYPES[dtype], shard_bytes, absolute


_BARE_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*$")
# errno values of a full disk, a full quota and a file-size limit (`ulimit -f`).
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


@contextlib.contextmanager
def _disk_full_reported(destination: Path, needed_bytes: int) -> Iterator[None]:
    """A full disk, quota or `ulimit -f` while writing becomes one line naming DST and the bytes needed."""
    try:
        yield
    except OSError as error:
        if error.errno not in _DISK_FULL:
            raise
        raise ConversionError(f"Cannot write the converted folder for {str(destination)!r}: "
                              f"{error.strerror or error} (it needs about {needed_bytes:,} bytes "
                              "for the weights). Free some space (or raise `ulimit -f`), choose "
                              "another DST, or convert with --dtype bfloat16; nothing was written.") from error


def _prefix_pad_token_id(
    requested: int | None, tok: PreTrainedTokenizerBase | None, arch: ReferenceArchitecture, spec: FamilySpec
) -> tuple[int | None, list[str]]:
    """The token that fills a short JRT prefix: `--prefix-pad-token-id`, else the tokenizer's `" "`, else GPT-2's
    `" "` (220, what the reference pads with). A causal family never pads a prefix, so there it may stay unset."""
    vocabulary = arch.padded_vocab_size
    if requested is not None:
        if requested >= vocabulary:
            raise OptionError(f"--prefix-pad-token-id {requested} is outside this checkpoint's vocabulary "
                              f"({vocabulary} embedding rows): give a token id below {vocabulary}.")
        return requested, []
    source, pad_id = "GPT-2's \" \" (the reference's prefix pad)", GPT2_PREFIX_PAD_TOKEN_ID
    if tok is not None:
        ids = tok.encode(" ", add_special_tokens=False)
        if len(ids) == 1:
            source, pad_id = "the tokenizer's \" \"", ids[0]
    if pad_id < vocabulary:
        return pad_id, ([f"prefix pad token {pad_id}: {source}"] if pad_id != GPT2_PREFIX_PAD_TOKEN_ID else [])
    if spec.linear_attention_type != "prefix":
        return None, [f"no prefix pad token: {source} = {pad_id} is outside the {vocabulary}-row vocabulary, and "
                      f"the {spec.name} family has no JRT prefix"]
    raise ConversionError(f"The JRT prefix pad token defaults to {source} = {pad_id}, but this checkpoint's "
                          f"vocabulary has only {vocabulary} rows: pass --prefix-pad-token-id ID "
                          "(prefix_pad_token_id= in Python) with the id of the token that fills a short prefix "
                          "(the reference uses ' '), or --tokenizer with the model's tokenizer to take its ' '.")


def _resolve_source(source: str) -> tuple[Path, str]:
    """A local path for `source` (downloading a Hub repo id), and the name used as a family hint."""
    path = Path(source).expanduser()
    if path.exists():
        folder = path if path.is_dir() else path.parent
        return path, folder.resolve().name
    if is_repo_id(source):
        return download_reference_checkpoint(source), source
    raise FileNotFoundError(f"Source {source!r} is neither an existing file or "
                            "folder nor a Hub repo id of the form 'owner/name'.")


def reference_generation_config(config: JRTRNNConfig) -> GenerationConfig:
    """Greedy decoding with the converted config's ids (GPT-2's in the released models), as the reference evaluation
    decodes, and `suppress_tokens`: the ids past the tokenizer's vocabulary (padding rows, JRT's [MASK]) that
    are never generated, whatever calls `generate`.
    """
    return GenerationConfig(
        do_sample=False, num_beams=1, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id, suppress_tokens=never_generated_ids(config) or None,
    )


def verify_folder(folder: Path, hashes: dict[str, str], model: JRTRNNForCausalLM) -> None:
    """Check the written folder without a second copy of the weights in memory.

    1. Every shard re-read from disk has the SHA-256 computed while it was written (read in chunks).
    2. safetensors reads every shard's header, and the shards hold exactly the tensors of `model` (built on the meta
       device; the tied LM head is not saved), with its shapes and dtype.
    3. A model assembled from read-only memory maps of the shards runs a short forward with finite logits. Each
       layer's pages are released once the layer has run, so the forward holds about one layer at a time.
    """
    corrupted = sorted(name for name, digest in hashes.items() if sha256_of_file(folder / name) != digest)
    if corrupted:
        raise ConversionError(f"Verification failed: {corrupted} changed between writing and reading back (a "
                              "failing disk or another process writing there); nothing was moved into place.")
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items() if name not in tied}
    tensors, regions = _map_shards(folder, list(hashes))
    actual = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    if actual != expected:
        differing = sorted(set(actual) ^ set(expected) | {k for k in expected if actual.get(k) != expected[k]})
        raise ConversionError("Verification failed: the written folder differs "
                              f"from the converted model at {differing}.")

    with torch.device("meta"):
        reloaded = JRTRNNForCausalLM(model.config).to(model.dtype)
    _load_weights(reloaded, tensors)
    by_address = {tensor.data_ptr(): regions[name] for name, tensor in tensors.items()}
    del tensors

    def release(module: torch.nn.Module, *args: object) -> None:
        for parameter in module.parameters():
            region = by_address.get(parameter.data_ptr())
            if region is not None:
                release_mapping(*region)

    hooks = [layer.register_forward_hook(release) for layer in reloaded.model.layers]
    hooks.append(reloaded.lm_head.register_forward_hook(release))
    input_ids = torch.tensor([_VERIFY_IDS]) % reloaded.config.vocab_size
    with torch.no_grad():
        logits = reloaded(input_ids, use_cache=False).logits
    for hook in hooks:
        hook.remove()
    if not torch.isfinite(logits).all():
        raise ConversionError("Verification failed: the converted model's logits on a short input are not finite "
                              f"(every weight is finite in {reloaded.dtype}); convert with --dtype float32.")


def _map_shards(
    folder: Path, files: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[mmap.mmap, int, int]]]:
    """The tensors of safetensors shards as read-only memory maps (nothing is read until used), and where each lies
    in its mapping. The headers are also parsed by safetensors itself, which must list the same tensors."""
    tensors: dict[str, torch.Tensor] = {}
    regions: dict[str, tuple[mmap.mmap, int, int]] = {}
    for file_name in files:
        path = folder / file_name
        with safe_open(path, framework="pt") as handle:
            names = set(handle.keys())
        with open(path, "rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        (header_length,) = struct.unpack("<Q", buffer[:8])
        header = json.loads(buffer[8 : 8 + header_length])
        header.pop("__metadata__", None)
        if set(header) != names:
            raise ConversionError(f"Verification failed: the header of {file_name} does not read back as written.")
        base = 8 + header_length
        for name, info in header.items():
            begin, end = info["data_offsets"]
            with warnings.catch_warnings():  # read-only on purpose: nothing may write into the mapped file
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=base + begin)
            tensors[name] = flat.view(_SAFETENSORS_TO_TORCH[info["dtype"]]).reshape(info["shape"])
            regions[name] = (buffer, base + begin, end - begin)
    return tensors, regions


_SAFETENSORS_TO_TORCH = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def _load_weights(model: JRTRNNForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Put the tensors into a model built on the meta device, then restore its derived buffers."""
    result = model.load_state_dict(weights, strict=False, assign=True)
    # The tied LM head is the only key not given (the verification has already compared the key sets).
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    model.tie_weights()
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.compute_inv_freq(model.config)
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta, f"tensors left on the meta device: {on_meta}"
    model.eval()


def _load_tokenizer(
    tokenizer: str | None, arch: ReferenceArchitecture
) -> tuple[PreTrainedTokenizerBase | None, str | None]:
    """The GPT-2 tokenizer to ship (left padding, pad token set), or None with a note when none is available."""
    if tokenizer is None:
        try:
            tok = AutoTokenizer.from_pretrained("gpt2", local_files_only=True, padding_side="left")
        except (OSError, ValueError):
            return None, (
                "no tokenizer shipped: GPT-2's is not in the local Hub cache; pass --tokenizer gpt2 (or a folder) "
                "to include it"
            )
        if len(tok) > arch.padded_vocab_size or tok.eos_token_id != arch.eos_token_id:
            return None, (
                "no tokenizer shipped: GPT-2's (from the local Hub cache) does not fit this checkpoint's vocabulary; "
                "pass --tokenizer with the model's own tokenizer"
            )
    else:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer, padding_side="left")
        except (OSError, ValueError) as error:
            raise ConversionError(f"Could not load the tokenizer {tokenizer!r}: {error}") from error
    if len(tok) > arch.padded_vocab_size:
        raise ConversionError(f"The tokenizer has {len(tok)} tokens but the model "
                              f"only {arch.padded_vocab_size} embedding rows.")
    if tok.eos_token_id != arch.eos_token_id:
        raise ConversionError(f"The tokenizer's eos id is {tok.eos_token_id}, the checkpoint's {arch.eos_token_id}: "
                              "the released models use GPT-2's tokenizer (eos '<|endoftext|>' = 50256).")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, None


def _apply_umask(folder: Path) -> None:
    """Give the staging folder (created 0700 by mkdtemp) and its files the permissions of an ordinary folder."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _move_into_place(staging: Path, destination: Path, *, overwrite: bool, checked: dict[str, tuple[int, int]]) -> None:
    """Rename the complete staging folder to `destination` (same filesystem, so each rename is atomic).

    `checked` is the destination's listing when `check_destination` allowed replacing it: anything added, removed or
    modified there since (while converting) makes the conversion stop instead of replacing it.
    """
    if not destination.exists():
        os.replace(staging, destination)
        return
    if not overwrite:  # appeared while converting
        raise ConversionError(f"Destination {str(destination)!r} appeared during the conversion; nothing was written.")
    moved = unchanged_since(destination, checked)
    if moved:
        raise ConversionError(f"Destination {str(destination)!r} changed during the conversion "
                              f"({moved[:10]}); it was left as it is. Run again to replace it.")
    backup = destination.with_name(backup_name(destination))
    os.replace(destination, backup)
    try:
        os.replace(staging, destination)
    except BaseException:  # an OSError, or SIGTERM between the two renames: put the previous folder back
        os.replace(backup, destination)
        raise
    if backup.is_dir():
        shutil.rmtree(backup)
    else:
        backup.unlink()


def render_model_card(
    source: str, spec: FamilySpec, evidence: str, arch: ReferenceArchitecture, config: JRTRNNConfig, dtype: str,
    notes: list[str], *, has_tokenizer: bool, license: str = "apache-2.0",
) -> str:
    """The README.md of the converted folder: provenance, license, conversion options, usage and citation.

    `source` is the Hub repo id of the reference checkpoint, or the name of its local folder; a folder named like a
    released checkpoint (e.g. `JRT-360M-30B`) still gets that checkpoint as `base_model`. `license` is the card's
    license tag (the HazyResearch releases are Apache-2.0).
    """
    base_id = source if is_repo_id(source) else _RELEASED_HUB_IDS.get(source.split("/")[-1].lower())
    is_prefix = config.linear_attention_type == "prefix"
    counts = {kind: config.mixer_types.count(kind) for kind in ("conv", "linear_attention", "sliding_attention")}
    tokenizer_line = (
        # trust_remote_code: AutoTokenizer reads config.json first, and its `auto_map` would otherwise make
        # transformers ask "[y/N]" interactively when the jrt-rnn package is not installed.
        'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO", trust_remote_code=True)  # GPT-2\'s, left padding'
        if has_tokenizer
        else 'tokenizer = AutoTokenizer.from_pretrained("gpt2", padding_side="left")\n'
        "tokenizer.pad_token = tokenizer.eos_token"
    )
    layers = (
        f"{config.num_hidden_layers}: {counts['conv']} gated convolutions, {counts['linear_attention']} "
        f"{config.linear_attention_type} linear attention, {counts['sliding_attention']} sliding-window attention"
    )
    mask = f"; [MASK] = {config.mask_token_id}" if config.mask_token_id is not None else ""
    note_lines = "".join(f"- {note}\n" for note in notes) or "- none\n"
    space = ' (" ")' if config.prefix_pad_token_id == GPT2_PREFIX_PAD_TOKEN_ID else ""
    gpt2 = " (GPT-2's)" if arch.vocab_size == 50257 else ""
    prefix_text = (
        f"Prompts shorter than the prefix ({config.prefix_length} tokens) are left-padded with token "
        f"{config.prefix_pad_token_id}{space} and the pads are masked in the linear attention "
        f"by the model's first forward (`prefix_strategy=\"pad\"` in `config.json`, "
        f"`prefix_pad_masking=\"{config.prefix_pad_masking}\"`), "
        "as in the reference evaluation.\n"
        if is_prefix
        else ""
    )
    return f"""{front_matter(license=license, base_model=base_id)}
# {source.split("/")[-1]} (converted)

A conversion of the HazyResearch checkpoint `{source}` ({spec.description}) to a HuggingFace Transformers folder,
made with `jrt convert` (jrt-rnn). The original code is https://github.com/HazyResearch/prefix-linear-attention
(JRT-RNN) and https://github.com/HazyResearch/based (Based).

## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
{tokenizer_line}
inputs = tokenizer(["The capital of France is"], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**inputs, max_new_tokens=20)))
```

The modeling code ships with the folder (`trust_remote_code=True`); with the `jrt-rnn` package installed,
`import modeling_jrt` registers the same classes locally. Generation is greedy by default (`generation_config.json`)
and never emits ids past GPT-2's vocabulary (`generation_vocab_size = {config.generation_vocab_size}`).
{prefix_text}
## Architecture

| | |
|---|---|
| family | `{spec.name}` (detected from: {evidence}) |
| layers | {layers} |
| hidden size / heads / feature dim | {config.hidden_size} / {config.num_attention_heads} / {config.feature_dim} |
| sliding window (keys incl. self) | {config.sliding_window} |
| prefix length | {config.prefix_length if is_prefix else "-"} |
| decay | {"fixed + input-dependent" if config.use_decay_proj else "none"} |
| vocabulary | {config.vocab_size} rows ({arch.vocab_size} tokens{gpt2} + padding{mask}) |
| weights dtype | {dtype} |

## Conversion

- source: `{source}`; reference loader: {spec.reference_loader}
- keys mapped with the `{spec.name}` key table; every source tensor consumed and every tensor filled
- verified: reloaded from this folder and compared logits on a short input

Conversion notes:
{note_lines}
{citation_section()}"""


# Hub ids of the released checkpoints, by lower-cased name: the `base_model` of a conversion from a local folder.
_RELEASED_HUB_IDS = {name.lower(): f"hazyresearch/{name}" for name in RELEASED_CHECKPOINTS}

__all__ = [
    "DTYPES", "ConversionResult", "OptionError", "check_options", "convert_checkpoint", "reference_generation_config"
]
