"""A tiny random checkpoint in the released JRT-RNN format, to try `jrt convert` offline (`jrt convert --example DIR`).

The folder holds what a HazyResearch JRT-RNN Hub repo holds (docs/reference_architecture.md §2): a `config.json` laid
out like JRT-360M-30B's (a GPT2Config dump with the `mixer` / `alt_mixer` / `alt_mixer_2` dicts) and a
`pytorch_model.bin` with the reference key names under `model.` plus the metric counters, at a small size (4 layers:
convolution, prefix linear attention, sliding attention, convolution; hidden 64, 4 heads, GPT-2's vocabulary size
padded to 50264 rows, about 3.5 M parameters, 14 MB). The weights are random: the converted model runs, but says
nothing sensible.

The released repos hold no tokenizer (they use GPT-2's, which needs a download). The example ships one in
`tokenizer/` that fits its vocabulary and runs offline: GPT-2's byte-level alphabet at GPT-2's own ids 0-255 (every
text encodes, byte by byte, as GPT-2 encodes it before merges), `<|endoftext|>` at 50256 (the checkpoint's EOS), and
the ids in between, which stand for GPT-2's merged tokens, as `<unused_N>` (a generated one prints as such).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .source_files import check_example_folder

HIDDEN = 64
HEADS = 4
FEATURE_DIM = 4
N_INNER = 128  # the reference's GatedMlp rounds it up to a multiple of 256
MLP_HIDDEN = 256
VOCAB = 50257
PADDED_VOCAB = 50264  # pad_vocab_size_multiple = 8
PREFIX_LENGTH = 16  # enc_length (1024 in the released models)
WINDOW_SIZE = 16  # the reference window: W // 2 previous tokens plus self
LAYERS = 4
EOS = "<|endoftext|>"
LINEAR_ATTENTION_LAYERS = [1]
SLIDING_ATTENTION_LAYERS = [2]


def example_config() -> dict:
    """The reference `config.json` of the example (JRT-360M-30B's layout at a tiny size)."""
    return {
        "vocab_size": VOCAB, "n_positions": 0, "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS,
        "n_inner": N_INNER, "activation_function": "swiglu", "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0,
        "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "bos_token_id": 50256, "eos_token_id": 50256,
        "tie_word_embeddings": True, "model_type": "gpt2", "rms_norm": True, "residual_in_fp32": True,
        "fused_mlp": False, "fused_dropout_add_ln": True, "fused_bias_fc": True, "pad_vocab_size_multiple": 8,
        "special_initializer": True, "rotary_emb_fraction": 1, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
        "use_flash_attn": True, "alt_mixer_layers": LINEAR_ATTENTION_LAYERS,
        "alt_mixer_2_layers": SLIDING_ATTENTION_LAYERS,
        "mixer": {"l_max": 2048, "_target_": "based.models.mixers.convolution.BaseConv", "use_bias": True,
                  "expand_proj": 4, "kernel_sizes": 3},
        "alt_mixer": {
            "_target_": "based.models.mixers.prefix_linear_attention.PrefixLinearAttention", "l_max": 2048,
            "feature_dim": FEATURE_DIM, "feature_name": "taylor_exp", "num_heads": HEADS,
            "num_key_value_heads": HEADS, "enc_length": PREFIX_LENGTH, "dec_length": PREFIX_LENGTH,
            "implementation": "fla_parallel", "use_mask": True,
        },
        "alt_mixer_2": {"_target_": "based.models.mixers.slide_attention.SlidingAttention",
                        "window_size": WINDOW_SIZE, "num_heads": HEADS, "causal": True, "use_mask": True},
        "enc_length": PREFIX_LENGTH, "dec_length": PREFIX_LENGTH, "data_type": "mixed",
    }


def example_state_dict(*, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the reference key names and shapes (docs/reference_architecture.md §2.1)."""
    generator = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) / math.sqrt(in_features)

    d = HIDDEN
    embedding = 0.02 * torch.randn(PADDED_VOCAB, d, generator=generator)
    state_dict = {"transformer.embeddings.word_embeddings.weight": embedding}
    for i in range(LAYERS):
        p = f"transformer.layers.{i}."
        if i in SLIDING_ATTENTION_LAYERS:
            state_dict[p + "mixer.Wqkv.weight"] = linear(3 * d, d)
            state_dict[p + "mixer.out_proj.weight"] = linear(d, d)
        elif i in LINEAR_ATTENTION_LAYERS:
            for name in ("proj_q", "proj_k", "proj_k_enc"):
                state_dict[p + f"mixer.{name}.weight"] = linear(HEADS * FEATURE_DIM, d)
            state_dict[p + "mixer.proj_v.weight"] = linear(d, d)
            state_dict[p + "mixer.proj_v_enc.weight"] = linear(d, d)
            state_dict[p + "mixer.out_proj.weight"] = linear(d, d)
        else:
            state_dict[p + "mixer.in_proj.weight"] = linear(4 * d, d)
            state_dict[p + "mixer.in_proj.bias"] = torch.zeros(4 * d)
            state_dict[p + "mixer.conv.conv.weight"] = torch.randn(2 * d, 1, 3, generator=generator) / math.sqrt(3)
            state_dict[p + "mixer.out_proj.weight"] = linear(d, 2 * d)
            state_dict[p + "mixer.out_proj.bias"] = torch.zeros(d)
        state_dict[p + "norm1.weight"] = torch.ones(d)
        state_dict[p + "norm2.weight"] = torch.ones(d)
        state_dict[p + "mlp.fc1.weight"] = linear(2 * MLP_HIDDEN, d)
        state_dict[p + "mlp.fc2.weight"] = linear(d, MLP_HIDDEN)
    state_dict["transformer.ln_f.weight"] = torch.ones(d)
    state_dict["lm_head.weight"] = embedding  # tied: one tensor, stored once
    return state_dict


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet in GPT-2's id order: the 256 bytes as printable characters, the printable ones
    (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) as themselves first, then the others, in byte order, as `chr(256 + n)`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = sorted(set(range(256)) - set(printable))
    return [chr(byte) for byte in printable] + [chr(256 + n) for n in range(len(others))]


def example_tokenizer():
    """The example's tokenizer (see the module docstring): a byte-level BPE of `VOCAB` ids without merges, EOS and
    pad `<|endoftext|>`, left padding."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*byte_alphabet(), *(f"<unused_{i}>" for i in range(256, VOCAB - 1)), EOS]
    backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS, padding_side="left"
    )


def write_example_checkpoint(folder: str | Path, *, seed: int = 0) -> Path:
    """Write `config.json` and `pytorch_model.bin` of the example into `folder` (created; it must not exist or be
    empty, so nothing is overwritten), and its tokenizer into `folder/tokenizer`. Returns the folder."""
    folder = Path(folder)
    check_example_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(example_config(), indent=2) + "\n", encoding="utf-8")
    tensors = {f"model.{key}": value for key, value in example_state_dict(seed=seed).items()}
    tensors["train_metrics.num-tokens.count"] = torch.tensor(0, dtype=torch.long)
    tensors["val_metrics.num-tokens.count"] = torch.tensor(0, dtype=torch.long)
    torch.save(tensors, folder / "pytorch_model.bin")
    example_tokenizer().save_pretrained(folder / "tokenizer")
    return folder


__all__ = ["example_config", "example_state_dict", "example_tokenizer", "write_example_checkpoint"]
