"""Every way of getting a JRT model saves a folder that loads with `trust_remote_code=True` in an interpreter where this
distribution's packages cannot be imported: the package classes, a remote-code copy, a converted folder, a `Trainer`
checkpoint and a merged LoRA adapter. The remote code is what `save_pretrained` ships (`register_for_auto_class`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from isolated_python import BLOCK_LOCAL_PACKAGES
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.dynamic_module_utils import get_imports

import modeling_jrt
from jrt_convert import convert_checkpoint

TESTS = Path(__file__).resolve().parents[1]
# This distribution's top-level packages: none may be importable in the isolated interpreter.
LOCAL_PACKAGES = ("modeling_jrt", "jrt_")

_ISOLATED_LOAD = BLOCK_LOCAL_PACKAGES + textwrap.dedent(
    """
    for name in ("modeling_jrt", "jrt_convert", "jrt_train"):
        try:
            __import__(name)
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit(f"{name} is importable")
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    ids_path, *folders = sys.argv[1:]
    input_ids = torch.load(ids_path)
    results = {}
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            logits = model(input_ids).logits
        # Re-saved from the remote-code classes: loads again, as AutoModelForCausalLM and as AutoModel.
        model.save_pretrained(folder + "-resaved")
        again = AutoModelForCausalLM.from_pretrained(folder + "-resaved", trust_remote_code=True).eval()
        backbone = AutoModel.from_pretrained(folder + "-resaved", trust_remote_code=True)
        assert type(backbone).__name__ == "JRTRNNModel", type(backbone)
        with torch.no_grad():
            assert torch.equal(again(input_ids).logits, logits), folder
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3)
        results[folder] = {"logits": logits, "generated": generated}
    torch.save(results, ids_path + ".out.pt")
    """
)


def _run_isolated(tmp_path: Path, input_ids: torch.Tensor, folders: list[Path]) -> dict:
    """Load each folder with `trust_remote_code=True` in `python -I` with the packages blocked; their outputs."""
    ids_path = tmp_path / "ids.pt"
    torch.save(input_ids, ids_path)
    script = tmp_path / "load.py"
    script.write_text(_ISOLATED_LOAD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    process = subprocess.run(
        [sys.executable, "-I", str(script), str(ids_path), *map(str, folders)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return torch.load(f"{ids_path}.out.pt")


def _converted_folder(tmp_path: Path) -> Path:
    """A folder converted from a tiny reference checkpoint (`tests/jrt_convert/reference_checkpoints.py`)."""
    path = TESTS / "jrt_convert" / "reference_checkpoints.py"
    spec = importlib.util.spec_from_file_location("reference_checkpoints", path)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    config = reference.reference_config("jrt")
    source = tmp_path / "src" / "JRT-360M-30B"
    reference.write_reference_checkpoint(source, config, reference.reference_state_dict(config), lightning=False)
    convert_checkpoint(source, tmp_path / "converted")
    return tmp_path / "converted"


def _trainer_checkpoint(tmp_path: Path) -> Path:
    """One `Trainer` step with a checkpoint saved at that step, as an intermediate checkpoint of a longer run."""
    model = modeling_jrt.JRTRNNForCausalLM(tiny_config())
    blocks = torch.randint(4, 99, (4, 12))
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=2, save_strategy="steps",
        save_steps=1, use_cache=True, report_to="none", use_cpu=True,
    )
    dataset = [{"input_ids": block, "labels": block} for block in blocks]
    Trainer(model=model, args=args, train_dataset=dataset).train()
    return tmp_path / "trainer" / "checkpoint-1"


def _merged_lora(tmp_path: Path) -> Path:
    """A LoRA adapter (non-zero, so merging changes the weights) merged into its base, as finetune_lora.py does."""
    peft = pytest.importorskip("peft")
    model = modeling_jrt.JRTRNNForCausalLM(tiny_config())
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    merged = peft.get_peft_model(model, config).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    return tmp_path / "merged"


@pytest.mark.slow
def test_every_saved_folder_loads_without_the_package(tmp_path):
    package = tmp_path / "package"
    modeling_jrt.JRTRNNForCausalLM(tiny_config()).save_pretrained(package)
    resaved_converted = tmp_path / "converted-by-package"
    AutoModelForCausalLM.from_pretrained(_converted_folder(tmp_path)).save_pretrained(resaved_converted)
    trainer = _trainer_checkpoint(tmp_path)
    merged = _merged_lora(tmp_path)
    folders = [package, resaved_converted, trainer, merged]

    for folder in folders:
        saved = json.loads((folder / "config.json").read_text())
        assert saved["auto_map"] == {
            "AutoConfig": "configuration_jrt.JRTRNNConfig",
            "AutoModel": "modeling_jrt.JRTRNNModel",
            "AutoModelForCausalLM": "modeling_jrt.JRTRNNForCausalLM",
        }, folder
        assert saved["use_cache"] is True, folder  # Trainer's checkpoint included
    input_ids = torch.randint(4, 99, (2, 11), generator=torch.Generator().manual_seed(1))
    remote = _run_isolated(tmp_path, input_ids, folders)
    for folder in folders:
        local = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(remote[str(folder)]["logits"], local(input_ids).logits, rtol=0, atol=0)
        expected = local.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=3)
        assert torch.equal(remote[str(folder)]["generated"], expected)


def get_relative_imports_of(path: Path) -> list[str]:
    """The modules `path` imports relatively (`from .name import ...`), as transformers reads them."""
    from transformers.dynamic_module_utils import get_relative_imports

    return get_relative_imports(str(path))


def test_save_pretrained_ships_the_model_files_with_relative_imports_only(tmp_path):
    """The shipped files are the model's only (no prompt builders, collator or LoRA helpers), and none imports this
    distribution's packages (a remote-code folder could not load it); `jrt_kernels` is imported inside a function, as an optional fast path."""
    modeling_jrt.JRTRNNForCausalLM(tiny_config()).save_pretrained(tmp_path)
    shipped = sorted(p.name for p in tmp_path.glob("*.py"))
    source = Path(modeling_jrt.__file__).parent
    package = sorted(path.name for path in source.glob("*.py") if path.name != "__init__.py")
    assert shipped == package
    # transformers 5.5 copies only the files the model file imports itself: modeling_jrt.py names every module.
    direct = {name.split(".")[0] for name in get_relative_imports_of(source / "modeling_jrt.py")}
    assert direct == {name[: -len(".py")] for name in package} - {"modeling_jrt"}
    for path in tmp_path.glob("*.py"):
        absolute = [name for name in get_imports(str(path)) if name.startswith(LOCAL_PACKAGES)]
        assert not absolute, f"{path.name} imports {absolute}"
