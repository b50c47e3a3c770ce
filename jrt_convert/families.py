"""The released checkpoint families: how to recognise each, read its reference config, and name its tensors.

Three families (docs/reference_architecture.md §2, §2.1; `FAMILY_SPECS` names their checkpoints and reference
loaders): `jrt` (prefix linear attention), `based-jrt-release` (causal; decay + decay_proj when the config asks for
both) and `based-original` (causal; the decay is never applied).

The layer kinds come from `alt_mixer_layers` / `alt_mixer_2_layers` (`alt_mixer_2` wins), hyper-parameters from the
mixer dicts with the reference defaults. `_target_` strings are read only as data that identifies a family, never
trusted to say what a layer computes: the key tables below and the strict accounting in `mapping.py` decide.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .checkpoint import ConversionError

FAMILIES = ("jrt", "based-jrt-release", "based-original")
# GPT-2's " ": the token the reference pads a short JRT prefix with (docs/reference_architecture.md §2.1).
GPT2_PREFIX_PAD_TOKEN_ID = 220

# The released checkpoints (`hazyresearch/NAME` on the Hub) and their families, used to name a family when the
# structure alone cannot (based-1b-50b loads identically under both Based loaders; its parallel forward is the same
# either way). KNOWN_CHECKPOINTS is keyed by the lower-cased name.
RELEASED_CHECKPOINTS = {
    "JRT-360M-30B": "jrt", "JRT-1B-50B": "jrt", "based-360M-30B": "based-jrt-release",
    "based-1b-50b": "based-jrt-release", "based-360m": "based-original", "based-1b": "based-original",
}
KNOWN_CHECKPOINTS = {name.lower(): family for name, family in RELEASED_CHECKPOINTS.items()}

# Key tables: reference name -> our name(s). A tuple of several names splits the source tensor into that many equal
# row blocks, in order (fc1 rows are [up; gate], Wqkv rows are [q; k; v]). Block keys are relative to
# `transformer.layers.{i}.` on the reference side and `model.layers.{i}.` on ours.
GLOBAL_KEYS: dict[str, tuple[str, ...]] = {
    "transformer.embeddings.word_embeddings.weight": ("model.embed_tokens.weight",),
    "transformer.ln_f.weight": ("model.norm.weight",),
}
BLOCK_KEYS: dict[str, tuple[str, ...]] = {
    "norm1.weight": ("input_layernorm.weight",), "norm2.weight": ("post_attention_layernorm.weight",),
    "mlp.fc1.weight": ("mlp.up_proj.weight", "mlp.gate_proj.weight"), "mlp.fc2.weight": ("mlp.down_proj.weight",),
}
CONV_KEYS: dict[str, tuple[str, ...]] = {
    # in_proj rows are [conv branch; gate] in both layouts, so the fused projection maps as is.
    "mixer.in_proj.weight": ("mixer.in_proj.weight",),
    "mixer.conv.conv.weight": ("mixer.conv.weight",),
    "mixer.out_proj.weight": ("mixer.out_proj.weight",),
}
CONV_BIAS_KEYS: dict[str, tuple[str, ...]] = {
    "mixer.in_proj.bias": ("mixer.in_proj.bias",), "mixer.out_proj.bias": ("mixer.out_proj.bias",)
}
SLIDING_KEYS: dict[str, tuple[str, ...]] = {
    "mixer.Wqkv.weight": ("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight"),
    "mixer.out_proj.weight": ("mixer.o_proj.weight",),
}
BASED_LINEAR_ATTENTION_KEYS: dict[str, tuple[str, ...]] = {
    "mixer.proj_q.weight": ("mixer.q_proj.weight",), "mixer.proj_k.weight": ("mixer.k_proj.weight",),
    "mixer.proj_v.weight": ("mixer.v_proj.weight",), "mixer.out_proj.weight": ("mixer.o_proj.weight",),
}
PREFIX_LINEAR_ATTENTION_KEYS: dict[str, tuple[str, ...]] = {
    **BASED_LINEAR_ATTENTION_KEYS,
    "mixer.proj_k_enc.weight": ("mixer.k_enc_proj.weight",),
    "mixer.proj_v_enc.weight": ("mixer.v_enc_proj.weight",),
}
DECAY_PROJ_KEYS: dict[str, tuple[str, ...]] = {"mixer.decay_proj.weight": ("mixer.decay_proj.weight",)}

# Keys that carry no information of their own: the tied LM head and the fixed-decay buffer log(1 - 2**(c - h)),
# which our model recomputes. They are checked, then dropped.
TIED_HEAD_KEY = "lm_head.weight"
DECAY_BUFFER_KEY = "transformer.decay.decay"


@dataclass(frozen=True)
class FamilySpec:
    """What differs between families: the linear-attention key table and the reference loader's habits."""

    name: str
    description: str
    reference_loader: str
    linear_attention_keys: dict[str, tuple[str, ...]]
    linear_attention_type: str
    renames_conv1: bool  # [JRT]'s loader rewrites `conv1` -> `conv` in every key; [BASED]'s does not
    applies_decay: bool  # [JRT]'s parallel forward applies decay (with decay_proj); [BASED]'s never does


