"""What the Triton kernel tests share: where they run, and the interpreter set-up for a CPU run.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 casts made the GPU's and every load and store bounds-checked (``tests/triton_bounds.py``). A test
module takes the set-up by importing ``interpreter_setup`` (an autouse fixture) and marks its kernel tests with
``needs_kernels``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
HAS_KERNELS = importlib.util.find_spec("triton") is not None and (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="needs triton, and CUDA or TRITON_INTERPRET=1")

BF16_ULP = 2.0 ** -7  # a bf16 value's spacing, relative to the value, is at most this


@pytest.fixture(autouse=True, scope="module")
def interpreter_setup():
    checked = contextlib.nullcontext()
    if HAS_KERNELS and not ON_GPU:       # (tests/conftest.py makes the interpreter's bf16 the GPU's)
        from tests.triton_bounds import bounds_checked

        checked = bounds_checked()
    with checked:
        yield
