"""Tiny checkpoints in the exact reference format, and an independent reference forward
(docs/reference_architecture.md §1-§2).

Nothing here imports `modeling_jrt` or `jrt_convert`: the configs copy the layout of the hub config.json files
(a GPT2Config dump with mixer dicts, docs/reference_architecture.md §2), the state dicts use the reference key names
and shapes at small sizes, and `reference_forward` is a plain quadratic fp64 transcription of §1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN = 64
HEADS = 4
FEATURE_DIM = 4
N_INNER = 128  # GatedMlp rounds it up to a multiple of 256
MLP_HIDDEN = 256
VOCAB = 257  # byte-level alphabet + <|endoftext|> = 256, so the tiny tokenizer fits
PADDED_VOCAB = 264
EOS = 256
ENC_LENGTH = 5
WINDOW_SIZE = 6  # reference window: W // 2 = 3 previous tokens plus self

_GPT2_DUMP = {
    "vocab_size": VOCAB, "n_positions": 0, "n_embd": HIDDEN, "n_layer": 4, "n_head": HEADS, "n_inner": N_INNER,
    "activation_function": "swiglu", "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0,
    "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "summary_type": "cls_index", "summary_use_proj": True,
    "scale_attn_weights": True, "use_cache": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "bos_token_id": EOS, "eos_token_id": EOS, "return_dict": True,
    "tie_word_embeddings": True, "model_type": "gpt2", "rms_norm": True, "residual_in_fp32": True,
    "fused_mlp": False, "fused_dropout_add_ln": True, "fused_bias_fc": True, "pad_vocab_size_multiple": 8,
    "special_initializer": True, "rotary_emb_fraction": 1, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
    "use_flash_attn": True, "alt_mixer_layers": [1], "alt_mixer_2_layers": [2],
}


def reference_config(family: str) -> dict:
    """config.json of one family, laid out like the hub files (docs/reference_architecture.md §2)."""
    config = dict(_GPT2_DUMP)
    if family == "jrt":  # JRT-360M-30B / JRT-1B-50B
        config["mixer"] = {"l_max": 2048, "_target_": "based.models.mixers.convolution.BaseConv", "use_bias": True,
                           "expand_proj": 4, "kernel_sizes": 3}
        config["alt_mixer"] = {
            "_target_": "based.models.mixers.prefix_linear_attention.PrefixLinearAttention", "l_max": 2048,
            "feature_dim": FEATURE_DIM, "feature_name": "taylor_exp", "num_heads": HEADS,
            "num_key_value_heads": HEADS, "enc_length": ENC_LENGTH, "dec_length": ENC_LENGTH,
            "implementation": "fla_parallel", "use_mask": True,
        }
        config["alt_mixer_2"] = {"_target_": "based.models.mixers.slide_attention.SlidingAttention",
                                 "window_size": WINDOW_SIZE, "num_heads": HEADS, "causal": True, "use_mask": True}
        config.update(enc_length=ENC_LENGTH, dec_length=ENC_LENGTH, data_type="mixed")
    elif family == "based-decay":  # based-360M-30B: training-yaml targets rewritten by the JRT loader
        config["mixer"] = {"_target_": "src.models.mixers.base_conv.BaseConvWithSiLU4", "l_max": 2048,
                           "use_bias": True, "expand_proj": 4, "kernel_sizes": [3]}
        config["alt_mixer"] = {
            "_target_": "src.models.mixers.linear_attention.LinearAttention", "l_max": 2048,
            "feature_map": {"_target_": "src.models.mixers.linear_attention.TaylorExp", "input_dim": FEATURE_DIM},
            "feature_dim": FEATURE_DIM, "num_heads": HEADS, "train_view": "quadratic", "use_decay_proj": True,
        }
        config["alt_mixer_2"] = {"_target_": "src.models.mixers.slide_fa2.SlidingsMHA", "window_size": WINDOW_SIZE,
                                 "num_heads": HEADS, "causal": True, "do_update": True}
        config.update(fixed_decay=True, decay_const=-3, decay_denom=False)
    elif family in ("based-1b-50b", "based-original"):
        config["mixer"] = {"l_max": 2048, "_target_": "based.models.mixers.convolution.BaseConv", "use_bias": True,
                           "expand_proj": 4, "kernel_sizes": 3}
        config["alt_mixer"] = {
            "_target_": "based.models.mixers.linear_attention.LinearAttention", "l_max": 2048,
            "feature_dim": FEATURE_DIM, "feature_name": "taylor_exp", "num_heads": HEADS,
            "num_key_value_heads": HEADS, "parallel_implementation": "fla_parallel",
        }
        config["alt_mixer_2"] = {"_target_": "based.models.mixers.slide_attention.SlidingAttention",
                                 "window_size": WINDOW_SIZE if family == "based-1b-50b" else 4, "num_heads": HEADS,
                                 "causal": True}
        # based-1b's yaml sets fixed_decay, which its (Based-repo) loader never applies
        # (docs/reference_architecture.md §2.1, "Decay").
        config.update(fixed_decay=family == "based-original", decay_const=-3, decay_denom=False)
    else:
        raise ValueError(family)
    return config


def reference_state_dict(config: dict, *, seed: int = 0, conv_key: str = "conv.conv") -> dict[str, torch.Tensor]:
    """Random weights under the exact reference names and shapes (docs/reference_architecture.md §2.1), fp32."""
    generator = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) / math.sqrt(in_features)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(HIDDEN, generator=generator)

    d = HIDDEN
    embedding = torch.randn(PADDED_VOCAB, d, generator=generator)
    sd = {"transformer.embeddings.word_embeddings.weight": embedding}
    for i in range(config["n_layer"]):
        p = f"transformer.layers.{i}."
        if i in config["alt_mixer_2_layers"]:
            sd[p + "mixer.Wqkv.weight"] = linear(3 * d, d)
            sd[p + "mixer.out_proj.weight"] = linear(d, d)
        elif i in config["alt_mixer_layers"]:
            sd[p + "mixer.proj_q.weight"] = 2 * linear(HEADS * FEATURE_DIM, d)  # q.k large enough for s**2 to matter
            sd[p + "mixer.proj_k.weight"] = 2 * linear(HEADS * FEATURE_DIM, d)
            sd[p + "mixer.proj_v.weight"] = linear(d, d)
            if "enc_length" in config["alt_mixer"]:
                sd[p + "mixer.proj_k_enc.weight"] = 2 * linear(HEADS * FEATURE_DIM, d)
                sd[p + "mixer.proj_v_enc.weight"] = linear(d, d)
            if config["alt_mixer"].get("use_decay_proj"):
                sd[p + "mixer.decay_proj.weight"] = linear(HEADS, d)
            sd[p + "mixer.out_proj.weight"] = linear(d, d)
        else:
            sd[p + "mixer.in_proj.weight"] = linear(4 * d, d)
            sd[p + "mixer.in_proj.bias"] = 0.1 * torch.randn(4 * d, generator=generator)
            sd[p + f"mixer.{conv_key}.weight"] = torch.randn(2 * d, 1, 3, generator=generator) / math.sqrt(3)
            sd[p + "mixer.out_proj.weight"] = linear(d, 2 * d)
            sd[p + "mixer.out_proj.bias"] = 0.1 * torch.randn(d, generator=generator)
        sd[p + "norm1.weight"] = norm()
        sd[p + "norm2.weight"] = norm()
        sd[p + "mlp.fc1.weight"] = linear(2 * MLP_HIDDEN, d)
        sd[p + "mlp.fc2.weight"] = linear(d, MLP_HIDDEN)
    sd["transformer.ln_f.weight"] = norm()
    if config.get("fixed_decay"):
        heads = torch.arange(HEADS, dtype=torch.float32)
        sd["transformer.decay.decay"] = torch.log(1 - 2.0 ** (config["decay_const"] - heads))
    sd["lm_head.weight"] = embedding  # tied: the same tensor, stored once in the pickle
    return sd


def write_reference_checkpoint(folder: Path, config: dict, state_dict: dict, *, lightning: bool) -> Path:
    """Save as the hub does (`pytorch_model.bin` with `model.` prefixes and metric counters) or as a Lightning
    `.ckpt` (the same under `state_dict`, plus trainer bookkeeping)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {f"model.{k}": v for k, v in state_dict.items()}
    tensors["train_metrics.num-tokens.count"] = torch.tensor(123456, dtype=torch.long)
    tensors["val_metrics.num-tokens.count"] = torch.tensor(789, dtype=torch.long)
    if not lightning:
        path = folder / "pytorch_model.bin"
        torch.save(tensors, path)
        return path
    path = folder / "last.ckpt"
    torch.save(
        {
            "epoch": 3, "global_step": 60000, "pytorch-lightning_version": "2.1.0", "state_dict": tensors,
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
            "callbacks": {}, "optimizer_states": [{"state": {}, "param_groups": [{"lr": 8e-4, "params": [0]}]}],
            "lr_schedulers": [{"last_epoch": 60000}],
        },
        path,
    )
    return path


