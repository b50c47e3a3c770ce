"""`JRTLM`: lm-evaluation-harness's HF model (`HFLM`) with leak-free prefix scoring for JRT-RNN and Based.

lm-eval's stock `hf` model calls `model(input_ids)` on loglikelihood batches right-padded with id 0: for a JRT-RNN
checkpoint the non-causal prefix (the first `prefix_length` positions) then covers the continuation being scored
and the padding, so scores depend on the continuation itself and on the batch. `JRTLM` keeps everything of `HFLM`
and replaces only the forward of a loglikelihood batch:

    row (right-padded by HFLM):   [ context c0..c(C-1) | continuation x0..x(N-2) | pad ... ]
    attention_mask:                 1 ...                 1 ...                    0 ...
    prompt_lengths (per row):       C          (no fill: the encoder reads min(C, config.prefix_length) tokens)

so the encoder reads the context only, and the logits of the scored positions (>= C - 1) are exactly those of the
row evaluated alone with the same prefix. Causal models (Based, any other `AutoModelForCausalLM`) are scored exactly
as by `HFLM`, logits cache included. Scoring modes, generation and bf16: docs/evaluation.md, "Evaluate with lm-eval".
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import modeling_jrt  # noqa: F401  (registers model_type "jrt_rnn" with the Auto classes)

from . import SCORING_MODES  # (defined in __init__, without torch, for `jrt lm-eval`'s early checks)

REFERENCE_MAX_LENGTH = 2048
"""The model window (`max_length`) of JRT-RNN / Based checkpoints when none is given: the reference harness's."""


