"""Configuration of JRT-RNN and Based models (`model_type = "jrt_rnn"`).

The mixer of each layer is `mixer_types`, not `layer_types`, which transformers reads as its own vocabulary
(docs/architecture.md, "Independent of transformers' layer vocabulary"). An older config.json's `"layer_types"`
moves to `mixer_types` before transformers' own config code runs.
"""

from __future__ import annotations

import math

from .transformers_range import check_transformers_release

check_transformers_release()  # one line naming the range, before transformers' own imports can fail on 4.x

from huggingface_hub.dataclasses import strict  # noqa: E402
from transformers.configuration_utils import PreTrainedConfig  # noqa: E402

MIXER_TYPES = ("conv", "sliding_attention", "linear_attention")
LINEAR_ATTENTION_TYPES = ("prefix", "causal")
PREFIX_PAD_MASKINGS = ("strict", "reference")
LINEAR_ATTENTION_IMPLEMENTATIONS = ("auto", "chunked", "triton", "quadratic")
PREFIX_STRATEGIES = ("pad", "repeat", "none")


# Field checks, on construction and on load, before anything derives values from the fields.
POSITIVE_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "sliding_window", "conv_kernel_size",
    "conv_expansion", "feature_dim", "linear_attention_chunk_size",
)
NON_NEGATIVE_INT_FIELDS = ("intermediate_size", "prefix_length")
# Upper bound of every size field: a typo in a config.json gets a one-line error, not an allocator failure later.
# Each bound is far above any published model of this family (feature_dim 2**7: 16,513 Taylor features per head).
MAX_SIZES = {
    "vocab_size": 2**22, "hidden_size": 2**16, "intermediate_size": 2**18, "num_hidden_layers": 2**10,
    "num_attention_heads": 2**10, "sliding_window": 2**20, "conv_kernel_size": 2**8, "conv_expansion": 2**6,
    "feature_dim": 2**7, "linear_attention_chunk_size": 2**12, "prefix_length": 2**20,
}
# The embedding's parameters, bounded as well (factors within their bounds can still ask for 1 TB): 32 GB in fp32.
MAX_EMBEDDING_ELEMENTS = 2**33
POSITIVE_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "linear_attention_eps")
NON_NEGATIVE_FLOAT_FIELDS = ("mlm_weight", "initializer_range")
BOOL_FIELDS = ("tie_word_embeddings", "conv_bias", "linear_attention_decay", "use_decay_proj", "use_cache")
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "prefix_pad_token_id", "mask_token_id")


def check_choice(field: str, value: object, allowed: tuple[str, ...]) -> str:
    """`value` if it is one of `allowed`, else a `ValueError` naming `field` and the choices (every named choice)."""
    if value not in allowed:
        raise ValueError(f"`{field}` must be one of {list(allowed)}, got {value!r}.")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, *, minimum: int) -> None:
    """`value` is an int (not a bool, float or string), `>= minimum` and at most the field's `MAX_SIZES` bound."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if not _is_int(value) or value < minimum:
        raise ValueError(f"`{field}` must be {kind}, got {value!r} ({type(value).__name__}).")
    maximum = MAX_SIZES.get(field)
    if maximum is not None and value > maximum:
        raise ValueError(f"`{field}` must be at most {maximum:,}, got {value:,}: check the value (a typo in "
                         "config.json?).")


def _check_float(field: str, value: object, *, positive: bool) -> None:
    """`value` is a finite real number, `> 0` (positive) or `>= 0`."""
    kind = "a finite number > 0" if positive else "a finite number >= 0"
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"`{field}` must be {kind}, got {value!r}.")


def _check_mixer_types(mixer_types: object, field: str = "mixer_types") -> list[str]:
    """`mixer_types` as a list of this model's own mixer names (`MIXER_TYPES`), one per layer."""
    if isinstance(mixer_types, str) or not isinstance(mixer_types, (list, tuple)):
        raise ValueError(f"`{field}` must be a list with one of {list(MIXER_TYPES)} per layer, got {mixer_types!r}.")
    for index, mixer_type in enumerate(mixer_types):
        if mixer_type not in MIXER_TYPES:
            raise ValueError(f"`{field}[{index}]` is {mixer_type!r}; allowed mixer types are {list(MIXER_TYPES)}.")
    return list(mixer_types)


