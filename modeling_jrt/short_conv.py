"""The causal depthwise convolution of the gated short-convolution mixer (`JRTRNNShortConv`)."""

from __future__ import annotations

import torch


def causal_depthwise_conv(inputs: torch.Tensor, history: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution in the `(B, t, D)` layout, as K shifted multiply-adds along the time axis.

        out[:, i] = sum_k weight[:, 0, k] * x[i - (K - 1) + k]     x = [history, inputs], zeros before the history

    equal to `F.conv1d(F.pad(x.transpose(1, 2), (K - 1, 0)), weight, groups=D)` on the positions of `inputs`, without
    the transposed copies.

    inputs `(B, t, D)` (may be a strided view); history `(B, h, D)`, h <= K - 1, the inputs just before them, or
    None (zeros); weight `(D, 1, K)` the depthwise `nn.Conv1d` weight -> `(B, t, D)`, a new contiguous tensor.
    """
    kernel_size = weight.shape[-1]
    taps = weight[:, 0].t().contiguous().to(inputs.dtype)  # (K, D)
    seq_len = inputs.shape[1]
    past = 0 if history is None else history.shape[1]
    output = inputs * taps[kernel_size - 1]
    for k in range(kernel_size - 1):
        shift = kernel_size - 1 - k  # tap k reads the input `shift` positions back
        if seq_len > shift:
            output[:, shift:].addcmul_(inputs[:, : seq_len - shift], taps[k])
        low, high = max(shift - past, 0), min(shift, seq_len)  # output rows that read the history with this tap
        if high > low:
            output[:, low:high].addcmul_(history[:, past + low - shift : past + high - shift], taps[k])
    return output


__all__ = ["causal_depthwise_conv"]
