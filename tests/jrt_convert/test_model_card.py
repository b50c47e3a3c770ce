"""The converted folder's model card: license, base model and citation, and a usage block that runs as written
without the package (no interactive trust_remote_code prompt on the way)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from isolated_python import BLOCK_LOCAL_PACKAGES
from reference_checkpoints import EOS, reference_config, reference_state_dict, write_reference_checkpoint
from transformers import PreTrainedTokenizerFast

from jrt_convert import convert_checkpoint



def _byte_tokenizer(folder: Path) -> Path:
    """GPT-2's byte alphabet without merges, plus <|endoftext|> at GPT-2's eos id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = EOS
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("card")
    config = reference_config("jrt")
    source = write_reference_checkpoint(
        tmp_path / "src" / "JRT-360M-30B", config, reference_state_dict(config), lightning=False
    )
    out = tmp_path / "out"
    convert_checkpoint(source.parent if source.is_file() else source, out,
                       tokenizer=str(_byte_tokenizer(tmp_path / "tok")))
    return out


def test_card_carries_license_base_model_and_citation(converted):
    card = ModelCard.load(converted / "README.md")
    assert card.data.license == "apache-2.0"
    # Converted from a local folder named like a released checkpoint: its Hub id is still the base model.
    assert card.data.base_model == "hazyresearch/JRT-360M-30B"
    assert "@article{arora2024just" in card.text and "arXiv:2407.05483" in card.text
    assert "@article{arora2024simple" in card.text


def test_card_usage_runs_without_the_package_and_without_a_prompt(converted, tmp_path):
    card = (converted / "README.md").read_text()
    usage = re.search(r"## Usage\n\n```python\n(.*?)```", card, re.S).group(1)
    script = tmp_path / "usage.py"
    script.write_text(BLOCK_LOCAL_PACKAGES + usage.replace("PATH_OR_REPO", str(converted)) + "print('usage ok')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    process = subprocess.run(
        [sys.executable, "-I", str(script)], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )
    output = process.stdout + process.stderr
    assert process.returncode == 0, output[-3000:]
    assert "usage ok" in process.stdout
    assert "[y/N]" not in output, output[-3000:]
