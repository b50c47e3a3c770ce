"""Prefix linear attention (JRT-RNN) and causal linear attention (Based) with the 2nd-order Taylor feature map.

Math (docs/reference_architecture.md §1.3-1.5; the algorithms and numerics: docs/prefill.md). For per-head
queries/keys of dimension K (the feature dim, 16 in the released models) the Taylor feature map is

    phi(x) = [1, x / K**(1/4), vec(x x^T) / (sqrt(2) sqrt(K))]        (F = 1 + K + K**2 features)

so that phi(q) . phi(k) = 1 + s + s**2 / 2 with s = q . k / sqrt(K); every weight is >= 1/2.

Prefix linear attention reads the first M tokens twice: once non-causally through separate encoder keys and
values (k_enc, v_enc) and once causally with the decoder keys and values (k, v). With one shared denominator:

    y_i = [sum_{m<M} phi(q_i).phi(ke_m) ve_m + sum_{j<=i} phi(q_i).phi(k_j) v_j]
          / [sum_{m<M} phi(q_i).phi(ke_m)    + sum_{j<=i} phi(q_i).phi(k_j)    + eps]

    query i \\ key:  encoder keys (m < M)    decoder keys j
                     e e e e                 x . . . . .
                     e e e e                 x x . . . .       every query sees the whole encoder,
                     e e e e                 x x x . . .       and the decoder keys causally
                     e e e e                 x x x x . .

M = 0 gives causal Based linear attention. The Based decay variant (based-360M-30B) multiplies the numerator
weights by gamma_h**(i-j) and by an input-dependent gate g_{i,h}; its denominator has neither.

Recurrent state (shared by every implementation and stored in the generation cache), fp32 whatever the model dtype:

    state[b, h, :, :V] = sum_j phi(k_j) v_j^T   (decayed when a decay is set)      shape (B, H, F, V)
    state[b, h, :, V]  = sum_j phi(k_j)          (never decayed)                     shape (B, H, F)

i.e. one tensor of shape (B, H, F, V + 1), with the encoder sum included. Decoding is then
    state <- state (decayed) + phi(k_t) [v_t, 1];  y_t = g_t phi(q_t).state[:, :V] / (phi(q_t).state[:, V] + eps).

The encoder range (per row). Row b's encoder reads the positions `encoder_start[b] <= m < encoder_end[b]` of k_enc /
v_enc, which cover the first M positions of the same sequence (`0 <= start <= end <= M <= T`). The rows of a batch
can so have different prefixes: a left-padded row starts after its padding, a scored row ends where its context
ends. Without a range every row reads all M encoder positions. Positions outside the range are no encoder keys.

Padding: `key_mask` `(B, T)` marks real tokens (its first M columns also describe the encoder positions). A masked
key outside the row's encoder range (batch padding, which lies before the range or after the row) never contributes.
A masked key inside the range (the fill of the JRT prefix) is removed as `pad_masking` says:
`"strict"` removes it (phi(k) is zeroed *after* the feature map: phi(0) is not 0, its constant term is 1); with
`"reference"` the raw key is zeroed *before* the feature map as the original code does, so the pad still adds its
value with weight 1, to the encoder and to the decoder sums (the leak of the reference,
docs/reference_architecture.md §2.1).

Layouts at every function boundary: q, k `(B, T, H, K)`, v and outputs `(B, T, H, V)`, encoder tensors
`(B, M, H, K)` / `(B, M, H, V)` for the first M tokens, encoder_start / encoder_end `(B,)` int64, key_mask `(B, T)`
bool (True = real token), gate `(B, T, H)`, log_decay `(H,)` = log gamma. `validate_linear_attention_inputs` checks
them once for every implementation and makes the frozen `LinearAttentionInputs` they take
(`linear_attention_inputs.py`; the Triton kernel too: the dispatcher validates before it calls the kernel).

Implementations behind `prefix_linear_attention(..., implementation=...)` (a name, or the `KernelChoice` of the
model that calls: `kernel_choice.py` is the one place that decides, and remembers a kernel that failed):
    "quadratic"  materialises the (T, T) weights and the full feature map: the oracle of the tests (use fp64).
    "chunked"    O(T) time, O(block x state) working memory chunked scan in PyTorch (`chunked_scan.py`); the encoder
                 sum is its initial state; with autograd and under torch.compile one custom op with an explicit
                 backward (`chunked_scan_autograd.py`).
    "triton"     the fused GPU kernel of `jrt_kernels` (optional dependency; forward and backward, decay and gate).
    "auto"       "triton" on CUDA tensors when the kernels are installed, else "chunked"; a kernel that fails to
                 compile or launch on the device (forward or backward) warns once and the call (and every later one
                 of the same choice) runs "chunked" (a failed backward: its gradients are those of the chunked path).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import torch

from .chunked_scan import full_state, scan_in_place
from .chunked_scan_autograd import scan
from .compact_taylor import CompactTaylor
from .kernel_choice import BACKWARD, LINEAR_ATTENTION, KernelChoice
from .linear_attention_inputs import LinearAttentionInputs, num_taylor_features, validate_linear_attention_inputs


def taylor_feature_map(x: torch.Tensor) -> torch.Tensor:
    """2nd-order Taylor feature map (docs/reference_architecture.md §1.3).

    Args:
        x: `(..., K)` queries or keys of one head.

    Returns:
        `(..., 1 + K + K**2)`: `[1, x / K**0.25, vec(x x^T) / (sqrt(2) sqrt(K))]`, all ordered pairs, row-major.
    """
    feature_dim = x.shape[-1]
    ones = torch.ones_like(x[..., :1])
    linear = x / feature_dim**0.25
    quadratic = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / (math.sqrt(2.0) * math.sqrt(feature_dim))
    return torch.cat([ones, linear, quadratic], dim=-1)


def fixed_log_decay(decay_const: float, heads: range, device: torch.device) -> torch.Tensor:
    """`(len(heads),)` log gamma_h of the Based fixed decay, gamma_h = 1 - 2**(decay_const - h), for the heads `heads`
    (all of a layer's, or one tensor-parallel rank's), computed in fp64 and returned in fp32."""
    index = torch.arange(heads.start, heads.stop, device=device, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, decay_const - index)).float()


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """fp64 stays fp64 (oracle tests); everything else is computed in fp32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def prefix_linear_attention_quadratic(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The O(T^2) oracle, `prefix_linear_attention(..., implementation="quadratic")`: materialises phi (F features)
    and the (T, T) weights. Tests only; pass fp64 inputs (the state is then fp64 too)."""
    return prefix_linear_attention(*args, **kwargs, implementation="quadratic")


def _quadratic(inputs: LinearAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle (`prefix_linear_attention_quadratic`) on validated inputs."""
    k_enc, v_enc, initial_state = inputs.k_enc, inputs.v_enc, inputs.initial_state
    log_decay, gate, eps = inputs.log_decay, inputs.gate, inputs.eps
    output_dtype = inputs.v.dtype
    dtype = _compute_dtype(inputs.q)
    seq_len, value_dim = inputs.q.shape[1], inputs.v.shape[-1]
    encoder_length = 0 if k_enc is None else k_enc.shape[1]
    raw, decoder_keys, encoder_keys = inputs.key_masks()
    q, k, v = inputs.q.to(dtype), inputs.k.to(dtype), inputs.v.to(dtype)

    phi_q = taylor_feature_map(q)  # (B, T, H, F)
    phi_k = _features_of_keys(k, raw, decoder_keys)  # (B, T, H, F)
    weights = torch.einsum("bihf,bjhf->bhij", phi_q, phi_k)  # (B, H, T, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    weights = weights.masked_fill(~causal, 0.0)

    positions = torch.arange(seq_len, device=q.device, dtype=dtype)
    numerator_weights = weights
    if log_decay is not None:
        distance = (positions[:, None] - positions[None, :]).clamp(min=0)  # (T, T)
        numerator_weights = weights * torch.exp(log_decay.to(dtype)[:, None, None] * distance)  # (B, H, T, T)
    numerator = torch.einsum("bhij,bjhv->bihv", numerator_weights, v)  # (B, T, H, V)
    denominator = weights.sum(-1).transpose(1, 2)  # (B, T, H)

    if initial_state is not None:
        previous = initial_state.to(dtype)
        previous_numerator = torch.einsum("bihf,bhfv->bihv", phi_q, previous[..., :value_dim])  # (B, T, H, V)
        if log_decay is not None:
            # The previous state is decayed once more for every token read since: gamma^(i + 1).
            previous_numerator = previous_numerator * torch.exp(
                log_decay.to(dtype)[None, None, :, None] * (positions[None, :, None, None] + 1)
            )
        numerator = numerator + previous_numerator
        denominator = denominator + torch.einsum("bihf,bhf->bih", phi_q, previous[..., value_dim])

    if k_enc is not None:
        raw_enc = None if raw is None else raw[:, :encoder_length]
        phi_k_enc = _features_of_keys(k_enc.to(dtype), raw_enc, encoder_keys)  # (B, M, H, F)
        encoder_weights = torch.einsum("bihf,bmhf->bhim", phi_q, phi_k_enc)  # (B, H, T, M)
        numerator = numerator + torch.einsum("bhim,bmhv->bihv", encoder_weights, v_enc.to(dtype))
        denominator = denominator + encoder_weights.sum(-1).transpose(1, 2)

    if gate is not None:
        numerator = numerator * gate.to(dtype)[..., None]
    output = numerator / (denominator[..., None] + eps)

    # Final state: sum over all keys, the decoder part decayed to the last position.
    value_and_one = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, T, H, V + 1)
    key_features = phi_k
    if log_decay is not None:
        age = (seq_len - 1 - positions)[None, :, None, None]
        decayed = phi_k * torch.exp(log_decay.to(dtype)[None, None, :, None] * age)
        state = torch.cat(
            [torch.einsum("bthf,bthv->bhfv", decayed, v), phi_k.sum(1)[..., None]], dim=-1
        )  # (B, H, F, V + 1)
    else:
        state = torch.einsum("bthf,bthv->bhfv", key_features, value_and_one)  # (B, H, F, V + 1)
    if initial_state is not None:
        previous = initial_state.to(dtype)
        if log_decay is not None:
            decay_all = torch.exp(log_decay.to(dtype) * seq_len)[None, :, None, None]
            previous = torch.cat([previous[..., :value_dim] * decay_all, previous[..., value_dim:]], dim=-1)
        state = state + previous
    if k_enc is not None:
        v_enc_and_one = torch.cat([v_enc.to(dtype), torch.ones_like(v_enc[..., :1], dtype=dtype)], dim=-1)
        state = state + torch.einsum("bmhf,bmhv->bhfv", phi_k_enc, v_enc_and_one)
    return output.to(output_dtype), state


