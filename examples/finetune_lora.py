"""LoRA fine-tuning of a JRT-RNN / Based model with PEFT and the transformers `Trainer`.

Trains a LoRA adapter (`default_lora_config()`: every Linear projection; the depthwise convolution stays frozen),
saves it, reloads it on a fresh base model, checks that it reproduces the trained model, merges it and generates.

    # a tiny random JRT-RNN and byte-level tokens (offline, seconds on CPU)
    python examples/finetune_lora.py --output-dir runs/lora --max-steps 30
    # a folder `jrt convert` wrote (replace it with yours; its tokenizer is read from the same folder) on a text file
    # or a local dataset
    python examples/finetune_lora.py --model ./JRT-360M-30B-hf --text-file notes.txt --output-dir runs/lora
    python examples/finetune_lora.py --model ./based-360m-hf --dataset data/my_dataset --output-dir runs/lora
    # several processes: DDP (gloo on a machine without GPUs; `--multi_gpu` starts the processes, see docs/training.md)
    accelerate launch --multi_gpu --num_processes 2 examples/finetune_lora.py --output-dir runs/lora-ddp --max-steps 10

JRT-RNN models (prefix linear attention with a `mask_token_id`) are fine-tuned with the JRT objective, Based models
with the plain next-token loss (`--objective` overrides).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Only the standard library at import time: `--help` and argument errors answer before torch is imported (seconds).
# What trains is imported inside the functions that use it.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, required=True, help="gets adapter/, merged/ (and base/)")
    parser.add_argument("--model", type=Path, help="local model folder (default: a tiny random JRT-RNN)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--text-file", type=Path, help="UTF-8 text; documents separated by blank lines")
    data.add_argument("--dataset", type=Path, help="a `datasets` folder (save_to_disk, or local data files)")
    parser.add_argument("--text-column", default="text", help="column of --dataset holding the text")
    parser.add_argument("--objective", choices=["auto", "jrt", "causal"], default="auto")
    parser.add_argument("--block-size", type=int, default=129, help="tokens per packed block")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Check the paths first, as the `jrt` commands do: a missing folder would otherwise be looked up on the Hub.
    if args.model is not None and not args.model.is_dir():
        parser.error(f"--model {args.model}: no such folder (a local model folder; this example does not download)")
    if args.text_file is not None and not args.text_file.is_file():
        parser.error(f"--text-file {args.text_file}: no such file")
    if args.dataset is not None and not args.dataset.exists():
        parser.error(f"--dataset {args.dataset}: no such folder or file")
    return args


def load_documents(args: argparse.Namespace) -> list[str]:
    if args.text_file:
        return args.text_file.read_text(encoding="utf-8").split("\n\n")
    if args.dataset:
        import datasets

        if (args.dataset / "dataset_dict.json").exists() or (args.dataset / "state.json").exists():
            dataset = datasets.load_from_disk(str(args.dataset))
        else:
            dataset = datasets.load_dataset(str(args.dataset))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset["train"]
        return list(dataset[args.text_column])
    from tiny_setup import builtin_corpus

    return builtin_corpus()


def causal_lm_collator(examples: list[torch.Tensor], prefix_length: int = 0) -> dict[str, torch.Tensor]:
    """Plain next-token labels; the targets a JRT encoder reads (the first `prefix_length`) are not scored."""
    import torch

    from jrt_train import ignore_prefix_targets

    input_ids = torch.stack(examples)
    return {"input_ids": input_ids, "labels": ignore_prefix_targets(input_ids.clone(), prefix_length)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # usage errors exit with status 2 here, before torch is imported
    from tiny_setup import run_distributed

    return run_distributed(finetune, args)


def finetune(args: argparse.Namespace) -> int:
    import torch
    from peft import PeftModel, get_peft_model
    from tiny_setup import EOS_ID, decode, encode, tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    from jrt_train import JRTDataCollator, default_lora_config, pack_token_blocks
    from modeling_jrt import JRTRNNForCausalLM

    training_args = TrainingArguments(
        output_dir=str(args.output_dir / "checkpoints"), max_steps=args.max_steps, seed=args.seed,
        per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        logging_steps=max(1, args.max_steps // 5), save_strategy="no", report_to="none", dataloader_drop_last=True,
        use_cache=True,  # Trainer copies it into model.config: the merged model generates with its cache
        use_cpu=not torch.accelerator.is_available(),  # on CPU, several processes then use DDP with gloo
        ddp_find_unused_parameters=False,  # every adapter weight takes part in each step
    )
    set_seed(args.seed)
    if args.model:
        base_path, model = args.model, AutoModelForCausalLM.from_pretrained(args.model)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        tokenize, detokenize, eos_id = tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id
    else:  # the same random weights in every process (same seed), saved so that the adapter can be reloaded
        base_path, model = args.output_dir / "base", JRTRNNForCausalLM(tiny_config())
        if training_args.should_save:  # main process only
            model.save_pretrained(base_path)
        tokenize, detokenize, eos_id = encode, decode, EOS_ID

    stream = [token for document in load_documents(args) for token in tokenize(document) + [eos_id]]
    blocks = pack_token_blocks(stream, args.block_size)
    objective = args.objective
    if objective == "auto":
        is_jrt = model.config.linear_attention_type == "prefix" and model.config.mask_token_id is not None
        objective = "jrt" if is_jrt else "causal"
    if objective == "jrt":
        collator = JRTDataCollator.from_config(model.config, seed=args.seed)
    else:
        has_prefix = model.config.linear_attention_type == "prefix"
        collator = functools.partial(causal_lm_collator, prefix_length=model.config.prefix_length if has_prefix else 0)

    model = get_peft_model(model, default_lora_config(r=args.lora_rank))
    trainer = Trainer(model=model, args=training_args, train_dataset=list(blocks), data_collator=collator)
    trainer.train()
    trainer.save_model(str(args.output_dir / "adapter"))  # a PeftModel saves only the adapter
    if not trainer.is_world_process_zero():
        return 0

    # Reload the adapter on a fresh base, check it against the trained model, merge it and generate.
    model.eval()
    probe = blocks[:2, : min(64, args.block_size)]
    with torch.no_grad():
        expected = model(input_ids=probe).logits
        base = AutoModelForCausalLM.from_pretrained(base_path)
        merged = PeftModel.from_pretrained(base, args.output_dir / "adapter").merge_and_unload().eval()
        difference = (merged(input_ids=probe).logits - expected).abs().max().item()
    print(f"{objective} objective; merged vs trained adapter: max |logit difference| = {difference:.2e}")
    merged.save_pretrained(args.output_dir / "merged")
    prompt = torch.tensor([tokenize("amber=12; basil=34; what is basil? basil is")])
    generated = merged.generate(prompt, max_new_tokens=8, do_sample=False)
    print(f"merged model saved to {args.output_dir / 'merged'}; sample: {detokenize(generated[0].tolist())!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
