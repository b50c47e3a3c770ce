"""Run by test_examples_training.py under `accelerate launch`: examples/train_jrt.py, recording what each rank saw.

Usage: accelerate launch ... tests/accelerate_train_probe.py PROBE_DIR [train_jrt.py arguments]
Writes PROBE_DIR/rank{r}.pt with the training blocks the rank collated and its final weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

# Replace this folder (whose `modeling_jrt/` test folder would shadow the package) by the examples folder.
sys.path[0] = str(Path(__file__).resolve().parents[1] / "examples")
import train_jrt  # noqa: E402


class StopRecording(TrainerCallback):
    def __init__(self, recorder: dict):
        self.recorder = recorder

    def on_train_end(self, args, state, control, **kwargs):
        self.recorder["training"] = False


def main() -> None:
    probe_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    recorder = {"training": True, "blocks": [], "trainer": None}
    build_trainer = train_jrt.build_trainer

    def build_recording_trainer(args):
        trainer = build_trainer(args)
        collate = trainer.data_collator

        def recording_collator(examples):
            if recorder["training"]:
                recorder["blocks"].extend(torch.as_tensor(example["input_ids"]) for example in examples)
            return collate(examples)

        trainer.data_collator = recording_collator
        trainer.add_callback(StopRecording(recorder))
        recorder["trainer"] = trainer
        return trainer

    train_jrt.build_trainer = build_recording_trainer
    train_jrt.main(argv)
    trainer = recorder["trainer"]
    torch.save(
        {"blocks": torch.stack(recorder["blocks"]), "weights": trainer.model.state_dict(),
         "world_size": trainer.args.world_size},
        probe_dir / f"rank{trainer.args.process_index}.pt",
    )


if __name__ == "__main__":
    main()
