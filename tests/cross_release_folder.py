"""Save the folder that CI loads on another transformers release: `python tests/cross_release_folder.py DIR`.

`.ci/run` saves it with the newest transformers, then runs `tests/modeling_jrt` on the oldest release pyproject
declares with `JRT_CROSS_RELEASE_FOLDER=DIR`: `test_remote_code.py` loads the folder there with
`trust_remote_code=True` alone and checks that it generates the tokens recorded here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

# Run as a script, this folder is sys.path[0], where `tests/modeling_jrt` would shadow the package: import from the
# repository root instead.
TESTS = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != TESTS]
sys.path.insert(0, str(TESTS.parent))
import modeling_jrt  # noqa: E402


def tiny_config(**overrides) -> modeling_jrt.JRTRNNConfig:
    """The tests' tiny config (conftest.tiny_config), read from conftest.py without importing the test package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("jrt_tests_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest.tiny_config(**overrides)


def save_cross_release_folder(folder: Path) -> None:
    """A tiny JRT-RNN saved with `save_pretrained`, and `expected.pt`: a left-padded batch with short and long
    prompts (the fill applies to one of them) and the greedy tokens it generates on this release."""
    torch.manual_seed(0)
    model = modeling_jrt.JRTRNNForCausalLM(tiny_config(initializer_range=0.3)).eval()
    model.save_pretrained(folder)
    input_ids = torch.randint(4, 99, (2, 11), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :8] = 0  # a 3-token prompt, filled to the prefix of 8
    generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask, "generated": generated,
                "transformers": transformers.__version__}, folder / "expected.pt")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/cross_release_folder.py DIR")
    save_cross_release_folder(Path(sys.argv[1]))
    print(f"saved {sys.argv[1]} with transformers {transformers.__version__}")