# ----------------------------------------------------------------------------------------------------------------
# Reference forward (docs/reference_architecture.md §1), plain and quadratic, in fp64, on reference key names.


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:  # §3.1
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _taylor(x: torch.Tensor) -> torch.Tensor:  # §3.3: [1, x / f**0.25, x_i x_j / (sqrt(2) sqrt(f))]
    f = x.shape[-1]
    quadratic = (x[..., :, None] * x[..., None, :]).flatten(-2) / (math.sqrt(2) * math.sqrt(f))
    return torch.cat([torch.ones_like(x[..., :1]), x / f**0.25, quadratic], dim=-1)


def _heads(x: torch.Tensor, dim: int) -> torch.Tensor:  # b l (h d) -> b h l d
    return x.view(x.shape[0], x.shape[1], HEADS, dim).transpose(1, 2)


def _base_conv(x: torch.Tensor, w: dict) -> torch.Tensor:  # §3.2
    length, d = x.shape[1], x.shape[2]
    p = x @ w["in_proj.weight"].T + w["in_proj.bias"]
    u1, u2 = p[..., : 2 * d], p[..., 2 * d:]
    c = F.conv1d(u1.transpose(1, 2), w["conv.conv.weight"], padding=2, groups=2 * d)[..., :length].transpose(1, 2)
    return (F.silu(c) * u2) @ w["out_proj.weight"].T + w["out_proj.bias"]


