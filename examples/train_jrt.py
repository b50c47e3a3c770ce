"""Train a small JRT-RNN from scratch with the JRT objective (docs/reference_architecture.md §1.5) and the
transformers `Trainer`.

Next-token loss after the prefix + 0.25 x masked-LM loss on the prefix (15% of its tokens -> [MASK]), on packed
blocks of byte-level tokens. Runs offline on CPU; one process or several:

    python examples/train_jrt.py --output-dir runs/jrt-tiny --max-steps 200
    python examples/train_jrt.py --train-file my_corpus.txt --output-dir runs/jrt-tiny
    accelerate launch --multi_gpu --num_processes 2 examples/train_jrt.py --output-dir runs/jrt-ddp --max-steps 20

The hyper-parameters default to the reference's (AdamW lr 8e-4, betas 0.9/0.95, weight decay 0.1 except on norms
and biases, cosine schedule with warm-up, gradient clipping 1.0); the model is tiny.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jrt_train.trainer import JRTTrainer

# Only the standard library at import time: `--help` and argument errors answer before torch is imported (seconds).
# What trains is imported inside `train` and `build_trainer`.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True, help="where the trained model is saved")
    parser.add_argument("--train-file", type=Path, help="UTF-8 text file (default: a built-in key-value corpus)")
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--prefix-length", type=int, default=64, help="length of the non-causal prefix")
    parser.add_argument("--block-size", type=int, default=129, help="tokens per packed training block")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per device and micro-batch")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=8e-4)
    parser.add_argument("--mlm-probability", type=float, default=0.15, help="fraction of prefix tokens masked")
    parser.add_argument("--mask-sampling", choices=["fixed", "bernoulli"], default="fixed",
                        help="'fixed': exactly round(p * prefix) masks per sequence; 'bernoulli': the reference's draw")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs with bf16 support)")
    parser.add_argument("--seed", type=int, default=1111)
    args = parser.parse_args(argv)
    if args.train_file is not None and not args.train_file.is_file():
        parser.error(f"--train-file {args.train_file}: no such file")
    return args


def build_trainer(args: argparse.Namespace) -> JRTTrainer:
    """The model, data and `JRTTrainer` (logs the objective's two parts) of one run."""
    import torch
    from tiny_setup import EOS_ID, builtin_corpus, encode, tiny_config
    from transformers import TrainingArguments, set_seed

    from jrt_train import JRTDataCollator, pack_token_blocks
    from jrt_train.trainer import JRTTrainer
    from modeling_jrt import JRTRNNForCausalLM

    set_seed(args.seed)  # every process builds the same initial model
    documents = args.train_file.read_text(encoding="utf-8").split("\n\n") if args.train_file else builtin_corpus()
    stream = [token for document in documents for token in encode(document) + [EOS_ID]]
    blocks = pack_token_blocks(stream, args.block_size)

    model = JRTRNNForCausalLM(tiny_config(args.prefix_length, args.hidden_size, args.num_layers))
    training_args = TrainingArguments(
        output_dir=str(args.output_dir), max_steps=args.max_steps, seed=args.seed, bf16=args.bf16,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, adam_beta1=0.9, adam_beta2=0.95, lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 100), max_grad_norm=1.0, logging_steps=max(1, args.max_steps // 10),
        weight_decay=0.1,  # Trainer exempts biases and every *norm* weight, as the reference does
        save_strategy="no", report_to="none",
        use_cache=True,  # Trainer copies it into model.config: saved checkpoints generate with their cache
        use_cpu=not torch.accelerator.is_available(),  # on CPU, several processes then use DDP with gloo
        ddp_find_unused_parameters=False,  # every parameter takes part in each step
        dataloader_drop_last=True,  # equal micro-batches on every process
    )
    # With drop_last, the evaluation keeps only whole rounds of one batch per process: at least one block per process,
    # and batches no larger than each process's share, or no batch is left and there is no `eval_loss` (11 blocks on
    # 2 processes x batch 8).
    world_size = training_args.world_size
    num_eval = max(world_size, len(blocks) // 20)
    training_args.per_device_eval_batch_size = max(1, min(args.batch_size, num_eval // world_size))
    train_blocks, eval_blocks = blocks[num_eval:], blocks[:num_eval]
    collator = JRTDataCollator.from_config(model.config, mlm_probability=args.mlm_probability,
                                           mask_sampling=args.mask_sampling, seed=args.seed)
    return JRTTrainer(model=model, args=training_args, data_collator=collator,
                      train_dataset=[{"input_ids": block} for block in train_blocks],
                      eval_dataset=[{"input_ids": block} for block in eval_blocks])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # usage errors exit with status 2 here, before torch is imported
    from tiny_setup import run_distributed

    return run_distributed(train, args)


def train(args: argparse.Namespace) -> int:
    import torch
    from tiny_setup import decode, encode

    from modeling_jrt import JRTRNNForCausalLM

    trainer = build_trainer(args)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(str(args.output_dir))
    if trainer.is_world_process_zero():
        print(f"eval loss (NTP + {trainer.model.config.mlm_weight} x MLM): {metrics['eval_loss']:.4f}")
        model = JRTRNNForCausalLM.from_pretrained(args.output_dir).eval()
        prompt = torch.tensor([encode("amber=12; basil=34; cedar=56; what is basil? basil is")])
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
        print(f"saved to {args.output_dir}; sample: {decode(generated[0].tolist())!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
