"""The inputs of one prefill of linear attention, checked once by `validate_linear_attention_inputs` into the
`LinearAttentionInputs` every implementation takes; and the small rules they share. Layouts: `LinearAttentionInputs`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .configuration_jrt import PREFIX_PAD_MASKINGS, check_choice
from .feature_map import num_taylor_features


class LinearAttentionInputs(NamedTuple):
    """One prefill's inputs: the arguments of `prefix_linear_attention` (declared here, once), validated and
    normalised. A named tuple: the decode step validates at every token and layer, and a tuple is cheap to build.

    Attributes:
        q, k: `(B, T, H, K)` decoder queries and keys. v: `(B, T, H, V)` decoder values.
        k_enc, v_enc: `(B, M, H, K)` / `(B, M, H, V)` encoder keys and values of the first M <= T tokens, or None.
        encoder_start, encoder_end: `(B,)` int64 (ints as arguments): row b's encoder reads positions
            `encoder_start[b] <= m < encoder_end[b]` of k_enc / v_enc; `[0, M)` for every row when none is given;
            None without an encoder.
        key_mask: `(B, T)` bool (a 0/1 mask as an argument), True for real tokens, or None.
        pad_masking: `"strict"` or `"reference"` (`linear_attention.py`, "Padding").
        initial_state: `(B, H, F, V + 1)` state of earlier tokens (continuing from a cache), or None.
        log_decay: `(H,)` log gamma of the Based fixed decay; gate: `(B, T, H)` its numerator gate; or None.
        eps: added to the denominator. chunk_size: the chunked scan's chunk length (>= 1).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_enc: torch.Tensor | None = None
    v_enc: torch.Tensor | None = None
    encoder_start: torch.Tensor | None = None
    encoder_end: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    pad_masking: str = "strict"
    initial_state: torch.Tensor | None = None
    log_decay: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    eps: float = 1e-12
    chunk_size: int = 32

    DIFFERENTIABLE = ("q", "k", "v", "k_enc", "v_enc", "initial_state", "gate")  # (a class attribute, not a field)

    @property
    def differentiable(self) -> tuple[torch.Tensor | None, ...]:
        """The `DIFFERENTIABLE` inputs, in that order: those a gradient flows to (None where absent)."""
        return tuple(getattr(self, name) for name in self.DIFFERENTIABLE)

    def kernel_options(self) -> dict:
        """The keyword arguments of the `jrt_kernels` prefill launcher besides q, k, v, k_enc, v_enc."""
        return dict(
            encoder_start=self.encoder_start, encoder_end=self.encoder_end, key_mask=self.key_mask,
            pad_masking=self.pad_masking, initial_state=self.initial_state, log_decay=self.log_decay, gate=self.gate,
            eps=self.eps,
        )

    def key_masks(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Which keys count (`linear_attention.py`, "Padding"): `(raw, decoder, encoder)`, `raw` `(B, T)` False where
        the raw key is zeroed before the feature map, `decoder` `(B, T)` / `encoder` `(B, M)` True where phi(k) enters
        the decoder / encoder sums; None means all True."""
        seq_len = self.q.shape[1]
        encoder_length = 0 if self.k_enc is None else self.k_enc.shape[1]
        key_mask, pad_masking = self.key_mask, self.pad_masking
        in_range = None  # (B, T): inside the row's encoder range
        if self.encoder_start is not None:
            positions = torch.arange(seq_len, device=self.encoder_start.device)
            in_range = (positions >= self.encoder_start[:, None]) & (positions < self.encoder_end[:, None])
        encoder = None if in_range is None else in_range[:, :encoder_length]
        if key_mask is None:
            return None, None, encoder
        # "reference": a masked key inside the encoder range keeps its weight-1 constant term
        decoder = key_mask if pad_masking == "strict" or in_range is None else key_mask | in_range
        if encoder is not None and pad_masking == "strict":
            encoder = encoder & key_mask[:, :encoder_length]
        return key_mask, decoder, encoder


def _as_row_index(value: torch.Tensor | int, batch_size: int, device: torch.device, name: str) -> torch.Tensor:
    """An int or a `(B,)` integer tensor -> `(B,)` int64 on `device`."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
        raise TypeError(f"{name} must be an int or a (B,) integer tensor; got {type(value).__name__}.")
    if isinstance(value, int):
        return torch.full((batch_size,), value, dtype=torch.long, device=device)
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.shape != (batch_size,):
        raise ValueError(f"{name} must be a (B,) = ({batch_size},) integer tensor; got {value.dtype} "
                         f"{tuple(value.shape)}.")
    return value.to(device=device, dtype=torch.long)


def validate_linear_attention_inputs(*args, **kwargs) -> LinearAttentionInputs:
    """The one check of a prefill's (or a decode step's, as T = 1) arguments, those of `LinearAttentionInputs` by
    position or name; normalises the encoder range to `(B,)` int64 and the key mask to bool. Errors name the argument.
    """
    try:
        fields = LinearAttentionInputs(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{error}: linear attention takes the fields of LinearAttentionInputs, "
                        f"{LinearAttentionInputs._fields}.") from None
    (q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, pad_masking, initial_state, log_decay, gate, eps,
     chunk_size) = fields
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (B, T, H, K); got q {tuple(q.shape)} and k {tuple(k.shape)}.")
    batch_size, seq_len, num_heads, feature_dim = q.shape
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, T, H, V) = ({batch_size}, {seq_len}, {num_heads}, V); got {tuple(v.shape)}.")
    if (k_enc is None) != (v_enc is None):
        raise ValueError("k_enc and v_enc must be given together (or both None for causal linear attention).")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}.")
    check_choice("pad_masking", pad_masking, PREFIX_PAD_MASKINGS)
    if key_mask is not None:
        if key_mask.shape != (batch_size, seq_len):
            raise ValueError(f"key_mask must be (B, T) = ({batch_size}, {seq_len}); got {tuple(key_mask.shape)}.")
        key_mask = key_mask if key_mask.dtype == torch.bool else key_mask != 0  # a 0/1 mask is fine too
    state_shape = (batch_size, num_heads, num_taylor_features(feature_dim), v.shape[-1] + 1)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be (B, H, F, V + 1) = {state_shape}; got {tuple(initial_state.shape)}.")
    if log_decay is not None and tuple(log_decay.shape) != (num_heads,):
        raise ValueError(f"log_decay must be (H,) = ({num_heads},); got {tuple(log_decay.shape)}.")
    if gate is not None and gate.shape != (batch_size, seq_len, num_heads):
        raise ValueError(f"gate must be (B, T, H) = ({batch_size}, {seq_len}, {num_heads}); got {tuple(gate.shape)}.")
    if k_enc is None:
        if encoder_start is not None or encoder_end is not None:
            raise ValueError("encoder_start / encoder_end describe the encoder keys: pass k_enc and v_enc with them.")
        return fields if key_mask is fields.key_mask else fields._replace(key_mask=key_mask)

    encoder_length = k_enc.shape[1]
    if k_enc.ndim != 4 or k_enc.shape != (batch_size, encoder_length, num_heads, feature_dim):
        raise ValueError(f"k_enc must be (B, M, H, K) with B, H, K of q; got {tuple(k_enc.shape)}.")
    if v_enc.shape != (batch_size, encoder_length, num_heads, v.shape[-1]):
        raise ValueError(f"v_enc must be (B, M, H, V) with B, H, V of v; got {tuple(v_enc.shape)}.")
    if encoder_length > seq_len:
        raise ValueError(f"The encoder covers the first M tokens, so M ({encoder_length}) must be <= T ({seq_len}).")
    if log_decay is not None or gate is not None:
        raise ValueError("Decay and gate are Based (causal) options; they cannot be combined with an encoder prefix.")
    start = _as_row_index(0 if encoder_start is None else encoder_start, batch_size, q.device, "encoder_start")
    end = _as_row_index(encoder_length if encoder_end is None else encoder_end, batch_size, q.device, "encoder_end")
    given = encoder_start is not None or encoder_end is not None  # the default [0, M) needs no check (no host sync)
    invalid = (start < 0) | (start > end) | (end > encoder_length)
    if given and not torch.compiler.is_compiling() and bool(invalid.any()):
        raise ValueError(
            f"The encoder range must satisfy 0 <= encoder_start <= encoder_end <= M = {encoder_length} in every row; "
            f"got encoder_start {start.tolist()} and encoder_end {end.tolist()}."
        )
    return fields._replace(encoder_start=start, encoder_end=end, key_mask=key_mask)


def fixed_log_decay(decay_const: float, heads: range, device: torch.device) -> torch.Tensor:
    """`(len(heads),)` log gamma_h of the Based fixed decay, gamma_h = 1 - 2**(decay_const - h), for the heads `heads`
    (all of a layer's, or one tensor-parallel rank's), computed in fp64 and returned in fp32."""
    index = torch.arange(heads.start, heads.stop, device=device, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, decay_const - index)).float()


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64 (oracle tests); everything else is computed in fp32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def records_gradients(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a graph through any of `tensors` (the differentiable inputs; None = absent)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


__all__ = [
    "LinearAttentionInputs", "compute_dtype", "fixed_log_decay", "records_gradients",
    "validate_linear_attention_inputs",
]