@register_model("jrt")
class JRTLM(HFLM):
    """lm-eval model `jrt`: `HFLM` whose loglikelihood rows use their context as the JRT prefix.

    Takes every `HFLM` argument (`pretrained`, `tokenizer`, `dtype`, `device`, `batch_size`, ...) plus:

    Args:
        scoring: `"leak_free"` (default; see the module docstring), or `"reference"`, the original harness's, for
            comparison with published numbers: each row (context + continuation, its last token dropped) shorter
            than `prefix_length - 1` is left-filled to that length with `config.prefix_pad_token_id` (masked as
            `config.prefix_pad_masking` says) and the encoder reads the whole filled row. **It leaks**: a
            continuation token inside the prefix is read before it is scored (scores are too high). Rows are scored
            one at a time in this mode.
        prefix_strategy: Overrides the model's `prefix_strategy` in `generate_until` (`"pad"`, `"repeat"`,
            `"none"`).
        max_length: lm-eval's model window (prompts are left-truncated to it); default 2048 for JRT-RNN / Based,
            the reference's (JRT-RNN has no position limit), HFLM's rule for other models.

    `logits_cache` is always off for JRT-RNN: HFLM's cache shares one forward between requests whose
    context + continuation tokens agree, but with a prefix their logits also depend on where the context ends.
    """

    def __init__(self, pretrained: Any, *, scoring: str = "leak_free", prefix_strategy: str | None = None,
                 **kwargs: Any) -> None:
        if scoring not in SCORING_MODES:
            raise ValueError(f"`scoring` must be one of {', '.join(SCORING_MODES)}, got {scoring!r}.")
        # `jrt` loads causal LMs only (AutoModelForCausalLM): saying so skips HFLM's guess from transformers'
        # registries, which warns "HF model type is neither marked as CausalLM or Seq2SeqLM" for jrt_rnn.
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained, **kwargs)
        config = self.model.config
        self.scoring = scoring
        self.prefix_strategy = prefix_strategy
        self.is_prefix_model = getattr(config, "linear_attention_type", None) == "prefix"
        if self.is_prefix_model:
            self.logits_cache = False
        if self._max_length is None and getattr(config, "model_type", None) == "jrt_rnn":
            # No position limit: use the reference's window rather than the tokenizer's (GPT-2 says 1024).
            self._max_length = REFERENCE_MAX_LENGTH
        # (input tokens, context length within them) of the rows HFLM passes to `_model_call`, in its order.
        self._pending_rows: deque[tuple[tuple[int, ...], int]] = deque()

    @property
    def eot_token_id(self) -> int | None:
        """HFLM's end-of-text id, the tokenizer's eos; for a tokenizer without one, the model's eos, else the pad token
        (HFLM's `generate_until` decodes it as a stop string and fails on None)."""
        for candidate in (self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id,
                          self.tokenizer.pad_token_id):
            if isinstance(candidate, list):
                candidate = candidate[0] if candidate else None
            if candidate is not None:
                return candidate
        return None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's loop, told where each row's context ends.

        HFLM sorts the requests by `(-len(context + continuation), tokens)` (a stable sort, no grouping while the
        logits cache is off) and cuts the sorted list into batches, so the rows reach `_model_call` in that order.
        The same order is queued here with each row's input tokens and context length; `_model_call` checks every
        row against its queue entry.
        """
        if not self.is_prefix_model:  # causal: the right padding cannot reach the scored positions
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        expected = []
        for _, context, continuation in sorted(requests, key=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2]))):
            tokens = (context + continuation)[-(self.max_length + 1) :][:-1]
            expected.append((tuple(tokens), max(len(tokens) - len(continuation) + 1, 0)))
        self._pending_rows = deque(expected)
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._pending_rows = deque()

    def _detect_batch_size(self, requests=None, pos: int = 0):
        """HFLM's probe of the largest batch (`batch_size=auto`), with the queued rows set aside while it runs."""
        pending, self._pending_rows = self._pending_rows, deque()
        try:
            return super()._detect_batch_size(requests, pos)
        finally:
            self._pending_rows = pending

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits `(B, T, vocab)` of a right-padded batch `inps` `(B, T)` (padding id 0)."""
        if attn_mask is not None or labels is not None or not self._pending_rows:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)  # batch-size probe, seq2seq
        rows = [self._pending_rows.popleft() for _ in range(inps.shape[0])]
        for index, (tokens, _) in enumerate(rows):
            length = len(tokens)
            matches = inps.shape[1] >= length and inps[index, :length].tolist() == list(tokens)
            if not matches or bool(inps[index, length:].any()):
                raise RuntimeError("JRTLM: a loglikelihood row does not match the request order expected from HFLM; "
                                   "this lm-eval version batches differently than 0.4.13.")
        lengths = torch.tensor([len(tokens) for tokens, _ in rows], device=inps.device)  # (B,)
        autocast = torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                  enabled=self.mixed_precision_dtype is not None)
        with torch.no_grad(), autocast:
            if self.scoring == "reference":
                return self._reference_logits(inps, lengths)
            # Leak-free, one forward: row b's prompt is its context, so its encoder reads the first
            # min(context_b, prefix_length) tokens, never the continuation it scores; the padding is masked.
            attention_mask = (torch.arange(inps.shape[1], device=inps.device) < lengths[:, None]).long()  # (B, T)
            prompt_lengths = torch.tensor([context for _, context in rows], dtype=torch.long, device=inps.device)
            return self.model(inps, attention_mask=attention_mask, prompt_lengths=prompt_lengths,
                              prefix_strategy="none").logits

    def _reference_logits(self, inps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The reference harness's logits `(B, T, vocab)` (`scoring="reference"`), one row at a time: a row of L
        input tokens is left-filled to `prefix_length - 1` tokens with the prefix pad token."""
        config = self.model.config
        logits = None
        for index, length in enumerate(lengths.tolist()):
            row = inps[index : index + 1, :length]  # (1, L)
            if length >= config.prefix_length - 1:  # long enough: not filled, the encoder reads its prefix
                row_logits = self.model(row, prefix_strategy="none").logits
            else:  # the model fills the row to prefix_length - 1 with its pad token and returns the row's logits
                row_logits = self.model(row, prefix_length=config.prefix_length - 1, prefix_strategy="pad").logits
            if logits is None:
                logits = row_logits.new_zeros(inps.shape[0], inps.shape[1], row_logits.shape[-1])
            logits[index, :length] = row_logits[0]
        return logits

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """HFLM's generation (greedy unless the task says otherwise), with `prefix_strategy=` for JRT-RNN."""
        if self.is_prefix_model and self.prefix_strategy is not None:
            generation_kwargs["prefix_strategy"] = self.prefix_strategy
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


__all__ = ["JRTLM", "SCORING_MODES"]