_JRT_LOADER = "HazyResearch/prefix-linear-attention train/src/models/gpt.py"
FAMILY_SPECS = {spec.name: spec for spec in (
    FamilySpec(
        "jrt", "JRT-RNN (prefix linear attention), e.g. hazyresearch/JRT-360M-30B, JRT-1B-50B", _JRT_LOADER,
        PREFIX_LINEAR_ATTENTION_KEYS, "prefix", renames_conv1=True, applies_decay=False,
    ),
    FamilySpec(
        "based-jrt-release", "Based from the JRT release (causal linear attention; fixed + input-dependent decay "
        "when configured), e.g. hazyresearch/based-360M-30B, based-1b-50b", _JRT_LOADER,
        BASED_LINEAR_ATTENTION_KEYS, "causal", renames_conv1=True, applies_decay=True,
    ),
    FamilySpec(
        "based-original", "Based, original release (causal linear attention, no decay), e.g. hazyresearch/based-360m, "
        "based-1b", "HazyResearch/based based/models/gpt.py",
        BASED_LINEAR_ATTENTION_KEYS, "causal", renames_conv1=False, applies_decay=False,
    ),
)}


def _get(config: dict, *names: str, where: str = "config.json"):
    """The first of `names` set in `config` (GPT2Config attribute-map aliases); a ConversionError when none is."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    raise ConversionError(f"{where} has no {' / '.join(repr(n) for n in names)}; the converter needs it.")


# Bounds of every size read from config.json, checked before anything is built from them: a config that asks for a
# billion layers or a 1e15-token prefix is refused in one line instead of allocating until memory runs out. They are
# far above the released models (26-36 layers, d <= 1792, 50264 rows, prefix 1024, window 256).
BOUNDS: dict[str, tuple[int, int]] = {
    "n_layer": (1, 10_000), "n_embd": (1, 65_536), "n_head": (1, 4_096), "n_inner": (1, 1_048_576),
    "vocab_size": (1, 16_777_216), "pad_vocab_size_multiple": (1, 65_536), "mixer.expand_proj": (2, 64),
    "mixer.kernel_size": (1, 1_024), "alt_mixer.feature_dim": (1, 1_024), "alt_mixer.num_heads": (1, 4_096),
    "alt_mixer_2.window_size": (1, 1_048_576), "enc_length": (1, 1_048_576),
}


def _int(value: object, field: str) -> int:
    """`value` as an int, or a ConversionError naming the field (JSON numbers only; 16.0 is accepted, "16" is not),
    within `BOUNDS[field]` when the field has bounds."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value != int(value):
        raise ConversionError(f"config.json field {field!r} must be an integer, got {value!r}.")
    if field in BOUNDS:
        low, high = BOUNDS[field]
        if not low <= value <= high:
            raise ConversionError(f"config.json field {field!r} must be between {low} and {high}, got "
                                  f"{f'{value:g}' if isinstance(value, float) else value}: fix config.json (or use "
                                  "the config.json that belongs to these weights).")
    return int(value)


