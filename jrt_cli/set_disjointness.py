"""Set disjointness (JRT paper, Algorithm 1): the task of the `jrt demo` models, and their token vocabulary.

Two sets share exactly one token; after the answer separator the model must name it. This module holds what the
demo needs at run time (the generator, the token map and the tokenizer built from it); the training harness that
produced the models lives outside the package, in the repository's `experiments/synthetic/`.

A batch holds `input_ids` and `labels` of the same shape `(B, T)`, where `labels[b, t]` is the token the model must
predict *at* position t (not shifted: the label sits on the last token the model has read), and -100 elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from modeling_jrt.loss import IGNORE_INDEX

# Set disjointness specials (JRT paper, Algorithm 1).
SD_MASK, SD_BOS, SD_SET_SEP, SD_ANSWER_SEP = 0, 1, 2, 3
SD_NUM_SPECIAL = 4


@dataclass
class SyntheticBatch:
    """A batch of one synthetic task: `(B, T)` int64 `input_ids` and `labels` (see the module docstring), and
    `prefix_length`, the tokens of the prompt (what a JRT-RNN encoder reads), equal for every row."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    prefix_length: int


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {value}.")


def set_disjointness(
    rng: np.random.RandomState, num_examples: int, short_length: int, long_length: int, vocab_size: int = 68,
    repeat: int = 1,
) -> SyntheticBatch:
    """Set disjointness, Algorithm 1 of the JRT paper: two sets with exactly one common token.

    Per example: the ids `[4, vocab_size)` are permuted; the first `vocab_size // 2` ids of the permutation are the
    pool of set A (`short_length` ids), the rest the pool of set B (`long_length` ids); then a random B slot is
    overwritten with a random element `t` of A. The sequence is `[1] A [2] B [3] t`; the input drops `t` and the
    only label is `t` at the final `3`. With `repeat = 2` (JRT-Prompt) the input is `[1] A [2] B [1] A [2] B [3]`.

    `short_length` is `|A|` (the set that comes first; despite the name it may be the longer one), `long_length`
    `|B|`; ids below 4 are specials (0 mask, 1 BOS, 2 set separator, 3 answer separator); `rng` advances in place.
    Returns `num_examples` rows of `T = repeat * (|A| + |B| + 2) + 1` tokens, `prefix_length = T`.
    """
    for name, value in (("num_examples", num_examples), ("short_length", short_length),
                        ("long_length", long_length), ("repeat", repeat)):
        _check_positive(name, value)
    first_pool, second_pool = vocab_size // 2, vocab_size - SD_NUM_SPECIAL - vocab_size // 2
    if short_length > first_pool or long_length > second_pool:
        raise ValueError(f"Sets of sizes ({short_length}, {long_length}) do not fit "
                         f"the pools of vocab_size={vocab_size} ({first_pool} and "
                         f"{second_pool} ids): use a larger vocab_size or smaller sets.")
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


def sd_tokenizer(token_map: dict):
    """A `PreTrainedTokenizerFast` for a token map from `sd_token_map`: one word per token, split on whitespace, so
    `decode(encode(text)) == text` for text as `render_tokens` prints it. No special token is added on encoding
    (prompts start with an explicit `<bos>`, as the models were trained). `<mask>` (id 0, unused by the task) is the
    pad token and also the unknown one: the vocabulary has no spare id, and a word outside it (the prose of a recall
    document) must encode rather than fail. `<bos>` is also EOS (as GPT-2's `<|endoftext|>` is both): one example ends
    where the next begins, and tools that append an EOS (TRL's `SFTTrainer`) need one. The saved files load with
    `AutoTokenizer` without this package.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = token_map["specials"]
    items = token_map["items"]
    vocabulary = {specials[str(i)]: i for i in range(items["first_id"])}
    vocabulary.update({items["render"].format(id=i): i for i in range(items["first_id"], items["last_id"] + 1)})
    if len(vocabulary) != token_map["vocab_size"]:
        raise ValueError(f"The token map names {len(vocabulary)} distinct tokens but has vocab_size "
                         f"{token_map['vocab_size']}: every id needs one unique string.")
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=specials[str(SD_MASK)]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos, mask = specials[str(SD_BOS)], specials[str(SD_MASK)]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=bos, pad_token=mask, unk_token=mask, padding_side="left",
        model_input_names=["input_ids", "attention_mask"],
    )
