"""The SFT leak experiment: TRL `SFTTrainer` on completions that are random words, independent of the prompt.

No model can predict such a completion, so the training loss cannot go below the floor
`(completion_words * ln(words) + 0) / (completion_words + 1)` nats per token (the eos after the completion is
predictable). Three arms, the same data and steps:

    causal Based                   the reference: plateaus at the floor
    JRT-RNN                        the prompt is the prefix (the model's default): plateaus at the floor too
    JRT-RNN, hook removed          `model.leak_free_labels_hook.remove()`: TRL's fused LM head scores log-probs from
                                   a backbone that read the first `prefix_length` tokens, completion included:
                                   the loss goes below the floor (the leak this package closes)

    python benchmarks/sft_leak.py                 # 400 steps per arm (a few minutes on one CPU thread)
    python benchmarks/sft_leak.py --steps 40      # a quick look

Prints the final training loss of each arm (mean of the last 10% of steps) against the floor, in one run.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = 64  # completion words are drawn from w4 ... w67
PROMPT_WORDS = 8
COMPLETION_WORDS = 4


def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<sp>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def random_completions(rows: int, seed: int):
    import datasets

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 4 + WORDS, (rows, PROMPT_WORDS), generator=generator)
    completions = torch.randint(4, 4 + WORDS, (rows, COMPLETION_WORDS), generator=generator)
    return datasets.Dataset.from_list([
        {"prompt": " ".join(f"w{t}" for t in p.tolist()), "completion": " " + " ".join(f"w{t}" for t in c.tolist())}
        for p, c in zip(prompts, completions)
    ])


def train_arm(name: str, steps: int, batch_size: int, seed: int) -> float:
    import trl
    from transformers import PrinterCallback
    from transformers.utils import logging as hf_logging

    from modeling_jrt import JRTRNNConfig, JRTRNNForCausalLM

    hf_logging.set_verbosity_error()
    causal = name == "causal Based"
    config = JRTRNNConfig(
        vocab_size=4 + WORDS, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        mixer_types=["conv", "linear_attention", "sliding_attention", "conv"], feature_dim=16, sliding_window=9,
        prefix_length=32, linear_attention_type="causal" if causal else "prefix", bos_token_id=1, eos_token_id=2,
        pad_token_id=0, prefix_pad_token_id=3,
    )
    torch.manual_seed(seed)
    model = JRTRNNForCausalLM(config)
    if name.endswith("hook removed"):
        model.leak_free_labels_hook.remove()
    with tempfile.TemporaryDirectory() as output:
        args = trl.SFTConfig(
            output_dir=output, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=3e-3,
            lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
            completion_only_loss=True, seed=seed, disable_tqdm=True,
        )
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=random_completions(steps * batch_size, seed),
                                 processing_class=word_tokenizer(config.vocab_size))
        trainer.remove_callback(PrinterCallback)  # no per-step log lines
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tail = losses[-max(len(losses) // 10, 1):]
    return sum(tail) / len(tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    floor = COMPLETION_WORDS * math.log(WORDS) / (COMPLETION_WORDS + 1)
    print(f"random completions: {COMPLETION_WORDS} of {WORDS} words + eos after an {PROMPT_WORDS}-word prompt; "
          f"{args.steps} steps x {args.batch_size} fresh examples per arm; floor {floor:.3f} nats/token")
    print(f"{'arm':<28} {'final loss':>10} {'loss - floor':>12} {'seconds':>8}")
    for name in ("causal Based", "JRT-RNN", "JRT-RNN, hook removed"):
        start = time.process_time()
        loss = train_arm(name, args.steps, args.batch_size, args.seed)
        print(f"{name:<28} {loss:>10.3f} {loss - floor:>+12.3f} {time.process_time() - start:>8.1f}")


if __name__ == "__main__":
    main()