def _features_of_keys(keys: torch.Tensor, raw: torch.Tensor | None, counted: torch.Tensor | None) -> torch.Tensor:
    """phi of keys `(B, T, H, K)` -> `(B, T, H, F)`: raw keys zeroed where `raw` is False (the reference's masking,
    before the feature map), features zeroed where `counted` is False (after it: phi(0) = [1, 0, ...] is not 0)."""
    if raw is not None:
        keys = keys * raw[:, :, None, None].to(keys.dtype)
    features = taylor_feature_map(keys)
    if counted is not None:
        features = features * counted[:, :, None, None].to(features.dtype)
    return features


def prefix_linear_attention_chunked(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan, `prefix_linear_attention(..., implementation="chunked")`: O(T) time, differentiable.

    Per chunk of C tokens (docs/prefill.md §4.2):

        inter-chunk  o_c  = phi(Q_c) @ state                         everything before the chunk (and the encoder)
        intra-chunk  o_c += tril(1 + S + S**2 / 2) @ [V_c, 1]          S = Q_c K_c^T / sqrt(K): no (C, F) features
        update       state += phi(K_c)^T @ [V_c, 1]

    The encoder sum over each row's encoder range is the initial state. The features are the compact ones of
    `compact_taylor.CompactTaylor` (153 instead of 273 rows for K = 16); the state is returned in the full layout.
    Two executions of the same scan:

    - without autograd (inference), eagerly: `chunked_scan.scan_in_place`, blocks of chunks in one reused
      workspace, the state read and updated chunk by chunk (the Based decay included);
    - with autograd, or under torch.compile: the custom op `chunked_scan_autograd.scan`, whose forward is the same
      scan and whose backward is explicit (two sweeps over the chunks, keeping only the output and one denominator
      per token for the backward pass; docs/prefill.md §4.4). A compiled graph holds the op as one node whatever T
      is: compile time and memory do not depend on T, and `dynamic=True` does not recompile for a new length.
    """
    return prefix_linear_attention(*args, **kwargs, implementation="chunked")


def _empty_prefill(inputs: LinearAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The result for no rows (B = 0) or no tokens (T = 0, hence M = 0): an empty output and the state unchanged
    (the initial state, or zeros), as the oracle gives; both stay connected to the inputs for autograd."""
    q, v, initial_state = inputs.q, inputs.v, inputs.initial_state
    batch_size, _, num_heads, feature_dim = q.shape
    if initial_state is not None:
        state = initial_state.to(_compute_dtype(q)) * 1
    else:
        state = q.new_zeros(batch_size, num_heads, num_taylor_features(feature_dim), v.shape[-1] + 1,
                            dtype=_compute_dtype(q))
    return v * 0, state


def _records_gradients(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a graph through any of `tensors` (the differentiable inputs; None = absent)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _chunked_prefill(inputs: LinearAttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan (`prefix_linear_attention_chunked`) on validated inputs with rows and tokens.

    The key masks and the compact initial state, then the scan: eagerly without autograd the in-place scan with the
    gate inside (`chunked_scan.scan_in_place`); with autograd or under torch.compile the custom op
    `chunked_scan_autograd.scan` (the same scan, an explicit backward, one opaque node in a compiled graph) and the
    gate outside. The state goes back to the full layout.
    """
    q, k, v, k_enc, v_enc, initial_state, gate = inputs.differentiable
    log_decay, eps, chunk_size = inputs.log_decay, inputs.eps, inputs.chunk_size
    batch_size, seq_len, num_heads, feature_dim = q.shape
    value_dim, dtype = v.shape[-1], _compute_dtype(q)
    raw, decoder_keys, encoder_keys = inputs.key_masks()
    taylor = CompactTaylor(feature_dim, q.device)
    residual = None  # the antisymmetric part of the initial state, which the compact state cannot hold
    if initial_state is None:
        state = q.new_zeros(batch_size, num_heads, taylor.num_features, value_dim + 1, dtype=dtype)
    else:
        state = taylor.compress(initial_state.to(dtype))  # (B, H, F', V + 1)
        residual = initial_state.to(dtype) - taylor.expand(state)  # (B, H, F, V + 1)
    decay = None if log_decay is None else log_decay.to(dtype)
    if torch.compiler.is_compiling() or _records_gradients(*inputs.differentiable):
        output, state, _ = scan(q, k, v, k_enc, v_enc, state, raw, decoder_keys, encoder_keys, decay, chunk_size, eps)
        if gate is not None:
            output = output * gate[..., None].to(dtype)
    else:
        output, state = scan_in_place(
            state, q, k, v, k_enc, v_enc, raw=raw, decoder_keys=decoder_keys, encoder_keys=encoder_keys, gate=gate,
            decay=decay, taylor=taylor, chunk_size=chunk_size, eps=eps,
        )
    return output.to(v.dtype), full_state(state, residual, taylor, decay, seq_len)


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-12,
    in_place: bool = False,
    implementation: str | KernelChoice = "chunked",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step from the recurrent state (the same for prefix and causal linear attention).

    Args:
        q, k: `(B, H, K)` query and key of the new token.
        v: `(B, H, V)` its value.
        state: `(B, H, F, V + 1)` fp32 state after the previous tokens.
        log_decay: `(H,)` log gamma of the Based decay, or None.
        gate: `(B, H)` numerator gate of the Based decay variant, or None.
        in_place: update `state` itself and return it, instead of a new tensor. Only taken where it is safe: a
            contiguous state, no autograd graph through the step, not a state made under `torch.inference_mode`
            when the step runs outside it, and not under torch.compile (otherwise the step is functional). The model's
            decode uses it: the cache owns its state, and allocating a fresh `(B, H, F, V + 1)` tensor per layer and
            token costs more than the update itself.
        implementation: a name or a `KernelChoice`, as for the prefill. Where it chooses "triton" (a CUDA state,
            under "auto") and the step runs in place, the fused kernel of `jrt_kernels` takes it: feature map, state
            update and readout in one launch instead of about 25 ops (the step at slots, each row its own slot); a
            kernel that fails warns once and the PyTorch step runs, as for the prefill.

    Returns:
        `(output (B, H, V) in v.dtype, new state (B, H, F, V + 1))`.

    The update `S += phi(k) [v, 1]^T` is one rank-1 `baddbmm` per head and the read `phi(q)^T S` one `bmm` (B = 1,
    H = 16, K = 16, V = 64, one CPU thread: 0.18 ms functional, 0.10 ms in place; the elementwise update with an
    einsum read took 0.32 ms). There is no encoder here: the prefill folded it into `state`. The arguments are
    checked by the same `validate_linear_attention_inputs` as the prefill (as one token, T = 1).
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"q, k and v of a decode step must be (B, H, K) / (B, H, V); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}."
        )
    validate_linear_attention_inputs(
        q[:, None], k[:, None], v[:, None], initial_state=state, log_decay=log_decay,
        gate=None if gate is None else gate[:, None],
    )
    batch_size, num_heads, _ = q.shape
    value_dim, num_features, dtype = v.shape[-1], state.shape[-2], state.dtype
    rows = batch_size * num_heads
    in_place = (
        in_place and not torch.compiler.is_compiling()  # traced: functional (inductor fuses it; no input mutation)
        and state.is_contiguous() and not _records_gradients(q, k, v, state, gate)
        and (torch.is_inference_mode_enabled() or not state.is_inference())  # such a tensor is read-only outside it
    )
    choice = KernelChoice.of(implementation)
    if in_place and choice.linear_attention(q.device) == "triton":
        kernel = functools.partial(  # no slots: row b's state is state[b]
            choice.kernels().linear_attention_decode_triton, q, k, v, state, log_decay=log_decay, gate=gate, eps=eps,
        )
        step = functools.partial(_step_in_place, q, k, v, state, log_decay, gate, eps)
        return choice.run(LINEAR_ATTENTION, kernel, step), state
    if in_place:
        return _step_in_place(q, k, v, state, log_decay, gate, eps), state
    phi_q, phi_k, value_and_one = _step_operands(q, k, v, dtype)
    phi_q, phi_k = phi_q.view(rows, 1, num_features), phi_k.view(rows, num_features, 1)
    value_and_one = value_and_one.view(rows, 1, value_dim + 1)
    if log_decay is not None:  # the numerator columns decay by gamma per token, the denominator's never
        gamma = torch.exp(log_decay.to(dtype))[None, :, None, None]
        state = torch.cat([state[..., :value_dim] * gamma, state[..., value_dim:]], dim=-1)
    state = torch.baddbmm(state.reshape(rows, num_features, value_dim + 1), phi_k, value_and_one)
    state = state.view(batch_size, num_heads, num_features, value_dim + 1)
    return _read_state(phi_q, state, gate, eps).to(v.dtype), state


def _step_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every decode step reads of the new token, in the state's `dtype`: phi(q), phi(k) `(B, H, F)` and
    [v, 1] `(B, H, V + 1)`."""
    value_and_one = torch.cat([v.to(dtype), torch.ones_like(v[..., :1], dtype=dtype)], dim=-1)
    return taylor_feature_map(q.to(dtype)), taylor_feature_map(k.to(dtype)), value_and_one


def _step_in_place(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, log_decay: torch.Tensor | None,
    gate: torch.Tensor | None, eps: float,
) -> torch.Tensor:
    """`linear_attention_step` updating `state` `(B, H, F, V + 1)` (contiguous) where it is; returns the output
    `(B, H, V)` in v's dtype."""
    batch_size, num_heads, _ = q.shape
    value_dim, num_features, dtype = v.shape[-1], state.shape[-2], state.dtype
    rows = batch_size * num_heads
    phi_q, phi_k, value_and_one = _step_operands(q, k, v, dtype)
    phi_q, phi_k = phi_q.view(rows, 1, num_features), phi_k.view(rows, num_features, 1)
    if log_decay is not None:
        state[..., :value_dim].mul_(torch.exp(log_decay.to(dtype))[None, :, None, None])
    state.view(rows, num_features, value_dim + 1).baddbmm_(phi_k, value_and_one.view(rows, 1, value_dim + 1))
    return _read_state(phi_q, state, gate, eps).to(v.dtype)


def _read_state(
    phi_q: torch.Tensor, state: torch.Tensor, gate: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """phi(q) `(B H, 1, F)` against the states `(B, H, F, V + 1)` -> `(B, H, V)` in the state's dtype: the numerator
    (times the Based gate) over the denominator."""
    batch_size, num_heads, num_features, width = state.shape
    readout = torch.bmm(phi_q, state.view(batch_size * num_heads, num_features, width)).view(batch_size, num_heads, -1)
    numerator = readout[..., : width - 1]
    if gate is not None:
        numerator = numerator * gate.to(state.dtype)[..., None]
    return numerator / (readout[..., width - 1 :] + eps)


def _fused_backward_or_none(choice: KernelChoice, *args, **kwargs) -> tuple[torch.Tensor | None, ...] | None:
    """The fused backward's gradients, or None when it fails (warns once) or failed before for this `choice`.

    A failure marks the backward alone failed (`choice.failures`): the fused forward keeps running, and every later
    "auto" training call takes the chunked gradients from this one's backward, so the forwards that activation
    checkpointing recomputes later in the same backward pass take the path of their original forward (non-reentrant
    checkpointing checks the saved tensors).
    """
    if LINEAR_ATTENTION in choice.failures or BACKWARD in choice.failures:
        return None
    try:
        return choice.kernels().prefix_linear_attention_backward_triton(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 -- any compile/launch failure of the optional kernel
        choice.record_failure(BACKWARD, error)
    return None


def _chunked_gradients(
    inputs: LinearAttentionInputs,
    needs_grad: tuple[bool, ...],
    grad_output: torch.Tensor,
    grad_state: torch.Tensor | None,
) -> list[torch.Tensor | None]:
    """Gradients of the chunked path by autograd, recomputing its forward (a failed fused backward).

    Args:
        inputs: the call's inputs.
        needs_grad: one flag per `inputs.differentiable` tensor: whether its gradient is wanted.
        grad_output: `(B, T, H, V)` gradient of the output; grad_state: `(B, H, F, V + 1)` of the state, or None.

    Returns:
        One gradient per `inputs.differentiable` tensor, None where it is not wanted (or absent).
    """
    leaves = [
        None if t is None else t.detach().requires_grad_(needed) for t, needed in zip(inputs.differentiable, needs_grad)
    ]
    with torch.enable_grad():
        output, state = _chunked_prefill(inputs.with_differentiable(*leaves))
    wanted = [t for t, needed in zip(leaves, needs_grad) if needed and t is not None]
    outputs, grads = (output, state), (grad_output, grad_state)
    if grad_state is None:
        outputs, grads = outputs[:1], grads[:1]
    computed = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
    return [next(computed) if needed and t is not None else None for t, needed in zip(leaves, needs_grad)]


class _KernelWithSafeBackward(torch.autograd.Function):
    """The fused forward and backward for "auto" training, whose backward falls back to the chunked path.

    The fused backward compiles at the first backward call, after the forward has returned, so a failure there
    (ptxas error, `OutOfResources`, an unsupported architecture) is out of `KernelChoice.run`'s reach. Here it warns
    once, marks the backward failed in the choice (`_fused_backward_or_none`) and returns the gradients of the
    chunked path, computed by autograd through a recomputed chunked forward. A failed forward propagates out of
    `apply`, to `KernelChoice.run`. Arguments: the choice, the validated inputs, and their differentiable tensors
    again, positional (autograd tracks only what `apply` is given).
    """

    @staticmethod
    def forward(ctx, choice, inputs, *differentiable):
        # and what the fused backward reads instead of recomputing (the state after the encoder, 1 / (den + eps))
        output, state, saved = choice.kernels().prefix_linear_attention_triton(
            *differentiable[:5], **inputs.kernel_options(), return_saved=True
        )
        # Tensors go through `save_for_backward` (activation checkpointing packs them), the rest stays on ctx. The
        # output too: the fused backward reads dy . y from it instead of recomputing the forward's read.
        ranges = (inputs.encoder_start, inputs.encoder_end, inputs.key_mask, inputs.log_decay)
        ctx.save_for_backward(*differentiable, *ranges, output, *saved.values())
        ctx.saved_names = tuple(saved)
        ctx.choice, ctx.inputs = choice, dataclasses.replace(
            inputs, q=None, k=None, v=None, k_enc=None, v_enc=None, encoder_start=None, encoder_end=None,
            key_mask=None, initial_state=None, log_decay=None, gate=None,
        )  # the options alone
        ctx.set_materialize_grads(False)  # no grad_state: the fused backward skips that term
        return output, state

    @staticmethod
    def backward(ctx, grad_output, grad_state):
        saved = ctx.saved_tensors  # once: activation checkpointing unpacks each saved tensor once
        q, k, v, k_enc, v_enc, initial_state, gate, encoder_start, encoder_end, key_mask, log_decay = saved[:11]
        output, backward_inputs = saved[11], dict(zip(ctx.saved_names, saved[12:]))
        inputs = dataclasses.replace(
            ctx.inputs, q=q, k=k, v=v, k_enc=k_enc, v_enc=v_enc, encoder_start=encoder_start, encoder_end=encoder_end,
            key_mask=key_mask, initial_state=initial_state, log_decay=log_decay, gate=gate,
        )
        grad_output = torch.zeros_like(v) if grad_output is None else grad_output
        grads = _fused_backward_or_none(
            ctx.choice, q, k, v, k_enc, v_enc, grad_output, grad_state, encoder_start=encoder_start,
            encoder_end=encoder_end, key_mask=key_mask, strict=inputs.pad_masking == "strict",
            initial_state=initial_state, log_decay=log_decay, gate=gate, eps=inputs.eps, output=output,
            **backward_inputs,
        )
        if grads is None:
            grads = _chunked_gradients(inputs, ctx.needs_input_grad[2:9], grad_output, grad_state)
        return (None, None, *grads)


def prefix_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_enc: torch.Tensor | None = None,
    v_enc: torch.Tensor | None = None,
    *,
    encoder_start: torch.Tensor | int | None = None,
    encoder_end: torch.Tensor | int | None = None,
    key_mask: torch.Tensor | None = None,
    pad_masking: str = "strict",
    initial_state: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-12,
    chunk_size: int = 32,
    implementation: str | KernelChoice = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of prefix (JRT-RNN) or causal (Based, `k_enc = v_enc = None`) linear attention.

    Args:
        q, k: `(B, T, H, K)` decoder queries and keys.
        v: `(B, T, H, V)` decoder values.
        k_enc, v_enc: `(B, M, H, K)` / `(B, M, H, V)` encoder keys and values of the first M <= T tokens, or None.
        encoder_start, encoder_end: `(B,)` int64 (or ints): row b's encoder reads positions
            `encoder_start[b] <= m < encoder_end[b]` of k_enc / v_enc; default `[0, M)` for every row.
        key_mask: `(B, T)` bool, True for real tokens. A masked key outside its row's encoder range never counts;
            one inside it is removed as `pad_masking` says.
        pad_masking: `"strict"` (pads contribute nothing) or `"reference"` (the original code's leak, for the masked
            keys inside the encoder range).
        initial_state: `(B, H, F, V + 1)` state of earlier tokens (continuing from a cache), or None.
        log_decay: `(H,)` log gamma of the Based fixed decay, or None.
        gate: `(B, T, H)` input-dependent numerator gate of the Based decay variant, or None.
        eps: added to the denominator.
        chunk_size: chunk length of the chunked implementation.
        implementation: `"auto"`, `"chunked"`, `"triton"` or `"quadratic"`, or the `KernelChoice` of the caller (a
            model's: it remembers a kernel that failed); see `kernel_choice.py`.

    Returns:
        `(output (B, T, H, V) in v's dtype, final state (B, H, F, V + 1) in fp32)`.
    """
    inputs = validate_linear_attention_inputs(
        q, k, v, k_enc, v_enc, encoder_start=encoder_start, encoder_end=encoder_end, key_mask=key_mask,
        pad_masking=pad_masking, initial_state=initial_state, log_decay=log_decay, gate=gate, eps=eps,
        chunk_size=chunk_size,
    )
    choice = KernelChoice.of(implementation)
    chosen = choice.linear_attention(q.device)
    if inputs.is_empty:
        return _empty_prefill(inputs)  # nothing to scan or launch a kernel for
    # The inputs are validated: the implementations below start at their work (no second check).
    if chosen == "quadratic":
        return _quadratic(inputs)
    run_chunked = functools.partial(_chunked_prefill, inputs)
    if chosen == "triton":
        if choice.forced or not _records_gradients(*inputs.differentiable) or torch.compiler.is_compiling():
            # The op's own autograd (the fused backward, which raises on failure); torch.compile traces the op.
            run_triton = functools.partial(
                choice.kernels().prefix_linear_attention_triton, q, k, v, k_enc, v_enc, **inputs.kernel_options()
            )
        else:  # "auto" training: a failed fused backward falls back to the chunked gradients
            run_triton = functools.partial(_KernelWithSafeBackward.apply, choice, inputs, *inputs.differentiable)
        return choice.run(LINEAR_ATTENTION, run_triton, run_chunked)
    return run_chunked()


def _validate_step_at_slots(q, k, v, pool, slots, log_decay, gate) -> None:
    """The arguments of `linear_attention_step_at_slots` (those of a one-token step, and the pool and its slots)."""
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k must be (B, H, K) and v (B, H, V) with the same B and H; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}."
        )
    batch_size, num_heads, feature_dim = q.shape
    validate_linear_attention_inputs(
        q[:, None], k[:, None], v[:, None], log_decay=log_decay, gate=None if gate is None else gate[:, None]
    )
    state = (num_heads, num_taylor_features(feature_dim), v.shape[-1] + 1)
    if pool.ndim != 4 or tuple(pool.shape[1:]) != state or pool.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"pool must be an fp32 (N, H, F, V + 1) = (N, {', '.join(map(str, state))}) tensor of states; got "
            f"{tuple(pool.shape)} {pool.dtype}."
        )
    if slots.shape != (batch_size,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be ({batch_size},) int32 / int64; got {tuple(slots.shape)} {slots.dtype}.")


def _read_at_slots(phi_q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """phi(q) `(B, H, F)` read against the states `pool[slots]` `(B, H, F, V + 1)` -> `(B, H, V + 1)`, without copying
    them out of the pool.

    The read is one weighted `embedding_bag` (mode "sum") over the pool seen as rows of V + 1 values: row (slot, h, f)
    weighted by phi(q)[b, h, f], one bag per (b, h). It reads each of the B states once (a gather and a `bmm` read
    them twice and write a copy). A pool whose strides are not whole rows (a serving engine may pad its pages to
    another size) is gathered instead."""
    batch_size, num_heads, num_features = phi_q.shape
    width = pool.shape[-1]
    strides = pool.stride()
    if strides[-1] != 1 or any(stride % width for stride in strides[:-1]):
        state = pool.index_select(0, slots).reshape(batch_size * num_heads, num_features, width)
        return torch.bmm(phi_q.reshape(batch_size * num_heads, 1, num_features), state).view(batch_size, num_heads, width)
    step_slot, step_head, step_feature = (stride // width for stride in strides[:-1])
    num_rows = (pool.shape[0] - 1) * step_slot + (num_heads - 1) * step_head + (num_features - 1) * step_feature + 1
    rows = pool.as_strided((num_rows, width), (width, 1))  # the pool's storage from its first element, row by row
    heads = torch.arange(num_heads, device=pool.device) * step_head
    features = torch.arange(num_features, device=pool.device) * step_feature
    index = slots.long()[:, None, None] * step_slot + heads[None, :, None] + features[None, None, :]  # (B, H, F)
    offsets = torch.arange(0, batch_size * num_heads * num_features, num_features, device=pool.device)
    readout = torch.nn.functional.embedding_bag(
        index.view(-1), rows, offsets, mode="sum", per_sample_weights=phi_q.reshape(-1)
    )  # (B H, V + 1)
    return readout.view(batch_size, num_heads, width)


def _step_in_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    log_decay: torch.Tensor | None,
    gate: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """`linear_attention_step` on the states at `slots`, updated where they live: the decay is an `index_reduce_`
    ("prod") of the numerator columns at the slots, the update an `index_add_` of phi(k) [v, 1] there (the same
    products and sums as the step on a gathered copy, so the states are bit for bit the same), then the read
    (`_read_at_slots`). A fixed sequence of tensor ops over the B rows, with no host read (it traces into one graph
    and can be captured in a CUDA graph). Arguments as `linear_attention_step_at_slots`; returns `(B, H, V)`."""
    batch_size, num_heads, _ = q.shape
    value_dim, num_features, dtype = v.shape[-1], pool.shape[-2], pool.dtype
    slots = slots.long()
    phi_q, phi_k, value_and_one = _step_operands(q, k, v, dtype)  # (B, H, F), (B, H, F), (B, H, V + 1)
    if log_decay is not None:  # the numerator columns decay by gamma per token, the denominator's never
        gamma = torch.exp(log_decay.to(dtype))[:, None].expand(num_heads, value_dim)
        factor = torch.cat([gamma, gamma.new_ones(num_heads, 1)], dim=-1)  # (H, V + 1)
        factor = factor[None, :, None, :].expand(batch_size, num_heads, num_features, value_dim + 1)
        if torch.compiler.is_compiling():  # dynamo cannot trace a warnings filter
            pool.index_reduce_(0, slots, factor, "prod")
        else:
            with warnings.catch_warnings():  # "index_reduce() is in beta"; its "prod" is an exact multiply
                warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
                pool.index_reduce_(0, slots, factor, "prod")
    pool.index_add_(0, slots, phi_k[..., None] * value_and_one[..., None, :])  # (B, H, F, V + 1) rank-1 updates
    readout = _read_at_slots(phi_q, pool, slots)  # (B, H, V + 1)
    numerator = readout[..., :value_dim]
    if gate is not None:
        numerator = numerator * gate.to(dtype)[..., None]
    return (numerator / (readout[..., value_dim:] + eps)).to(v.dtype)


def linear_attention_step_at_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-12,
    implementation: str | KernelChoice = "auto",
) -> torch.Tensor:
    """One decode step for B rows whose states live in a pool at their slots (a serving engine's state cache),
    updated there: `linear_attention_step` on `pool[slots]` (the same states; the read sums in another order).

    Args:
        q, k: `(B, H, K)`; v: `(B, H, V)`; log_decay, gate, eps: as `linear_attention_step`.
        pool: `(N, H, F, V + 1)` fp32 states.
        slots: `(B,)` distinct integer slots of the B rows in `pool`.
        implementation: a name or a `KernelChoice`, as for the prefill. "triton" is the fused step of
            `jrt_kernels`, which reads and writes each state once, at its slot, in one launch; the others run the
            PyTorch step at the slots (`_step_in_pool`: `index_add_` of the update and a weighted `embedding_bag`
            read, no gathered copy and no write-back; 2-3x faster than gathering on CPU at 16 requests). Under
            "auto" a kernel that fails to compile or launch warns once and the PyTorch step runs, as for the
            prefill.

    Raises:
        ValueError: q, k, v, pool, slots, log_decay or gate of the wrong shape or dtype (what was expected).

    Returns:
        `(B, H, V)` output in v's dtype.
    """
    _validate_step_at_slots(q, k, v, pool, slots, log_decay, gate)

    def run_pytorch() -> torch.Tensor:
        return _step_in_pool(q, k, v, pool, slots, log_decay, gate, eps)

    choice = KernelChoice.of(implementation)
    if choice.linear_attention(q.device) != "triton":  # the step has one PyTorch form
        return run_pytorch()
    kernel = functools.partial(
        choice.kernels().linear_attention_decode_triton, q, k, v, pool, slots, log_decay=log_decay, gate=gate, eps=eps
    )
    return choice.run(LINEAR_ATTENTION, kernel, run_pytorch)


__all__ = [
    "fixed_log_decay",
    "linear_attention_step",
    "linear_attention_step_at_slots",
    "num_taylor_features",
    "prefix_linear_attention",
    "prefix_linear_attention_chunked",
    "prefix_linear_attention_quadratic",
    "taylor_feature_map",
    "validate_linear_attention_inputs",
]