def _float(value: object, field: str, *, positive: bool = False) -> float:
    """`value` as a finite float (a JSON number), or a ConversionError naming the field."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or (positive and value <= 0):
        kind = "a positive number" if positive else "a finite number"
        raise ConversionError(f"config.json field {field!r} must be {kind}, got {value!r}.")
    return float(value)


def check_layers_against_weights(arch: "ReferenceArchitecture", keys: list[str]) -> None:
    """The layers config.json describes are the layers the weights hold (`transformer.layers.{i}.*` keys), checked
    before any per-layer structure (key table, model) is built."""
    indices = sorted({int(match.group(1)) for key in keys if (match := _LAYER_KEY.match(key))})
    if indices != list(range(arch.num_layers)):
        held = (
            f"layers {indices[0]}-{indices[-1]} ({len(indices)} layers)" if indices else "no transformer.layers.* keys"
        )
        raise ConversionError(f"config.json n_layer={arch.num_layers}, but the weights hold {held}: "
                              "use the config.json that belongs to these weights (or fix its n_layer).")


_LAYER_KEY = re.compile(r"^transformer\.layers\.(\d+)\.")


def _layer_list(config: dict, name: str) -> set[int]:
    """The layer indices of `alt_mixer_layers` / `alt_mixer_2_layers` (a list of integers, or absent)."""
    value = config.get(name) or []
    if not isinstance(value, list):
        raise ConversionError(f"config.json field {name!r} must be a list of layer indices, got {value!r}.")
    return {_int(index, f"{name}[{position}]") for position, index in enumerate(value)}


def _mixer_dict(config: dict, name: str) -> dict | None:
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConversionError(f"config.json {name!r} must be a dict of mixer arguments, got {value!r}.")
    return value


def _target(mixer: dict | None) -> str:
    return str(mixer.get("_target_", "")) if mixer else ""


@dataclass
class ReferenceArchitecture:
    """What the reference config says about the network, in reference terms (docs/reference_architecture.md §2.1)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int  # the tokenizer's vocabulary (GPT-2: 50257)
    padded_vocab_size: int  # embedding rows (50264)
    layer_kinds: list[str]  # "conv" | "linear_attention" | "sliding_attention" per layer
    conv_expansion: int
    conv_kernel_size: int
    conv_bias: bool
    feature_dim: int
    enc_length: int | None
    window_size: int | None
    fixed_decay: bool
    decay_const: float
    use_decay_proj: bool
    rope_theta: float
    rms_norm_eps: float
    bos_token_id: int
    eos_token_id: int
    mask_token_id: int | None
    linear_attention_target: str
    notes: list[str] = field(default_factory=list)


