"""Seeded generators of the synthetic recall tasks (SYNTHETICS.md §1-§3).

Every generator returns a `SyntheticBatch`: `input_ids` and `labels` of the same shape `(B, T)`, where
`labels[b, t]` is the token the model must predict *at* position t (not shifted: the label sits on the last token
the model has read, e.g. on the final answer separator of set disjointness or on a query key of MQAR), and -100
elsewhere. `prefix_length` is the length of the "prompt" a JRT-RNN encoder reads non-causally.

Randomness comes from a `numpy.random.RandomState` passed in by the caller, so one seed fixes a whole data stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100

# Set disjointness specials (JRT paper, Algorithm 1).
SD_MASK, SD_BOS, SD_SET_SEP, SD_ANSWER_SEP = 0, 1, 2, 3
SD_NUM_SPECIAL = 4

# Prefix-query MQAR specials (`qmqar`, SYNTHETICS.md §3).
QMQAR_PAD, QMQAR_SEP, QMQAR_QSEP = 0, 1, 2
QMQAR_NUM_SPECIAL = 4
QMQAR_ORDERS = ("CQ", "QC", "CQC")


@dataclass
class SyntheticBatch:
    """A batch of one synthetic task.

    Attributes:
        input_ids: `(B, T)` int64 tokens.
        labels: `(B, T)` int64; the target to predict at each position, `-100` where nothing is predicted.
        prefix_length: tokens of the prompt (what a JRT-RNN encoder reads); equal for every row.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    prefix_length: int


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value}.")


def set_disjointness(
    rng: np.random.RandomState,
    num_examples: int,
    short_length: int,
    long_length: int,
    vocab_size: int = 68,
    repeat: int = 1,
) -> SyntheticBatch:
    """Set disjointness, Algorithm 1 of the JRT paper: two sets with exactly one common token.

    Per example: the ids `[4, vocab_size)` are permuted; the first `vocab_size // 2` ids of the permutation are the
    pool of set A (`short_length` ids), the rest the pool of set B (`long_length` ids); then a random B slot is
    overwritten with a random element `t` of A. The sequence is `[1] A [2] B [3] t`; the input drops `t` and the
    only label is `t` at the final `3`. With `repeat = 2` (JRT-Prompt) the input is `[1] A [2] B [1] A [2] B [3]`.

    Args:
        rng: source of randomness (advanced in place).
        num_examples: rows `B`.
        short_length: `|A|` (the set that comes first, despite the name it may be the longer one).
        long_length: `|B|`.
        vocab_size: `V`; ids below 4 are specials (0 mask, 1 BOS, 2 set separator, 3 answer separator).
        repeat: how many times the `[1] A [2] B` context is given.

    Returns:
        `SyntheticBatch` of `T = repeat * (|A| + |B| + 2) + 1` tokens, `prefix_length = T`.
    """
    for name, value in (("num_examples", num_examples), ("short_length", short_length),
                        ("long_length", long_length), ("repeat", repeat)):
        _check_positive(name, value)
    first_pool, second_pool = vocab_size // 2, vocab_size - SD_NUM_SPECIAL - vocab_size // 2
    if short_length > first_pool or long_length > second_pool:
        raise ValueError(
            f"Sets of sizes ({short_length}, {long_length}) do not fit the pools of vocab_size={vocab_size} "
            f"({first_pool} and {second_pool} ids): use a larger vocab_size or smaller sets."
        )
    all_ids = np.arange(SD_NUM_SPECIAL, vocab_size)
    context_length = short_length + long_length + 2
    length = repeat * context_length + 1
    input_ids = np.empty((num_examples, length), dtype=np.int64)
    labels = np.full((num_examples, length), IGNORE_INDEX, dtype=np.int64)
    for row in range(num_examples):
        permuted = rng.permutation(all_ids)
        first = rng.choice(permuted[: vocab_size // 2], size=short_length, replace=False)
        second = rng.choice(permuted[vocab_size // 2:], size=long_length, replace=False)
        common = first[rng.randint(short_length)]
        second[rng.randint(long_length)] = common
        context = np.concatenate([[SD_BOS], first, [SD_SET_SEP], second])
        input_ids[row] = np.concatenate([np.tile(context, repeat), [SD_ANSWER_SEP]])
        labels[row, -1] = common
    return SyntheticBatch(torch.from_numpy(input_ids), torch.from_numpy(labels), prefix_length=length)


def multiquery_ar(
    rng: np.random.RandomState,
    num_examples: int,
    input_seq_len: int,
    num_kv_pairs: int,
    vocab_size: int = 8192,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    num_passes: int = 1,
) -> SyntheticBatch:
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
        raise ValueError(
            f"`4 * num_kv_pairs` ({4 * num_kv_pairs}) must be <= `input_seq_len` ({input_seq_len}): the query region "
            "needs room for every key at an even offset."
        )
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
    return SyntheticBatch(
        torch.from_numpy(np.ascontiguousarray(input_ids)), torch.from_numpy(np.ascontiguousarray(labels)),
        prefix_length=context.shape[1],
    )


def prefix_query_mqar(
    rng: np.random.RandomState,
    num_examples: int,
    num_kv_pairs: int,
    num_queries: int = 2,
    vocab_size: int = 132,
    order: str = "CQ",
) -> SyntheticBatch:
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
    return SyntheticBatch(
        torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(label_rows)), prefix_length=len(prompt)
    )


def sd_token_map(vocab_size: int) -> dict:
    """JSON-serialisable description of the set-disjointness vocabulary (shipped next to the demo models)."""
    return {
        "task": "set_disjointness",
        "vocab_size": vocab_size,
        "specials": {str(SD_MASK): "<mask>", str(SD_BOS): "<bos>", str(SD_SET_SEP): "|", str(SD_ANSWER_SEP): "?"},
        "items": {"first_id": SD_NUM_SPECIAL, "last_id": vocab_size - 1, "render": "t{id}"},
        "format": "<bos> A | B ?  -> the token common to A and B; JRT-Prompt: <bos> A | B <bos> A | B ?",
    }


def render_tokens(token_ids: list[int] | torch.Tensor, token_map: dict) -> str:
    """Space-separated text of `token_ids` under a token map from `sd_token_map`."""
    specials = token_map["specials"]
    render = token_map["items"]["render"]
    return " ".join(specials.get(str(int(i)), render.format(id=int(i))) for i in token_ids)
