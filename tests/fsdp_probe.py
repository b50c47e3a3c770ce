"""FSDP2 training worker for tests/test_fsdp.py (run under torchrun with 2 CPU processes, gloo).

Usage: torchrun --standalone --nproc_per_node 2 tests/fsdp_probe.py OUT_DIR

Applies the README's FSDP configuration with torch's `fully_shard` directly: one FSDP unit per
`JRTRNNDecoderLayer` (the model's `_no_split_modules`, what the transformer-based wrap policy selects) and one for
the root, `reshard_after_forward=True`, activation checkpointing, a full state dict gathered for `save_pretrained`.
Each step, rank r trains on rows [r * MICRO_BATCH, (r + 1) * MICRO_BATCH) of the step's global batch (`global_batch`),
so an unsharded model trained on the whole global batch takes exactly the same steps. Writes OUT_DIR/model (rank 0)
and OUT_DIR/rank{r}.pt (FSDP units and the parameter elements each rank holds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, not tests/modeling_jrt
from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM  # noqa: E402

STEPS, MICRO_BATCH, WORLD_SIZE, LENGTH, SEED = 3, 2, 2, 24, 0


def tiny_model() -> JRTRNNForCausalLM:
    """The same initial model in every process: every layer type, prefix attention, tied embeddings."""
    torch.manual_seed(SEED)
    config = JRTRNNConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        mixer_types=["conv", "linear_attention", "sliding_attention", "conv"], feature_dim=4, prefix_length=8,
        sliding_window=5, linear_attention_chunk_size=4, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        prefix_pad_token_id=3,
    )
    return JRTRNNForCausalLM(config)


def global_batch(step: int) -> torch.Tensor:
    """`(WORLD_SIZE * MICRO_BATCH, LENGTH)` token ids of one optimizer step (equal length: equal token counts)."""
    return torch.randint(4, 64, (WORLD_SIZE * MICRO_BATCH, LENGTH), generator=torch.Generator().manual_seed(step))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor) -> float:
    """One AdamW step on the mean next-token loss, with the gradient norm clipped to 1 (as Trainer does)."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    model = tiny_model()
    model.activation_checkpointing_enable()  # "activation_checkpointing": the decoder layers checkpoint themselves
    model.train()
    wrap = set(model._no_split_modules)  # {"JRTRNNDecoderLayer"}: the transformer-based wrap policy
    for module in model.modules():
        if type(module).__name__ in wrap:
            fully_shard(module, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)  # root: tied embedding / LM head and the final norm
    optimizer = make_optimizer(model)

    for step in range(STEPS):
        rows = global_batch(step)[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
        train_step(model, optimizer, rows)

    units = [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
    sizes = {name: (p.to_local().numel(), p.numel()) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    num_parameters = sum(p.numel() for p in model.parameters())
    torch.save({"units": units, "sizes": sizes, "num_parameters": num_parameters, "world_size": dist.get_world_size()},
               out_dir / f"rank{rank}.pt")

    # "state_dict_type": "FULL_STATE_DICT": gather the full tensors, save an ordinary folder from rank 0.
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        unsharded = tiny_model()
        unsharded.load_state_dict(state_dict)
        unsharded.save_pretrained(out_dir / "model")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