def _linear_attention(x: torch.Tensor, w: dict, config: dict, mask: torch.Tensor | None) -> torch.Tensor:
    """§3.4 (Based, optional decay) and §3.5 (prefix linear attention, with the reference's key masking)."""
    length = x.shape[1]
    hd = HIDDEN // HEADS
    q = _heads(x @ w["proj_q.weight"].T, FEATURE_DIM)
    k = _heads(x @ w["proj_k.weight"].T, FEATURE_DIM)
    v = _heads(x @ w["proj_v.weight"].T, hd)
    if mask is not None:  # zero the raw keys (before the feature map) at masked positions
        k = k * mask[:, None, :, None]
    pq, pk = _taylor(q), _taylor(k)
    causal = torch.tril(torch.ones(length, length, dtype=x.dtype))
    a = (pq @ pk.transpose(-1, -2)) * causal  # (B, H, L, L)
    denominator = a.sum(-1)
    numerator_weights = a
    if config["alt_mixer"].get("use_decay_proj"):  # §3.4.3: decay and gate on the numerator only
        gamma = 1 - 2.0 ** (config["decay_const"] - torch.arange(HEADS, dtype=x.dtype))
        distance = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).clamp(min=0).to(x.dtype)
        decay = gamma[:, None, None] ** distance * causal  # D[h, i, j]
        gate = (x @ w["decay_proj.weight"].T).transpose(1, 2)  # (B, H, L)
        numerator_weights = a * decay * gate[..., None]
    numerator = numerator_weights @ v
    if "enc_length" in config["alt_mixer"]:
        enc = min(config["alt_mixer"]["enc_length"], length)
        x_enc = x[:, :enc]
        k_enc = _heads(x_enc @ w["proj_k_enc.weight"].T, FEATURE_DIM)
        v_enc = _heads(x_enc @ w["proj_v_enc.weight"].T, hd)
        if mask is not None:
            k_enc = k_enc * mask[:, None, :enc, None]
        a_enc = pq @ _taylor(k_enc).transpose(-1, -2)  # (B, H, L, E'): non-causal, every query
        numerator = numerator + a_enc @ v_enc
        denominator = denominator + a_enc.sum(-1)
    y = numerator / (denominator[..., None] + 1e-12)
    return y.transpose(1, 2).reshape(x.shape) @ w["out_proj.weight"].T


def _sliding_attention(x: torch.Tensor, w: dict, window_size: int) -> torch.Tensor:  # §3.6
    length = x.shape[1]
    hd = HIDDEN // HEADS
    q, k, v = (_heads(t, hd) for t in (x @ w["Wqkv.weight"].T).split(HIDDEN, dim=-1))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    angles = torch.arange(length, dtype=x.dtype)[:, None] * inv_freq  # (L, hd/2)
    cos, sin = angles.cos(), angles.sin()

    def rotate(t: torch.Tensor) -> torch.Tensor:  # non-interleaved: pairs (i, i + hd/2)
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    q, k = rotate(q), rotate(k)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = (j <= i) & (i - j <= window_size // 2)
    scores = (q @ k.transpose(-1, -2)) * hd**-0.5
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2).reshape(x.shape) @ w["out_proj.weight"].T


def reference_forward(
    config: dict, state_dict: dict, input_ids: torch.Tensor, *, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits `(B, L, padded vocab)` of the reference model (§3.0), fp64.

    `mask` `(B, L)`: the JRT left-padding keep-mask, consumed only by the prefix linear attention (§4.3).
    """
    sd = {k: v.double() for k, v in state_dict.items()}
    sd = {k.replace("conv1", "conv"): v for k, v in sd.items()}  # the JRT loader's rename
    residual = sd["transformer.embeddings.word_embeddings.weight"][input_ids]
    for i in range(config["n_layer"]):
        prefix = f"transformer.layers.{i}."
        w = {k[len(prefix) + len("mixer."):]: v for k, v in sd.items() if k.startswith(prefix + "mixer.")}
        h = _rms_norm(residual, sd[prefix + "norm1.weight"])
        if i in config["alt_mixer_2_layers"]:
            residual = residual + _sliding_attention(h, w, config["alt_mixer_2"]["window_size"])
        elif i in config["alt_mixer_layers"]:
            residual = residual + _linear_attention(h, w, config, mask)
        else:
            residual = residual + _base_conv(h, w)
        h = _rms_norm(residual, sd[prefix + "norm2.weight"])
        y, gate = (h @ sd[prefix + "mlp.fc1.weight"].T).chunk(2, dim=-1)  # §3.7: [y, gate]
        residual = residual + (y * F.silu(gate)) @ sd[prefix + "mlp.fc2.weight"].T
    return _rms_norm(residual, sd["transformer.ln_f.weight"]) @ sd["transformer.embeddings.word_embeddings.weight"].T
