"""Reference checkpoint -> Hub-ready HF folder: the conversion pipeline.

    read (weights_only) -> detect family -> translate config -> strict key mapping -> build model
    -> write to a temporary folder (safetensors, config with auto_map, generation config, remote code,
       tokenizer, model card) -> verify (reload + one forward) -> move into place

An interrupted (Ctrl-C, SIGTERM) or failed conversion removes its temporary folder, and the next run removes the folders
of a killed one (SIGKILL). An existing destination is touched only with `overwrite=True`, and only when it is empty or
a previous conversion's output; it is replaced only after the new one is complete and verified. The source is never
written (see `safety.py`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM
from modeling_jrt.configuration_jrt import PREFIX_PAD_MASKINGS
from modeling_jrt.prefix_fill import never_generated_ids

from .checkpoint import ConversionError, read_reference_checkpoint
from .families import (
    FAMILY_SPECS,
    FamilySpec,
    ReferenceArchitecture,
    detect_family,
    read_architecture,
    translate_config,
)
from .hub import download_reference_checkpoint, is_repo_id
from .mapping import map_state_dict
from .safety import (
    backup_name,
    check_destination,
    check_free_space,
    check_writable,
    remove_stale_staging,
    staging_prefix,
    terminate_cleanly,
)

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
        max_shard_size: safetensors shard size (e.g. `"5GB"`); larger models are written as several shards.
        overwrite: replace an existing destination (only once the new folder is complete and verified).

    Returns:
        A `ConversionResult`.

    Raises:
        ConversionError: for any checkpoint or option that cannot be converted, with the reason and the fix.
    """
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}.")
    if prefix_pad_masking not in PREFIX_PAD_MASKINGS:
        raise ConversionError(
            f"prefix_pad_masking must be one of {list(PREFIX_PAD_MASKINGS)}, got {prefix_pad_masking!r}."
        )
    destination = Path(destination)
    # 1. Pre-flight: settle what an interrupted run left, refuse destinations that could lose data, check writability.
    cleanup_notes = remove_stale_staging(destination)
    given_source = Path(str(source)).expanduser()
    check_destination(given_source if given_source.exists() else None, destination, overwrite=overwrite)
    check_writable(destination)

    local_source, name_hint = _resolve_source(str(source))
    check_destination(local_source, destination, overwrite=overwrite)
    checkpoint = read_reference_checkpoint(local_source)
    arch = read_architecture(checkpoint.config)
    detection = detect_family(
        checkpoint.config, arch, list(checkpoint.state_dict), requested=family, name_hint=name_hint
    )
    spec = FAMILY_SPECS[detection.family]
    config_kwargs, notes = translate_config(arch, spec, prefix_pad_masking=prefix_pad_masking, dtype=DTYPES[dtype])
    config = JRTRNNConfig(**config_kwargs)
    config.architectures = ["JRTRNNForCausalLM"]

    with torch.device("meta"):
        model = JRTRNNForCausalLM(config)
    target_shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    weights, key_notes = map_state_dict(checkpoint.state_dict, spec, arch, target_shapes, DTYPES[dtype])
    notes += key_notes + cleanup_notes
    check_free_space(destination, sum(t.numel() * t.element_size() for t in weights.values()))
    if checkpoint.dropped_keys:
        notes.append(f"dropped {len(checkpoint.dropped_keys)} Lightning metric counters (keys containing 'metrics')")
    _load_weights(model, weights)
    model.generation_config = reference_generation_config(config)
    tok, tokenizer_note = _load_tokenizer(tokenizer, arch)

    # 2. Write to a staging folder, verify, move into place. SIGTERM cleans up like Ctrl-C; after a SIGKILL the next
    # run removes the staging folder (`remove_stale_staging`, by the dead process id in its name).
    destination.parent.mkdir(parents=True, exist_ok=True)
    with terminate_cleanly():
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(destination), dir=destination.parent))
        try:
            # Weights, config, generation config, and the remote code with `auto_map` (the model classes are
            # registered for their auto classes, see `JRTRNNPreTrainedModel.save_pretrained`).
            model.save_pretrained(staging, max_shard_size=max_shard_size)
            if tok is not None:
                tok.save_pretrained(staging)
            (staging / "README.md").write_text(
                render_model_card(name_hint, spec, detection.evidence, arch, config, dtype, notes,
                                  has_tokenizer=tok is not None),
                encoding="utf-8",
            )
            verify_folder(staging, model)
            files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
            _apply_umask(staging)
            _move_into_place(staging, destination, overwrite=overwrite)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return ConversionResult(
        destination=destination,
        source=str(source),
        family=spec.name,
        evidence=detection.evidence,
        config=config,
        num_parameters=model.num_parameters(),
        files=files,
        notes=notes + ([tokenizer_note] if tokenizer_note else []),
    )