@strict
class JRTRNNConfig(PreTrainedConfig):
    r"""
    Configuration of a JRT-RNN (prefix linear attention) or Based (causal linear attention) model: pre-norm blocks
    whose mixer is `"conv"`, `"sliding_attention"` or `"linear_attention"`, each followed by a SwiGLU MLP.

    Args:
        vocab_size: Rows of the embedding and the LM head (the released models pad GPT-2's 50257 to 50264).
        hidden_size: Model width `d`.
        intermediate_size: Hidden width of the SwiGLU MLP (2 * d in the released models); 0 removes the MLPs.
        num_hidden_layers: Number of blocks.
        num_attention_heads: Heads of both the sliding-window and the linear attention (head dim = d / heads).
        mixer_types: Mixer of each layer (`MIXER_TYPES`); default `default_mixer_types`. Former name: `layer_types`.
        rms_norm_eps: Epsilon of every RMSNorm.
        tie_word_embeddings: Share the LM head with the input embedding (True in every released model).
        sliding_window: Keys a sliding-attention query sees, itself included (the reference's `window_size: 256` is
            129).
        rope_theta: RoPE base of the sliding-window attention.
        conv_kernel_size: Taps of the depthwise causal convolution.
        conv_expansion: Width of the convolution branch as a multiple of `hidden_size` (`expand_proj: 4` gives 2).
        conv_bias: Whether the convolution block's input and output projections have biases.
        feature_dim: Per-head dimension `f` of the linear-attention queries and keys (`1 + f + f**2` features).
        linear_attention_type: `"prefix"` (JRT-RNN: a non-causal encoder reads the prefix) or `"causal"` (Based).
        prefix_length: Length `M` of the non-causal prefix (1024 in the released JRT models), counted from each row's
            first real token; `forward(prefix_length=...)` sets it per call and per row.
        prefix_pad_masking: How the JRT prefix fill is removed from the linear attention: `"strict"` (it contributes
            nothing) or `"reference"` (each pad still adds its value with weight 1, as the original code does;
            `linear_attention.py`). Batch padding is always removed entirely.
        prefix_pad_token_id: The token of the `"pad"` fill of a JRT prefix (`prefix_strategy`) and of `jrt_eval`'s
            scoring. The default, 0, is a token of every vocabulary; the released models use GPT-2's " " = 220.
        prefix_strategy: How the first forward fills a prompt shorter than `prefix_length` (`prefix_fill.py`):
            `"pad"` (the reference protocol), `"repeat"` or `"none"`; per call `forward` / `generate(prefix_strategy=)`.
        linear_attention_decay: Fixed per-head decay `gamma_h = 1 - 2**(decay_const - h)` of the numerator state
            (based-360M-30B; causal only).
        decay_const: Exponent offset of the fixed decay (-3 in the released model).
        use_decay_proj: Input-dependent numerator gate `g = x W`, one value per head (based-360M-30B; causal only).
        linear_attention_eps: Added to the linear-attention denominator (1e-12 as in the reference).
        linear_attention_implementation: `"auto"`, `"chunked"` (PyTorch), `"triton"` (the kernels of `jrt_kernels`)
            or `"quadratic"` (the oracle prefill; tests only), as `kernel_choice.py` describes.
        linear_attention_chunk_size: Chunk length of the chunked PyTorch prefill.
        mask_token_id: The [MASK] id of the JRT masked-LM objective (50263 in the released models), or None; never
            generated.
        generation_vocab_size: Number of leading vocabulary rows `generate()` may sample (the tokenizer's, 50257 for
            the released models); the rows after only pad the embedding. None: every row may be generated.
        mlm_weight: Weight of the masked-LM term of the JRT objective (`loss.py`; 0.25 in the reference).
        initializer_range: Standard deviation of the normal initialisation.
        pad_token_id, bos_token_id, eos_token_id: Special token ids of the vocabulary, or None (the default).
            `generate()` without a prompt needs `bos_token_id`, and stops early only at `eos_token_id`.

    Every size field has an upper bound (`MAX_SIZES`).
    """

    model_type = "jrt_rnn"
    keys_to_ignore_at_inference = ["cache", "ntp_loss", "mlm_loss"]

    vocab_size: int = 50264
    hidden_size: int = 1024
    intermediate_size: int = 2048
    num_hidden_layers: int = 26
    num_attention_heads: int = 16
    mixer_types: list[str] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    sliding_window: int = 129
    rope_theta: float = 10000.0
    conv_kernel_size: int = 3
    conv_expansion: int = 2
    conv_bias: bool = True
    feature_dim: int = 16
    linear_attention_type: str = "prefix"
    prefix_length: int = 1024
    prefix_pad_masking: str = "strict"
    prefix_pad_token_id: int | None = 0
    prefix_strategy: str = "pad"
    linear_attention_decay: bool = False
    decay_const: float = -3.0
    use_decay_proj: bool = False
    linear_attention_eps: float = 1e-12
    linear_attention_implementation: str = "auto"
    linear_attention_chunk_size: int = 32
    mask_token_id: int | None = None
    generation_vocab_size: int | None = None
    mlm_weight: float = 0.25
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        self.validate_fields()
        # The former name leaves `kwargs` before transformers' `__post_init__` sees it (module docstring).
        legacy = kwargs.pop("layer_types", None)
        if legacy is not None:
            legacy = _check_mixer_types(legacy, "layer_types")
            if self.mixer_types is not None and list(self.mixer_types) != legacy:
                raise ValueError(f"`layer_types` ({legacy}) and `mixer_types` ({list(self.mixer_types)}) disagree: "
                                 "pass `mixer_types` only (`layer_types` is its former name).")
            self.mixer_types = legacy
        if self.mixer_types is None:
            self.mixer_types = default_mixer_types(self.num_hidden_layers)
        else:
            self.mixer_types = _check_mixer_types(self.mixer_types)
        super().__post_init__(**kwargs)
        # Validate here as well as through @strict, so that users get a plain ValueError (not a wrapped one).
        self.validate_architecture()

    def validate_fields(self) -> None:
        """Type and range of every field on its own; every error names the field, the value and what is allowed."""
        for fields, minimum in ((POSITIVE_INT_FIELDS, 1), (NON_NEGATIVE_INT_FIELDS, 0)):
            for field in fields:
                _check_int(field, getattr(self, field), minimum=minimum)
        for fields, positive in ((POSITIVE_FLOAT_FIELDS, True), (NON_NEGATIVE_FLOAT_FIELDS, False)):
            for field in fields:
                _check_float(field, getattr(self, field), positive=positive)
        for field in BOOL_FIELDS:
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"`{field}` must be True or False, got {getattr(self, field)!r}.")
        if self.vocab_size * self.hidden_size > MAX_EMBEDDING_ELEMENTS:
            elements = self.vocab_size * self.hidden_size
            raise ValueError(f"`vocab_size` x `hidden_size` = {self.vocab_size:,} x {self.hidden_size:,} = "
                             f"{elements:,} embedding parameters ({elements * 4 / 2**30:,.0f} GiB in float32), above "
                             f"{MAX_EMBEDDING_ELEMENTS:,}: check the values (a typo in config.json?).")
        for field in TOKEN_ID_FIELDS:  # None, or a token id (a list of ids for `eos_token_id`)
            value = getattr(self, field)
            ids = value if field == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            if value is not None and not all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"`{field}` must be None or a token id in [0, vocab_size={self.vocab_size}), got "
                                 f"{value!r}: set it to a token of this vocabulary (or None).")
        decay_const = self.decay_const
        if isinstance(decay_const, bool) or not isinstance(decay_const, (int, float)) or not math.isfinite(decay_const):
            raise ValueError(f"`decay_const` must be a finite number, got {self.decay_const!r}.")
        if self.linear_attention_decay and self.decay_const >= 0:
            # gamma_h = 1 - 2**(decay_const - h) lies in (0, 1) for every head h >= 0 only when decay_const < 0.
            raise ValueError("`decay_const` must be < 0 so that every decay 1 - 2**(decay_const - h) lies in (0, 1), "
                             f"got {self.decay_const}.")
        if self.generation_vocab_size is not None and (
            not _is_int(self.generation_vocab_size) or not 0 < self.generation_vocab_size <= self.vocab_size
        ):
            raise ValueError(f"`generation_vocab_size` ({self.generation_vocab_size!r}) must be in [1, "
                             f"vocab_size={self.vocab_size}] (or None to allow every row).")

    def validate_architecture(self):
        """Cross-field checks; every error names the field, the value and what is allowed."""
        self.validate_fields()
        _check_mixer_types(self.mixer_types)
        if len(self.mixer_types) != self.num_hidden_layers:
            raise ValueError(f"`mixer_types` has {len(self.mixer_types)} entries but `num_hidden_layers` is "
                             f"{self.num_hidden_layers}: give exactly one mixer type per layer.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                             f"({self.num_attention_heads}).")
        if (self.hidden_size // self.num_attention_heads) % 2 != 0:
            raise ValueError(
                f"The head dim `hidden_size / num_attention_heads` = {self.hidden_size // self.num_attention_heads} "
                "must be even for the rotary embedding of the sliding-window attention."
            )
        check_choice("linear_attention_type", self.linear_attention_type, LINEAR_ATTENTION_TYPES)
        check_choice("prefix_pad_masking", self.prefix_pad_masking, PREFIX_PAD_MASKINGS)
        check_choice("prefix_strategy", self.prefix_strategy, PREFIX_STRATEGIES)
        check_choice(
            "linear_attention_implementation", self.linear_attention_implementation, LINEAR_ATTENTION_IMPLEMENTATIONS
        )
        if self.linear_attention_type == "prefix" and (self.linear_attention_decay or self.use_decay_proj):
            raise ValueError("`linear_attention_decay` and `use_decay_proj` are Based options: they need "
                             "`linear_attention_type='causal'`, got 'prefix'.")

    @property
    def layer_types(self) -> list[str]:
        """Not an attribute (module docstring): None for transformers' `getattr`, the new name for users."""
        raise AttributeError("`JRTRNNConfig.layer_types` is now `mixer_types` (same values): transformers reads a "
                             "config's `layer_types` as its own cache and layer vocabulary, differently from release "
                             "to release, so this model keeps its mixers under a name of its own. "
                             "`JRTRNNConfig(layer_types=...)` and config.json files with `layer_types` still load.")

    @property
    def is_prefix_model(self) -> bool:
        """Whether the model reads a JRT prefix: prefix linear attention in at least one layer."""
        return self.linear_attention_type == "prefix" and "linear_attention" in self.mixer_types

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_taylor_features(self) -> int:
        """Size of the 2nd-order Taylor feature map: 1 + f + f**2 (273 for f = 16)."""
        return 1 + self.feature_dim + self.feature_dim**2


def default_mixer_types(num_hidden_layers: int) -> list[str]:
    """The released Based/JRT pattern: linear attention at 1, 6, 11, 16, 21, then every 6th layer from 27
    (27, 33 in the 36-layer models), sliding attention right after each, convolutions elsewhere."""
    linear = [i for i in (1, 6, 11, 16, 21) if i < num_hidden_layers]
    linear += list(range(27, num_hidden_layers, 6))
    mixer_types = ["conv"] * num_hidden_layers
    for i in linear:
        mixer_types[i] = "linear_attention"
        if i + 1 < num_hidden_layers:
            mixer_types[i + 1] = "sliding_attention"
    return mixer_types


default_layer_types = default_mixer_types  # the former name


# `save_pretrained` ships this file as remote code (`JRTRNNPreTrainedModel.save_pretrained`).
JRTRNNConfig.register_for_auto_class()

__all__ = ["MAX_SIZES", "MIXER_TYPES", "JRTRNNConfig", "default_layer_types", "default_mixer_types"]
