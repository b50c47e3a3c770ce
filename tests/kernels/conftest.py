"""Kernel tests run compiled on a CUDA machine and in triton's CPU interpreter everywhere else (STYLE.md §24).

TRITON_INTERPRET=1 is set by tests/conftest.py when there is no CUDA, before transformers imports triton.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA for the compiled kernel, CPU for the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from jrt_kernels import prefix_linear_attention as module

    interpreted_language = isinstance(tl.zeros, InterpretedFunction)
    if module.INTERPRETED and interpreted_language:
        return torch.device("cpu")
    if not torch.cuda.is_available() or module.INTERPRETED:
        pytest.fail(
            "Without CUDA the kernel tests need TRITON_INTERPRET=1 set before triton.language is imported "
            f"(kernel interpreted: {module.INTERPRETED}, triton.language interpreted: {interpreted_language}); "
            "tests/conftest.py sets it, or export it before running pytest."
        )
    return torch.device("cuda")
