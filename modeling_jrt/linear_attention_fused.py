"""The fused Triton prefill of `jrt_kernels` behind `prefix_linear_attention(..., implementation="triton")` (and
"auto" on a GPU): its launch on validated inputs and, for "auto" training, a backward that falls back to the chunked
path's gradients when the fused backward fails."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .kernel_choice import BACKWARD, LINEAR_ATTENTION, KernelChoice
from .linear_attention_chunk import chunked_prefill
from .linear_attention_inputs import LinearAttentionInputs, records_gradients


def fused_prefill(
    choice: KernelChoice, inputs: LinearAttentionInputs
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The Triton prefill of `inputs`, ready for `KernelChoice.run`: the kernel's own autograd when forced, without
    gradients or under torch.compile; for "auto" training `_KernelWithSafeBackward`."""
    if choice.forced or not records_gradients(*inputs.differentiable) or torch.compiler.is_compiling():
        return functools.partial(
            choice.kernels().prefix_linear_attention_triton, *inputs.differentiable[:5], **inputs.kernel_options()
        )
    return functools.partial(_KernelWithSafeBackward.apply, choice, inputs, *inputs.differentiable)


def _chunked_gradients(
    inputs: LinearAttentionInputs, needs_grad: tuple[bool, ...], grad_output: torch.Tensor,
    grad_state: torch.Tensor | None,
) -> list[torch.Tensor | None]:
    """Gradients of the chunked path by autograd through a recomputed forward (a failed fused backward): one per
    `inputs.differentiable` tensor whose `needs_grad` flag is set, else None. grad_output `(B, T, H, V)`, grad_state
    `(B, H, F, V + 1)` or None."""
    leaves = [
        None if t is None else t.detach().requires_grad_(needed) for t, needed in zip(inputs.differentiable, needs_grad)
    ]
    with torch.enable_grad():
        output, state = chunked_prefill(inputs._replace(**dict(zip(inputs.DIFFERENTIABLE, leaves))))
    wanted = [t for t, needed in zip(leaves, needs_grad) if needed and t is not None]
    outputs, grads = (output, state), (grad_output, grad_state)
    if grad_state is None:
        outputs, grads = outputs[:1], grads[:1]
    computed = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
    return [next(computed) if needed and t is not None else None for t, needed in zip(leaves, needs_grad)]


class _KernelWithSafeBackward(torch.autograd.Function):
    """The fused forward and backward for "auto" training, whose backward falls back to the chunked path.

    The fused backward compiles at the first backward call, out of `KernelChoice.run`'s reach: a failure there
    falls back to `_chunked_gradients`. Arguments: the choice, the validated inputs, and their differentiable tensors
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
        ctx.choice, ctx.pad_masking, ctx.eps, ctx.chunk_size = choice, inputs.pad_masking, inputs.eps, inputs.chunk_size
        ctx.set_materialize_grads(False)  # no grad_state: the fused backward skips that term
        return output, state

    @staticmethod
    def backward(ctx, grad_output, grad_state):
        saved = ctx.saved_tensors  # once: activation checkpointing unpacks each saved tensor once
        q, k, v, k_enc, v_enc, initial_state, gate, encoder_start, encoder_end, key_mask, log_decay = saved[:11]
        output, backward_inputs = saved[11], dict(zip(ctx.saved_names, saved[12:]))
        inputs = LinearAttentionInputs(
            q, k, v, k_enc, v_enc, encoder_start, encoder_end, key_mask, ctx.pad_masking, initial_state, log_decay,
            gate, ctx.eps, ctx.chunk_size,
        )  # validated when the forward ran
        grad_output = torch.zeros_like(v) if grad_output is None else grad_output
        grads, choice = None, ctx.choice
        # Skipped once it failed for this choice; a failure marks the backward alone failed: the fused forward keeps
        # running (so forwards that activation checkpointing recomputes take their original path).
        if LINEAR_ATTENTION not in choice.failures and BACKWARD not in choice.failures:
            try:
                grads = choice.kernels().prefix_linear_attention_backward_triton(
                    q, k, v, k_enc, v_enc, grad_output, grad_state, encoder_start=encoder_start,
                    encoder_end=encoder_end, key_mask=key_mask, strict=inputs.pad_masking == "strict",
                    initial_state=initial_state, log_decay=log_decay, gate=gate, eps=inputs.eps, output=output,
                    **backward_inputs,
                )
            except Exception as error:  # noqa: BLE001 -- any compile/launch failure of the optional kernel
                choice.record_failure(BACKWARD, error)
        if grads is None:
            grads = _chunked_gradients(inputs, ctx.needs_input_grad[2:9], grad_output, grad_state)
        return (None, None, *grads)


__all__ = ["fused_prefill"]
