"""Seeded generators of the synthetic recall tasks (docs/synthetics.md, section 1).

Every generator returns a `SyntheticBatch` (labels not shifted, see `jrt_cli.set_disjointness`). Set disjointness,
the task of the `jrt demo` models, lives there (its generator and token map are re-exported here); MQAR and
prefix-query MQAR are harness-only.
Randomness comes from a `numpy.random.RandomState` passed in by the caller, so one seed fixes a whole data stream.
"""

from __future__ import annotations

import numpy as np
import torch
from modeling_jrt.loss import IGNORE_INDEX

from jrt_cli.set_disjointness import (  # noqa: F401  (re-exported)
    SyntheticBatch, _check_positive, render_tokens, sd_token_map, set_disjointness)

# Prefix-query MQAR specials (`qmqar`, docs/synthetics.md section 1.3).
QMQAR_PAD, QMQAR_SEP, QMQAR_QSEP = 0, 1, 2
QMQAR_NUM_SPECIAL = 4
QMQAR_ORDERS = ("CQ", "QC", "CQC")


def multiquery_ar(rng: np.random.RandomState, num_examples: int, input_seq_len: int, num_kv_pairs: int,
                  vocab_size: int = 8192, power_a: float = 0.01, random_non_queries: bool = True,
                  num_passes: int = 1) -> SyntheticBatch:
    """Zoology's multi-query associative recall (MQAR), with an optional JRT-Prompt repetition of the context.

    Context `k1 v1 ... kD vD` (keys from `[1, V/2)`, values from `[V/2, V)`, distinct within an example), repeated
    `num_passes` times, then a query region of `input_seq_len - 2D` tokens in which every key appears once at an
    even offset `2g`, the gaps `g` drawn without replacement with probability proportional to `g**(power_a - 1)`
    (short key-query distances, long tail). The label of each query key is its value. Other query-region tokens
    are 0, or uniform random ids in `[0, V)` when `random_non_queries`.

    Returns:
        `SyntheticBatch` of `T = input_seq_len + (num_passes - 1) * 2D` tokens; `prefix_length` is the length of
        the (repeated) context.
    """
    for name, value in (("num_examples", num_examples), ("input_seq_len", input_seq_len),
                        ("num_kv_pairs", num_kv_pairs), ("num_passes", num_passes)):
        _check_positive(name, value)
    if input_seq_len % 2 != 0:
        raise ValueError(f"`input_seq_len` must be even, got {input_seq_len}.")
    if vocab_size <= input_seq_len:
        raise ValueError(f"`vocab_size` ({vocab_size}) must be larger than `input_seq_len` ({input_seq_len}).")
    if 4 * num_kv_pairs > input_seq_len:
        raise ValueError(f"`4 * num_kv_pairs` ({4 * num_kv_pairs}) must be <= `input_seq_len` ({input_seq_len}): the "
                         "query region needs room for every key at an even offset.")
    context_size = 2 * num_kv_pairs
    keys = np.stack([rng.choice(np.arange(1, vocab_size // 2), num_kv_pairs, replace=False)
                     for _ in range(num_examples)])
    values = np.stack([rng.choice(np.arange(vocab_size // 2, vocab_size), num_kv_pairs, replace=False)
                       for _ in range(num_examples)])
    kvs = np.zeros((num_examples, context_size), dtype=np.int64)
    kvs[:, 0::2] = keys
    kvs[:, 1::2] = values

    space = (input_seq_len - context_size) // 2
    probabilities = power_a * np.arange(1, space + 1) ** (power_a - 1)
    probabilities = probabilities / probabilities.sum()
    gaps = np.stack([rng.choice(space, num_kv_pairs, replace=False, p=probabilities) for _ in range(num_examples)])
    queries = np.zeros((num_examples, input_seq_len - context_size + 1), dtype=np.int64)
    np.put_along_axis(queries, 2 * gaps, keys, axis=1)

    context = np.tile(kvs, (1, num_passes))
    examples = np.concatenate([context, queries], axis=1)
    labels = np.full_like(examples, IGNORE_INDEX)
    np.put_along_axis(labels, 2 * gaps + context.shape[1] + 1, values, axis=1)
    input_ids, labels = examples[:, :-1], labels[:, 1:]
    if random_non_queries:
        query_region = input_ids[:, context.shape[1]:]
        fill = query_region == 0
        query_region[fill] = rng.randint(vocab_size, size=int(fill.sum()))
    return SyntheticBatch(torch.from_numpy(np.ascontiguousarray(input_ids)),
                          torch.from_numpy(np.ascontiguousarray(labels)), prefix_length=context.shape[1])


def prefix_query_mqar(rng: np.random.RandomState, num_examples: int, num_kv_pairs: int, num_queries: int = 2,
                      vocab_size: int = 132, order: str = "CQ") -> SyntheticBatch:
    """Prefix-query MQAR (`qmqar`): the questions are part of the prompt, the answers are decoded after it.

    Ids: 0 pad (unused), 1 `SEP`, 2 `QSEP`, 3 unused; keys are the lower half of `[4, V)`, values the upper half.
    Context `C = k1 v1 ... kD vD`, questions `Q` = `num_queries` distinct context keys. Prompt by `order`:
        "CQ"   C SEP Q QSEP            (context first, the standard prompt)
        "QC"   Q SEP C QSEP            (questions first)
        "CQC"  C SEP Q QSEP C SEP      (JRT-Prompt: the context read twice)
    followed by the decode region `q'1 v'1 ... q'm` (the questions in a new random order, teacher-forced), where
    the label at each `q'` is its value.

    Returns:
        `SyntheticBatch` of `T = prompt + 2m - 1` tokens; `prefix_length` is the prompt length.
    """
    for name, value in (("num_examples", num_examples), ("num_kv_pairs", num_kv_pairs),
                        ("num_queries", num_queries)):
        _check_positive(name, value)
    if order not in QMQAR_ORDERS:
        raise ValueError(f"`order` must be one of {list(QMQAR_ORDERS)}, got {order!r}.")
    half = (vocab_size - QMQAR_NUM_SPECIAL) // 2
    if num_kv_pairs > half:
        raise ValueError(f"`num_kv_pairs` ({num_kv_pairs}) exceeds the {half} keys of vocab_size={vocab_size}.")
    if num_queries > num_kv_pairs:
        raise ValueError(f"`num_queries` ({num_queries}) must be <= `num_kv_pairs` ({num_kv_pairs}).")
    key_ids = np.arange(QMQAR_NUM_SPECIAL, QMQAR_NUM_SPECIAL + half)
    value_ids = np.arange(QMQAR_NUM_SPECIAL + half, QMQAR_NUM_SPECIAL + 2 * half)
    rows, label_rows = [], []
    for _ in range(num_examples):
        keys = rng.choice(key_ids, num_kv_pairs, replace=False)
        values = rng.choice(value_ids, num_kv_pairs, replace=False)
        context = np.stack([keys, values], axis=1).reshape(-1)
        asked = rng.choice(num_kv_pairs, num_queries, replace=False)
        questions = keys[asked]
        if order == "CQ":
            prompt = [context, [QMQAR_SEP], questions, [QMQAR_QSEP]]
        elif order == "QC":
            prompt = [questions, [QMQAR_SEP], context, [QMQAR_QSEP]]
        else:
            prompt = [context, [QMQAR_SEP], questions, [QMQAR_QSEP], context, [QMQAR_SEP]]
        prompt = np.concatenate(prompt)
        answered = rng.permutation(asked)
        decode = np.stack([keys[answered], values[answered]], axis=1).reshape(-1)[:-1]
        decode_labels = np.full_like(decode, IGNORE_INDEX)
        decode_labels[0::2] = values[answered]
        rows.append(np.concatenate([prompt, decode]))
        label_rows.append(np.concatenate([np.full_like(prompt, IGNORE_INDEX), decode_labels]))
    return SyntheticBatch(torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(label_rows)),
                          prefix_length=len(prompt))
