"""The one kernel choice (`modeling_jrt.kernel_choice.KernelChoice`): what it picks from the request, the device and
what is installed, and that a model has exactly one, shared by its layers and kept apart from its copies. The kernels
themselves, and the fallbacks when they fail, are tested in tests/jrt_kernels/ (in triton's interpreter)."""

from __future__ import annotations

import copy
import pickle
import sys
import types

import pytest
import torch
from conftest import tiny_config

from modeling_jrt import JRTRNNForCausalLM
from modeling_jrt.kernel_choice import KERNEL_API, KernelChoice
from modeling_jrt.linear_attention import prefix_linear_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # the choice reads only a device's type


def fake_kernels(monkeypatch, api: int) -> None:
    """An importable `jrt_kernels` of kernel API `api` (no kernels in it: nothing may be called)."""
    module = types.ModuleType("jrt_kernels")
    module.KERNEL_API = api
    monkeypatch.setitem(sys.modules, "jrt_kernels", module)


def test_auto_is_pytorch_on_a_cpu_and_names_are_checked():
    assert KernelChoice("auto").linear_attention(CPU) == "chunked"
    assert not KernelChoice("auto").fused_norm(CPU)
    assert KernelChoice("quadratic").linear_attention(CPU) == "quadratic"
    with pytest.raises(ValueError, match=r"`implementation` must be one of \['auto', 'chunked', 'triton', 'quadratic'\]"):
        KernelChoice("gpu")
    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(ValueError, match="`implementation` must be one of"):
        prefix_linear_attention(q, q, q, implementation="cuda")


def test_auto_takes_the_kernels_on_cuda_when_they_are_installed(monkeypatch):
    fake_kernels(monkeypatch, KERNEL_API)
    choice = KernelChoice("auto")
    assert choice.linear_attention(CUDA) == "triton" and choice.fused_norm(CUDA)
    assert choice.linear_attention(CPU) == "chunked" and not choice.fused_norm(CPU)
    for asked in ("chunked", "quadratic"):  # PyTorch asked for: no kernel at all, the norm's neither
        assert KernelChoice(asked).linear_attention(CUDA) == asked and not KernelChoice(asked).fused_norm(CUDA)


def test_kernels_of_another_release_are_never_called(monkeypatch):
    """A `jrt_kernels` of another kernel API (installed beside model code of another release): "auto" runs PyTorch,
    "triton" refuses with what to install; nothing asks the kernels what they accept."""
    fake_kernels(monkeypatch, KERNEL_API + 1)
    assert KernelChoice("auto").linear_attention(CUDA) == "chunked"
    assert not KernelChoice("auto").fused_norm(CUDA)
    with pytest.raises(RuntimeError, match=r"pip install 'jrt-rnn\[triton\]'"):
        KernelChoice("triton").linear_attention(CPU)


def test_without_the_kernels_triton_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "jrt_kernels", None)  # `import jrt_kernels` raises ImportError
    assert KernelChoice("auto").linear_attention(CUDA) == "chunked"
    with pytest.raises(RuntimeError, match="needs the fused kernels"):
        KernelChoice("triton").linear_attention(CUDA)


def test_a_failure_is_recorded_in_the_choice_under_auto_and_raised_when_forced():
    def failing():
        raise RuntimeError("no kernel image is available for execution on the device")

    choice = KernelChoice("auto")
    assert choice.run("RMSNorm", failing, lambda: "pytorch") == "pytorch"
    assert choice.failures == {"RMSNorm": "RuntimeError: no kernel image is available for execution on the device"}
    with pytest.raises(RuntimeError, match="no kernel image"):
        KernelChoice("triton").run("RMSNorm", failing, lambda: "pytorch")


def test_a_model_has_one_choice_that_follows_its_config(monkeypatch):
    model = JRTRNNForCausalLM(tiny_config())
    choice = model.model.kernels
    holders = [module for module in model.modules() if hasattr(module, "kernels")]
    assert len(holders) > 3 and all(module.kernels is choice for module in holders)
    fake_kernels(monkeypatch, KERNEL_API)
    assert choice.linear_attention(CUDA) == "triton"
    model.config.linear_attention_implementation = "chunked"
    assert choice.linear_attention(CUDA) == "chunked"


def test_copies_of_a_model_have_their_own_choice(monkeypatch):
    """deepcopy and pickle (PEFT, EMA, Trainer) copy the choice with the model, one per copy and shared by its layers,
    without the loaded module (a copy loads the kernels again) and with the failures known so far."""
    fake_kernels(monkeypatch, KERNEL_API)
    model = JRTRNNForCausalLM(tiny_config())
    model.model.kernels.linear_attention(CUDA)  # loads the (fake) kernels
    model.model.kernels.failures["RMSNorm"] = "RuntimeError: earlier"
    for duplicate in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        choice = duplicate.model.kernels
        assert choice is not model.model.kernels and choice.failures == {"RMSNorm": "RuntimeError: earlier"}
        assert all(module.kernels is choice for module in duplicate.modules() if hasattr(module, "kernels"))
        assert choice.kernels() is sys.modules["jrt_kernels"]
        duplicate.config.linear_attention_implementation = "chunked"
        assert choice.linear_attention(CUDA) == "chunked" and model.model.kernels.linear_attention(CUDA) == "triton"
