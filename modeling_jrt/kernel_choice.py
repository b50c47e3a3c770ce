"""One kernel choice: which implementation runs the linear attention (prefill and decode step) and the RMSNorm.

The fused Triton kernels live in the optional package `jrt_kernels` (`pip install 'jrt-rnn[triton]'`). Whether they
run is decided here only, from what was asked (`linear_attention_implementation`), the device
(`KERNEL_DEVICE_TYPES`) and what is installed (`jrt_kernels` of this code's `KERNEL_API`); the table of choices and
fallbacks is docs/kernels.md, "Safe dispatch".

A `KernelChoice` belongs to whoever runs the ops (a model, shared by its layers; the vLLM model; one op call). It
loads `jrt_kernels` once, logs its choice once per device type, and is the one record of failed kernels.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, TypeVar

import torch
from transformers.utils import logging

from .configuration_jrt import LINEAR_ATTENTION_IMPLEMENTATIONS, check_choice

logger = logging.get_logger(__name__)

KERNEL_API = 2
"""The version of `jrt_kernels`' calls this model code makes (`jrt_kernels.KERNEL_API` must equal it)."""

KERNEL_DEVICE_TYPES = ("cuda",)
"""Device types whose tensors the kernels take under "auto" (the tests add "cpu" to run them interpreted)."""

# The kernels whose failure `KernelChoice.run` records: the prefill and the decode step share one (a device that
# cannot build one cannot build the other), the fused backward and the RMSNorm have their own.
LINEAR_ATTENTION, BACKWARD, NORM = "linear attention", "linear attention backward", "RMSNorm"

_FALLBACKS = {
    LINEAR_ATTENTION: "the PyTorch implementation runs from now on",
    BACKWARD: "its gradients come from the PyTorch implementation from now on (the fused forward still runs and the "
    "chunked forward is recomputed in the backward)",
    NORM: "the PyTorch RMSNorm runs from now on",
}

_Result = TypeVar("_Result")


class KernelChoice:
    """Which implementation the linear attention and the RMSNorm take (module docstring), and which kernels failed.
    `config`: instead of `requested`, a config whose `linear_attention_implementation` is read at each call."""

    def __init__(self, requested: str = "auto", *, config: Any = None):
        if config is not None:
            requested = config.linear_attention_implementation
        self._requested = check_choice(
            "implementation" if config is None else "config.linear_attention_implementation", requested,
            LINEAR_ATTENTION_IMPLEMENTATIONS,
        )
        self._config = config
        self._module: ModuleType | None = None
        self._loaded = False
        self._logged: set[tuple[str, str]] = set()
        self.failures: dict[str, str] = {}
        """The kernels that failed under "auto" (`LINEAR_ATTENTION`, `BACKWARD`, `NORM`) -> the error, in one line."""

    @classmethod
    def of(cls, implementation: str | KernelChoice) -> KernelChoice:
        """`implementation` itself when it is a choice, else a new choice of that name (one op call's)."""
        return implementation if isinstance(implementation, KernelChoice) else cls(implementation)

    @property
    def requested(self) -> str:
        if self._config is None:
            return self._requested
        value = self._config.linear_attention_implementation
        if value != self._requested:  # checked when the config's value changes, not at every layer's call
            self._requested = check_choice(
                "config.linear_attention_implementation", value, LINEAR_ATTENTION_IMPLEMENTATIONS
            )
        return value

    @property
    def forced(self) -> bool:
        """Whether the kernels were asked for by name: they run wherever asked, and their failures raise."""
        return self.requested == "triton"

    def kernels(self) -> ModuleType | None:
        """`jrt_kernels` when it is installed with this model code's `KERNEL_API`, else None (loaded once)."""
        if not self._loaded:
            self._loaded = True
            try:  # in `try`: transformers' remote-code check skips it, so a Hub folder loads without jrt_kernels
                import jrt_kernels
            except ImportError:
                return None
            api = getattr(jrt_kernels, "KERNEL_API", None)
            if api == KERNEL_API:
                self._module = jrt_kernels
            else:
                logger.warning_once(
                    f"The installed jrt_kernels has kernel API {api}, this model code calls API {KERNEL_API}: the "
                    "PyTorch implementation runs. Install the jrt-rnn release this model code comes from."
                )
        return self._module

    def linear_attention(self, device: torch.device) -> str:
        """The implementation of the linear attention on `device`: `"triton"`, `"chunked"` or `"quadratic"`. A
        `RuntimeError` when "triton" is asked for and `jrt_kernels` (of this `KERNEL_API`) is not installed."""
        requested = self.requested
        if requested == "triton" and self.kernels() is None:
            raise RuntimeError("linear_attention_implementation='triton' needs the fused kernels: install them with "
                               "`pip install 'jrt-rnn[triton]'` (the `jrt_kernels` package of this release, and "
                               "triton), or use 'chunked'.")
        if requested != "auto":
            return requested
        usable = device.type in KERNEL_DEVICE_TYPES and LINEAR_ATTENTION not in self.failures
        chosen = "triton" if usable and self.kernels() is not None else "chunked"
        # Logged once per device type (not while torch.compile traces: it cannot trace a logger).
        if not torch.compiler.is_compiling() and (device.type, chosen) not in self._logged:
            self._logged.add((device.type, chosen))
            logger.info(f"Linear attention on {device.type}: {chosen} (linear_attention_implementation='auto').")
        return chosen

    def fused_norm(self, device: torch.device) -> bool:
        """Whether the RMSNorm on `device` is the fused kernel (where the linear attention may take the kernels)."""
        return (
            self.requested in ("auto", "triton") and device.type in KERNEL_DEVICE_TYPES
            and NORM not in self.failures and self.kernels() is not None
        )

    def run(self, kernel_name: str, kernel: Callable[[], _Result], fallback: Callable[[], _Result]) -> _Result:
        """`kernel()`; under "auto", a kernel that fails to compile or launch (errors of many types, hence `except
        Exception`) warns once, is recorded in `failures` and `fallback()` runs. A forced "triton" re-raises."""
        if self.forced:
            return kernel()
        try:
            return kernel()
        except Exception as error:  # noqa: BLE001 -- any compile/launch failure of an optional kernel
            self.record_failure(kernel_name, error)
        return fallback()

    def record_failure(self, kernel_name: str, error: Exception) -> None:
        """Mark `kernel_name` failed with `error` and warn (once per process and message)."""
        message = str(error).strip()
        self.failures[kernel_name] = f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
        logger.warning_once(
            f"The fused Triton {kernel_name} kernel failed on this device ({self.failures[kernel_name][:300]}); "
            f"{_FALLBACKS[kernel_name]}. Set linear_attention_implementation='chunked' in the config to skip the "
            "kernels, or 'triton' to see the error."
        )

    def install(self, model: torch.nn.Module) -> None:
        """Make this the choice of every module of `model` that holds one (`module.kernels`)."""
        for module in model.modules():
            if isinstance(getattr(module, "kernels", None), KernelChoice):
                module.kernels = self

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) loads `jrt_kernels` again: a module is neither copied nor pickled."""
        return {**self.__dict__, "_module": None, "_loaded": False}

    def __repr__(self) -> str:
        return f"KernelChoice(requested={self.requested!r}, failures={self.failures!r})"


__all__ = ["KERNEL_API", "KERNEL_DEVICE_TYPES", "KernelChoice"]