def _resolve_source(source: str) -> tuple[Path, str]:
    """A local path for `source` (downloading a Hub repo id), and the name used as a family hint."""
    path = Path(source).expanduser()
    if path.exists():
        folder = path if path.is_dir() else path.parent
        return path, folder.resolve().name
    if is_repo_id(source):
        return download_reference_checkpoint(source), source
    raise FileNotFoundError(
        f"Source {source!r} is neither an existing file or folder nor a Hub repo id of the form 'owner/name'."
    )


def _load_weights(model: JRTRNNForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Put the converted tensors into a model built on the meta device, then restore its derived buffers."""
    result = model.load_state_dict(weights, strict=False, assign=True)
    # The tied LM head is the only key not given (map_state_dict has already accounted for every other key).
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    model.tie_weights()
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.compute_inv_freq(model.config)
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta, f"tensors left on the meta device: {on_meta}"
    model.eval()


def reference_generation_config(config: JRTRNNConfig) -> GenerationConfig:
    """Greedy decoding with GPT-2's ids, as the reference evaluation decodes; the reference's JRT prefix strategy
    (`prefix_strategy="pad"`: left-pad with `config.prefix_pad_token_id` = 220 to the prefix length and mask the pads,
    applied by the model's `generate()`); and `suppress_tokens`: the ids past GPT-2's vocabulary (padding rows,
    JRT's [MASK]) that are never generated, whatever calls `generate`.
    """
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        suppress_tokens=never_generated_ids(config) or None,
        prefix_strategy="pad" if config.linear_attention_type == "prefix" else "none",
    )


def verify_folder(folder: Path, model: JRTRNNForCausalLM) -> None:
    """Reload `folder` and check that it holds exactly `model`: same tensors, same logits on a short input."""
    reloaded = JRTRNNForCausalLM.from_pretrained(folder, dtype=model.dtype)
    reloaded.eval()
    expected = model.state_dict()
    actual = reloaded.state_dict()
    differing = sorted(k for k in expected if k not in actual or not torch.equal(expected[k], actual[k]))
    if differing or set(actual) != set(expected):
        raise ConversionError(
            f"Verification failed: the reloaded folder differs from the converted model at {differing}."
        )
    input_ids = torch.tensor([_VERIFY_IDS]) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids, use_cache=False).logits
        reloaded_logits = reloaded(input_ids, use_cache=False).logits
    if not torch.isfinite(logits).all() or not torch.equal(logits, reloaded_logits):
        raise ConversionError("Verification failed: the reloaded model's logits are not finite or differ.")


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
    else:
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer, padding_side="left")
        except (OSError, ValueError) as error:
            raise ConversionError(f"Could not load the tokenizer {tokenizer!r}: {error}") from error
    if len(tok) > arch.padded_vocab_size:
        raise ConversionError(
            f"The tokenizer has {len(tok)} tokens but the model only {arch.padded_vocab_size} embedding rows."
        )
    if tok.eos_token_id != arch.eos_token_id:
        raise ConversionError(
            f"The tokenizer's eos id is {tok.eos_token_id}, the checkpoint's {arch.eos_token_id}: the released models "
            "use GPT-2's tokenizer (eos '<|endoftext|>' = 50256)."
        )
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


def _move_into_place(staging: Path, destination: Path, *, overwrite: bool) -> None:
    """Rename the complete staging folder to `destination` (same filesystem, so each rename is atomic)."""
    if not destination.exists():
        os.replace(staging, destination)
        return
    if not overwrite:  # appeared while converting
        raise ConversionError(f"Destination {str(destination)!r} appeared during the conversion; nothing was written.")
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
    source: str,
    spec: FamilySpec,
    evidence: str,
    arch: ReferenceArchitecture,
    config: JRTRNNConfig,
    dtype: str,
    notes: list[str],
    *,
    has_tokenizer: bool,
    license: str = "apache-2.0",
) -> str:
    """The README.md of the converted folder: provenance, license, conversion options, usage and citation.

    `source` is the Hub repo id of the reference checkpoint, or the name of its local folder; a folder named like a
    released checkpoint (e.g. `JRT-360M-30B`) still gets that checkpoint as `base_model`. `license` is the card's
    license tag (the HazyResearch releases are Apache-2.0).
    """
    base_id = source if is_repo_id(source) else _RELEASED_HUB_IDS.get(source.split("/")[-1].lower())
    base_model = f"base_model: {base_id}\n" if base_id else ""
    is_prefix = config.linear_attention_type == "prefix"
    counts = {kind: config.layer_types.count(kind) for kind in ("conv", "linear_attention", "sliding_attention")}
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
    prefix_text = (
        f"Prompts shorter than the prefix ({config.prefix_length} tokens) are left-padded with token "
        f"{config.prefix_pad_token_id} (\" \") and the pads are masked in the linear attention "
        f"(`prefix_strategy=\"pad\"` in `generation_config.json`, "
        f"`prefix_pad_masking=\"{config.prefix_pad_masking}\"`), "
        "as in the reference evaluation.\n"
        if is_prefix
        else ""
    )
    return f"""---
library_name: transformers
pipeline_tag: text-generation
license: {license}
{base_model}tags:
- jrt-rnn
- based
- linear-attention
---

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
| vocabulary | {config.vocab_size} rows (GPT-2's {arch.vocab_size} + padding{mask}) |
| weights dtype | {dtype} |

## Conversion

- source: `{source}`; reference loader: {spec.reference_loader}
- keys mapped with the `{spec.name}` key table; every source tensor consumed and every tensor filled
- verified: reloaded from this folder and compared logits on a short input

Conversion notes:
{note_lines}
## Citation

```bibtex
{_CITATIONS}
```
"""


# Hub ids of the released checkpoints, by lower-cased name: the `base_model` of a conversion from a local folder.
_RELEASED_HUB_IDS = {
    name.lower(): f"hazyresearch/{name}"
    for name in ("JRT-360M-30B", "JRT-1B-50B", "based-360M-30B", "based-1b-50b", "based-360m", "based-1b")
}

_CITATIONS = """@article{arora2024just,
  title={Just read twice: closing the recall gap for recurrent language models},
  author={Arora, Simran and Timalsina, Aman and Singhal, Aaryan and Eyuboglu, Sabri and Zhao, Xinyi and Rao, Ashish
          and Rudra, Atri and R{\\'e}, Christopher},
  journal={arXiv preprint arXiv:2407.05483},
  year={2024}
}

@article{arora2024simple,
  title={Simple linear attention language models balance the recall-throughput tradeoff},
  author={Arora, Simran and Eyuboglu, Sabri and Zhang, Michael and Timalsina, Aman and Alberti, Silas
          and Zinsley, Dylan and Zou, James and Rudra, Atri and R{\\'e}, Christopher},
  journal={arXiv preprint arXiv:2402.18668},
  year={2024}
}"""


__all__ = ["DTYPES", "ConversionResult", "convert_checkpoint", "reference_generation_config"]