def read_architecture(config: dict) -> ReferenceArchitecture:
    """Parse a reference config.json (a GPT2Config dump with `mixer` / `alt_mixer` / `alt_mixer_2` dicts)."""
    mixer = _mixer_dict(config, "mixer")
    alt_mixer = _mixer_dict(config, "alt_mixer")
    alt_mixer_2 = _mixer_dict(config, "alt_mixer_2")
    if mixer is None:
        raise ConversionError("Unknown checkpoint family: config.json has no 'mixer' dict, so it "
                              "is not a Based / JRT-RNN GPT2MixerConfig dump (supported families: "
                              f"{list(FAMILIES)}; the attention and Mamba baselines are not).")
    notes: list[str] = []
    num_layers = _int(_get(config, "n_layer", "num_hidden_layers"), "n_layer")
    hidden_size = _int(_get(config, "n_embd", "hidden_size"), "n_embd")
    num_heads = _int(_get(config, "n_head", "num_attention_heads"), "n_head")
    _check_backbone(config)

    # Layer kinds: alt_mixer_2 wins over alt_mixer, else the default mixer (docs/reference_architecture.md §1).
    sliding_layers = _layer_list(config, "alt_mixer_2_layers")
    linear_layers = _layer_list(config, "alt_mixer_layers")
    both = sorted(sliding_layers & linear_layers)
    if both:
        raise ConversionError(f"config.json lists layers {both} in both alt_mixer_layers (linear "
                              "attention) and alt_mixer_2_layers (sliding attention); each layer has one "
                              "mixer. Fix the config (the released checkpoints list disjoint layers).")
    for name, layers, mixer_args in (
        ("alt_mixer_2_layers", sliding_layers, alt_mixer_2),
        ("alt_mixer_layers", linear_layers, alt_mixer),
    ):
        outside = sorted(i for i in layers if not 0 <= i < num_layers)
        if outside:
            raise ConversionError(f"config.json {name} lists layers {outside} outside [0, n_layer={num_layers}).")
        if layers and mixer_args is None:
            raise ConversionError(f"config.json lists {name} but has no {name.removesuffix('_layers')!r} dict.")
    layer_kinds = [
        "sliding_attention" if i in sliding_layers else "linear_attention" if i in linear_layers else "conv"
        for i in range(num_layers)
    ]
    _check_kind(mixer, "the default mixer", "conv", "a gated convolution (BaseConv)")

    # Gated convolution (BaseConv; `kernel_sizes` is ignored by the reference constructor, so is it here).
    expand_proj = _int(mixer.get("expand_proj", 4), "mixer.expand_proj")
    if expand_proj % 2:
        raise ConversionError("BaseConv expand_proj must be even (inner width "
                              f"= expand_proj * d / 2), got {expand_proj}.")
    kernel_size = _int(mixer.get("kernel_size", 3), "mixer.kernel_size")
    if "kernel_sizes" in mixer:
        notes.append(
            f"mixer.kernel_sizes={mixer['kernel_sizes']!r} ignored, as by the reference (kernel_size={kernel_size})"
        )

    # Linear attention (PLA or Based LA).
    feature_dim, enc_length, use_decay_proj = 16, None, False
    if linear_layers:
        _check_kind(alt_mixer, "alt_mixer", "linear_attention", "a (prefix) linear attention")
        feature_dim = _int(alt_mixer.get("feature_dim", 16), "alt_mixer.feature_dim")
        heads = alt_mixer.get("num_heads")
        if heads is not None and _int(heads, "alt_mixer.num_heads") != num_heads:
            raise ConversionError(f"alt_mixer.num_heads={heads} differs from n_head={num_heads}; the "
                                  "converted model shares one head count between its attention layers.")
        _check_feature_map(alt_mixer)
        enc_length = alt_mixer.get("enc_length", config.get("enc_length"))
        use_decay_proj = bool(alt_mixer.get("use_decay_proj", False))
    if config.get("enc_length") is not None:  # the top-level copy is checked too, though the mixer's wins
        _int(config["enc_length"], "enc_length")

    window_size = None
    if sliding_layers:
        _check_kind(alt_mixer_2, "alt_mixer_2", "sliding", "a sliding-window attention")
        window_size = _int(_get(alt_mixer_2, "window_size", where="config.json alt_mixer_2"), "alt_mixer_2.window_size")
        if window_size == 4096:
            raise ConversionError("alt_mixer_2.window_size=4096 triggers the reference's per-layer window special "
                                  "case (layers 7 and 17 use 256), which the converted model does not support.")

    vocab_size = _int(config.get("vocab_size", 50257), "vocab_size")
    multiple = _int(config.get("pad_vocab_size_multiple", 8), "pad_vocab_size_multiple")
    padded_vocab_size = math.ceil(vocab_size / multiple) * multiple
    n_inner = config.get("n_inner")
    if n_inner is None:
        n_inner = 4 * hidden_size
        notes.append(f"n_inner not set: using GPT-2's default 4 * n_embd = {n_inner}.")
    # GatedMlp rounds its hidden width up to a multiple of 256.
    intermediate_size = math.ceil(_int(n_inner, "n_inner") / 256) * 256

    fixed_decay = bool(config.get("fixed_decay", (alt_mixer or {}).get("fixed_decay", False)))
    decay_const = _float(config.get("decay_const", (alt_mixer or {}).get("decay_const", -3)), "decay_const")
    mask_token_id = config.get("mask_token_id")
    return ReferenceArchitecture(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, padded_vocab_size=padded_vocab_size, layer_kinds=layer_kinds,
        conv_expansion=expand_proj // 2, conv_kernel_size=kernel_size, conv_bias=bool(mixer.get("use_bias", True)),
        feature_dim=feature_dim, enc_length=None if enc_length is None else _int(enc_length, "enc_length"),
        window_size=window_size, fixed_decay=fixed_decay, decay_const=decay_const, use_decay_proj=use_decay_proj,
        rope_theta=_float(config.get("rotary_emb_base", 10000.0), "rotary_emb_base", positive=True),
        rms_norm_eps=_float(config.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon", positive=True),
        bos_token_id=_token_id(config.get("bos_token_id", 50256), "bos_token_id"),
        eos_token_id=_token_id(config.get("eos_token_id", 50256), "eos_token_id"),
        mask_token_id=None if mask_token_id is None else _token_id(mask_token_id, "mask_token_id"),
        linear_attention_target=_target(alt_mixer), notes=notes,
    )


def _token_id(value: object, field: str) -> int:
    """A token id of the reference config.json: an integer >= 0, or a ConversionError naming the field. An id past
    the vocabulary is allowed here: `translate_config` writes it as None, with a note."""
    token_id = _int(value, field)
    if token_id < 0:
        raise ConversionError(f"config.json field {field!r} must be a token id (an integer >= 0), got "
                              f"{token_id}: fix config.json (the released models use GPT-2's <|endoftext|> "
                              "= 50256), or use the config.json that belongs to these weights.")
    return token_id


def _check_backbone(config: dict) -> None:
    """Settings the converted model hard-codes: refuse a checkpoint that departs from them."""
    expected = {
        "rms_norm": True, "activation_function": "swiglu", "tie_word_embeddings": True, "rotary_emb_fraction": 1,
        "rotary_emb_interleaved": False,
    }
    for name, value in expected.items():
        if name in config and config[name] is not None and config[name] != value:
            raise ConversionError(f"config.json {name}={config[name]!r} is not supported: every released Based "
                                  f"/ JRT-RNN checkpoint uses {value!r}, and so does the converted model.")
    if config.get("rotary_emb_scale_base") is not None:
        raise ConversionError("config.json rotary_emb_scale_base (xPos) is "
                              "not supported; the released models use None.")


def _check_feature_map(alt_mixer: dict) -> None:
    name = alt_mixer.get("feature_name")
    feature_map = alt_mixer.get("feature_map")
    target = _target(feature_map) if isinstance(feature_map, dict) else ""
    if (name is not None and name != "taylor_exp") or (target and "taylor" not in target.lower()):
        raise ConversionError(f"Unsupported linear-attention feature map (feature_name={name!r}, "
                              f"feature_map={target!r}): only the 2nd-order Taylor map "
                              "('taylor_exp' / TaylorExp) of the released models is implemented.")


def _check_kind(mixer: dict | None, where: str, kind: str, expected: str) -> None:
    """Refuse a mixer whose `_target_` does not name a mixer of `kind` (used only as identifying data)."""
    target = _target(mixer)
    name = target.rsplit(".", 1)[-1].lower()
    path = target.lower()
    if kind == "conv":
        fits = "conv" in name
    elif kind == "linear_attention":
        fits = "linearattention" in name or "linear_attn" in path or "linear_attention" in path
    else:
        fits = any(word in path for word in ("slid", "slide", "window"))
    if not fits:
        raise ConversionError(f"Unknown checkpoint family: {where} is {target!r}, "
                              f"not {expected}; supported families: {list(FAMILIES)}.")


@dataclass
class Detection:
    family: str
    evidence: str


def detect_family(
    config: dict, arch: ReferenceArchitecture, keys: list[str], *, requested: str = "auto", name_hint: str | None = None
) -> Detection:
    """Name the family of a reference checkpoint from its config, parsed architecture and state-dict keys (after
    `normalise_keys`). A `requested` family is checked against the structure. `name_hint` (the repo id or folder name)
    settles Based checkpoints without a JRT-only marker when it is a released name (both Based families convert them
    the same way).
    """
    if requested != "auto" and requested not in FAMILIES:
        raise ConversionError(f"Unknown family {requested!r}; choose 'auto' or one of {list(FAMILIES)}.")
    if "linear_attention" not in arch.layer_kinds:
        raise ConversionError("Unknown checkpoint family: config.json lists no "
                              "linear-attention layers (alt_mixer_layers), which every Based / "
                              f"JRT-RNN checkpoint has; supported families: {list(FAMILIES)}.")
    encoder_keys = [k for k in keys if k.endswith("mixer.proj_k_enc.weight")]
    if encoder_keys or "prefix" in arch.linear_attention_target.lower():
        evidence = (f"prefix linear attention ({len(encoder_keys)} '*.mixer.proj_k_enc.weight' keys, "
                    f"alt_mixer {arch.linear_attention_target!r})")
        return _checked(requested, "jrt", evidence)

    markers = []
    if any(k.endswith("mixer.decay_proj.weight") for k in keys) or arch.use_decay_proj:
        markers.append("input-dependent decay (decay_proj / use_decay_proj)")
    if any(_target(_mixer_dict(config, n)).startswith("src.") for n in ("mixer", "alt_mixer", "alt_mixer_2")):
        markers.append("'src.models.*' _target_ strings (rewritten only by the JRT loader)")
    if "do_update" in (_mixer_dict(config, "alt_mixer_2") or {}):
        markers.append("alt_mixer_2.do_update (deleted only by the JRT loader)")
    if any("conv1" in k for k in keys):
        markers.append("'conv1' keys (renamed only by the JRT loader)")
    hint = KNOWN_CHECKPOINTS.get((name_hint or "").rstrip("/").rsplit("/", 1)[-1].lower())
    if markers:
        family = "based-jrt-release"
        evidence = "causal linear attention with JRT-release markers: " + "; ".join(markers)
    elif hint is not None:
        family, evidence = hint, f"causal linear attention; released checkpoint name {name_hint!r}"
    else:
        family = "based-original"
        evidence = (
            "causal linear attention without JRT-release markers (decay_proj, 'src.models.*' targets, do_update, "
            "conv1 keys); such checkpoints convert identically as based-jrt-release"
        )
    if requested in ("based-jrt-release", "based-original"):
        return Detection(requested, f"requested; structure: {evidence}")
    return _checked(requested, family, evidence)


def _checked(requested: str, detected: str, evidence: str) -> Detection:
    if requested in ("auto", detected):
        return Detection(detected, evidence if requested == "auto" else f"requested; structure: {evidence}")
    raise ConversionError(f"--family {requested} does not fit this checkpoint: "
                          f"it has {evidence}, which is the {detected!r} family.")


def translate_config(
    arch: ReferenceArchitecture, spec: FamilySpec, *, prefix_pad_masking: str, dtype: torch.dtype,
    prefix_pad_token_id: int | None = GPT2_PREFIX_PAD_TOKEN_ID,
) -> tuple[dict, list[str]]:
    """Keyword arguments of `JRTRNNConfig` for a reference architecture, and notes saying which reference settings
    were translated or dropped (and why).

    Every token id is explicit: bos / eos / pad (= eos) from the reference config.json, the prefix pad as given. An id
    outside the vocabulary (a GPT2Config default left in a small-vocabulary model's config.json) is written as None.
    """
    notes = list(arch.notes)
    token_ids = {}
    for name, value in (("bos_token_id", arch.bos_token_id), ("eos_token_id", arch.eos_token_id)):
        token_ids[name] = value if value < arch.padded_vocab_size else None
        if token_ids[name] is None:
            notes.append(
                f"config.json {name}={value} is outside the {arch.padded_vocab_size}-row vocabulary (a GPT2Config "
                "default?): written as None"
            )
    decay, decay_proj = False, False
    if spec.applies_decay:
        if arch.use_decay_proj and not arch.fixed_decay:
            raise ConversionError("alt_mixer.use_decay_proj=true without fixed_decay: no "
                                  "released checkpoint uses this combination and the reference "
                                  "behaviour is not specified, so it is not converted.")
        decay = decay_proj = arch.use_decay_proj
        if arch.fixed_decay and not arch.use_decay_proj:
            notes.append("fixed_decay=true without use_decay_proj: the reference parallel forward ignores the decay "
                         "(it only reaches its recurrent step, a train/inference mismatch), so it is not applied.")
    elif arch.fixed_decay:
        notes.append(f"fixed_decay=true is ignored: the {spec.name} reference loader never applies the decay.")
    if arch.use_decay_proj and not spec.applies_decay:
        raise ConversionError(f"alt_mixer.use_decay_proj=true, but the {spec.name} family has no "
                              "input-dependent decay; convert with --family based-jrt-release.")

    is_prefix = spec.linear_attention_type == "prefix"
    prefix_length = arch.enc_length if arch.enc_length is not None else 1024
    if is_prefix and arch.enc_length is None:
        notes.append("enc_length not set in config.json: using the reference's 1024.")
    mask_token_id = None
    if is_prefix:
        mask_token_id = arch.mask_token_id if arch.mask_token_id is not None else arch.padded_vocab_size - 1
    kwargs = dict(
        vocab_size=arch.padded_vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, mixer_types=list(arch.layer_kinds),
        rms_norm_eps=arch.rms_norm_eps, tie_word_embeddings=True,
        # The reference window W is W // 2 previous tokens plus the token itself (docs/reference_architecture.md §1.2).
        sliding_window=(arch.window_size // 2 + 1) if arch.window_size is not None else 129,
        rope_theta=arch.rope_theta, conv_kernel_size=arch.conv_kernel_size, conv_expansion=arch.conv_expansion,
        conv_bias=arch.conv_bias, feature_dim=arch.feature_dim, linear_attention_type=spec.linear_attention_type,
        prefix_length=prefix_length if is_prefix else 0, prefix_pad_masking=prefix_pad_masking,
        prefix_pad_token_id=prefix_pad_token_id, linear_attention_decay=decay, decay_const=arch.decay_const,
        use_decay_proj=decay_proj, mask_token_id=mask_token_id,
        # generate() never emits the padding rows of the embedding: GPT-2's tokenizer cannot decode them (§7).
        generation_vocab_size=arch.vocab_size,
        bos_token_id=token_ids["bos_token_id"], eos_token_id=token_ids["eos_token_id"], dtype=dtype,
        # GPT-2 has no pad token; padding is masked by attention_mask, so eos is used (see the README).
        pad_token_id=token_ids["eos_token_id"],
    )
    return kwargs, notes


def layer_key_table(spec: FamilySpec, arch: ReferenceArchitecture, layer_idx: int) -> dict[str, tuple[str, ...]]:
    """Reference -> our keys for one block (relative to `transformer.layers.{i}.` / `model.layers.{i}.`)."""
    kind = arch.layer_kinds[layer_idx]
    table = dict(BLOCK_KEYS)
    if kind == "conv":
        table.update(CONV_KEYS)
        if arch.conv_bias:
            table.update(CONV_BIAS_KEYS)
    elif kind == "sliding_attention":
        table.update(SLIDING_KEYS)
    else:
        table.update(spec.linear_attention_keys)
        if spec.applies_decay and arch.use_decay_proj:
            table.update(DECAY_PROJ_KEYS)
    return table


__all__ = ["BOUNDS", "FAMILIES", "FAMILY_SPECS", "GPT2_PREFIX_PAD_TOKEN_ID", "KNOWN_CHECKPOINTS",
           "RELEASED_CHECKPOINTS", "Detection", "FamilySpec", "ReferenceArchitecture", "check_layers_against_weights",
           "detect_family", "layer_key_table", "read_architecture", "translate_config"]
