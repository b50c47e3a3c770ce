"""The O(1) decode step of linear attention from its recurrent state (the same for prefix and causal linear attention):
functional, in place on a batch's own states, and at the slots of a serving engine's pool of states."""

from __future__ import annotations

import functools
import warnings

import torch

from .feature_map import num_taylor_features, taylor_feature_map
from .kernel_choice import LINEAR_ATTENTION, KernelChoice
from .linear_attention_inputs import records_gradients, validate_linear_attention_inputs


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
    """One decode step from the recurrent state (the same for prefix and causal linear attention): the update
    `S += phi(k) [v, 1]^T` (one rank-1 `baddbmm` per head), then the read `phi(q)^T S`.

    Args:
        q, k: `(B, H, K)` query and key of the new token; v: `(B, H, V)` its value.
        state: `(B, H, F, V + 1)` fp32 state after the previous tokens (the prefill folded the encoder into it).
        log_decay: `(H,)` log gamma of the Based decay, or None.
        gate: `(B, H)` numerator gate of the Based decay variant, or None.
        in_place: update `state` itself and return it, where it is safe: a contiguous state, no autograd graph, not
            an inference tensor outside inference mode, not under torch.compile (otherwise the step is functional).
        implementation: a name or a `KernelChoice`, as for the prefill. "triton" runs in place as the fused kernel
            of `jrt_kernels` (one launch instead of about 25 ops).

    Returns:
        `(output (B, H, V) in v.dtype, new state (B, H, F, V + 1))`.
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k and v of a decode step must be (B, H, K) / (B, H, V); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
    validate_linear_attention_inputs(
        q[:, None], k[:, None], v[:, None], initial_state=state, log_decay=log_decay,
        gate=None if gate is None else gate[:, None],
    )
    in_place = (
        in_place and not torch.compiler.is_compiling()  # traced: functional (inductor fuses it; no input mutation)
        and state.is_contiguous() and not records_gradients(q, k, v, state, gate)
        and (torch.is_inference_mode_enabled() or not state.is_inference())  # such a tensor is read-only outside it
    )
    choice = KernelChoice.of(implementation)
    if in_place and choice.linear_attention(q.device) == "triton":
        kernel = functools.partial(  # no slots: row b's state is state[b]
            choice.kernels().linear_attention_decode_triton, q, k, v, state, log_decay=log_decay, gate=gate, eps=eps,
        )
        step = functools.partial(_step, q, k, v, state, log_decay, gate, eps, in_place=True)
        return choice.run(LINEAR_ATTENTION, kernel, lambda: step()[0]), state
    return _step(q, k, v, state, log_decay, gate, eps, in_place=in_place)


def _step_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """phi(q), phi(k) `(B, H, F)` and [v, 1] `(B, H, V + 1)` of the new token, in the state's `dtype`."""
    value_and_one = torch.cat([v.to(dtype), torch.ones_like(v[..., :1], dtype=dtype)], dim=-1)
    return taylor_feature_map(q.to(dtype)), taylor_feature_map(k.to(dtype)), value_and_one


def _step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, log_decay: torch.Tensor | None,
    gate: torch.Tensor | None, eps: float, *, in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch `linear_attention_step`: `(output (B, H, V) in v's dtype, state)`, the state `(B, H, F, V + 1)`
    updated where it is when `in_place` (contiguous), else a new tensor."""
    batch_size, num_heads, _ = q.shape
    value_dim, num_features, dtype = v.shape[-1], state.shape[-2], state.dtype
    rows = batch_size * num_heads
    phi_q, phi_k, value_and_one = _step_operands(q, k, v, dtype)
    phi_q, phi_k = phi_q.view(rows, 1, num_features), phi_k.view(rows, num_features, 1)
    value_and_one = value_and_one.view(rows, 1, value_dim + 1)
    # The numerator columns decay by gamma per token, the denominator's never.
    gamma = None if log_decay is None else torch.exp(log_decay.to(dtype))[None, :, None, None]
    if in_place:
        if gamma is not None:
            state[..., :value_dim].mul_(gamma)
        state.view(rows, num_features, value_dim + 1).baddbmm_(phi_k, value_and_one)
    else:
        if gamma is not None:
            state = torch.cat([state[..., :value_dim] * gamma, state[..., value_dim:]], dim=-1)
        state = torch.baddbmm(state.reshape(rows, num_features, value_dim + 1), phi_k, value_and_one)
        state = state.view(batch_size, num_heads, num_features, value_dim + 1)
    readout = torch.bmm(phi_q, state.view(rows, num_features, value_dim + 1)).view(batch_size, num_heads, -1)
    return _normalise(readout, gate, eps).to(v.dtype), state


def _normalise(readout: torch.Tensor, gate: torch.Tensor | None, eps: float) -> torch.Tensor:
    """phi(q)'s read of the state `(B, H, V + 1)` -> `(B, H, V)`: the (gated) numerator over the denominator."""
    numerator = readout[..., :-1]
    if gate is not None:
        numerator = numerator * gate.to(readout.dtype)[..., None]
    return numerator / (readout[..., -1:] + eps)


def _read_at_slots(phi_q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """phi(q) `(B, H, F)` read against the states `pool[slots]` `(B, H, F, V + 1)` -> `(B, H, V + 1)`, without copying
    them out: one weighted `embedding_bag` ("sum") over the pool seen as rows of V + 1 values, one bag per (b, h). A
    pool whose strides are not whole rows (padded pages) is gathered instead."""
    batch_size, num_heads, num_features = phi_q.shape
    width = pool.shape[-1]
    strides = pool.stride()
    if strides[-1] != 1 or any(stride % width for stride in strides[:-1]):
        state = pool.index_select(0, slots).reshape(batch_size * num_heads, num_features, width)
        readout = torch.bmm(phi_q.reshape(batch_size * num_heads, 1, num_features), state)
        return readout.view(batch_size, num_heads, width)
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
    log_decay: torch.Tensor | None, gate: torch.Tensor | None, eps: float,
) -> torch.Tensor:
    """`linear_attention_step` on the states at `slots`, updated where they live: the decay an `index_reduce_`
    ("prod"), the update an `index_add_` (bit for bit the step's states), then `_read_at_slots`. No host read (one
    graph, CUDA-graph capturable). Arguments as `linear_attention_step_at_slots`; returns `(B, H, V)`."""
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
    return _normalise(_read_at_slots(phi_q, pool, slots), gate, eps).to(v.dtype)


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
        implementation: a name or a `KernelChoice`, as for the prefill: "triton" is the fused step of `jrt_kernels`,
            the others the PyTorch step at the slots (`_step_in_pool`).

    Returns `(B, H, V)` in v's dtype; a `ValueError` names an argument of the wrong shape or dtype.
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be (B, H, K) and v (B, H, V) with the same B and H; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}.")
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
    run_pytorch = functools.partial(_step_in_pool, q, k, v, pool, slots, log_decay, gate, eps)
    choice = KernelChoice.of(implementation)
    if choice.linear_attention(q.device) != "triton":  # the step has one PyTorch form
        return run_pytorch()
    kernel = functools.partial(
        choice.kernels().linear_attention_decode_triton, q, k, v, pool, slots, log_decay=log_decay, gate=gate, eps=eps
    )
    return choice.run(LINEAR_ATTENTION, kernel, run_pytorch)


__all__ = ["linear_attention_step", "linear_attention_step_at_slots"]
