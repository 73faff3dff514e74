"""Out-of-bounds checking for Triton kernels run by the interpreter (TRITON_INTERPRET=1).

On a GPU a load or store outside every tensor a kernel was given is an illegal address; under the
interpreter it silently reads or writes host memory, so a CPU test can pass with such a bug. Inside
``bounds_checked()`` every masked-in lane of every ``tl.load`` / ``tl.store`` must fall inside the
storage of one of the launch's tensor arguments (tensors inside tuple arguments included);
otherwise the launch fails with an AssertionError naming the kernel, the source line and the number
of stray lanes. Masked-off lanes are not checked: the hardware does not touch them either.

It patches three internals of ``triton.runtime.interpreter`` (Triton 3.6: ``GridExecutor._init_args_hst``,
``InterpreterBuilder.create_masked_load`` / ``create_masked_store``) and restores them on exit; with
another Triton that lacks them it raises instead of checking nothing.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import numpy as np


def require_triton_kernels():
    """For a test module whose tests launch Triton kernels: returns triton, after skipping the whole module when
    triton is missing, or when there is no CUDA and the interpreter is off (``tests/conftest.py`` turns it on
    before any kernel module is imported; a kernel decorated without it could only compile, not run)."""
    import pytest
    import torch

    triton = pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1 (set before triton was imported)", allow_module_level=True)
    return triton


def _stray_lanes(ptrs: np.ndarray, mask: np.ndarray, itemsize: int, ranges) -> np.ndarray:
    """Addresses of the masked-in lanes of ``ptrs`` that lie in none of the [lo, hi) byte ranges."""
    active = ptrs[np.broadcast_to(mask.astype(bool), ptrs.shape)].astype(np.uint64)
    inside = np.zeros(active.shape, dtype=bool)
    for lo, hi in ranges:
        inside |= (active >= lo) & (active + itemsize <= hi)
    return active[~inside]


def _kernel_line() -> str:
    """The innermost source line of the kernel being interpreted (its frame is not in triton's package)."""
    frames = [f for f in traceback.extract_stack() if "/triton/" not in f.filename and "triton_bounds" not in f.filename]
    f = frames[-1]
    return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}: {(f.line or '').strip()}"


@contextlib.contextmanager
def bounds_checked():
    import triton.runtime.interpreter as interp

    executor, builder = interp.GridExecutor, interp.InterpreterBuilder
    names = ("_init_args_hst", "create_masked_load", "create_masked_store")
    owners = (executor, builder, builder)
    missing = [n for o, n in zip(owners, names) if not hasattr(o, n)]
    if missing:
        raise RuntimeError(f"this Triton's interpreter lacks {missing}: bounds checking cannot be installed")
    saved = [getattr(o, n) for o, n in zip(owners, names)]
    launch = {"kernel": "?", "ranges": []}

    def flat(xs):   # a tuple argument (e.g. a list of pointers) holds tensors too
        for x in xs:
            yield from (flat(x) if isinstance(x, tuple) else (x,))

    def init_args(self, args_dev, kwargs):
        args, kw = saved[0](self, args_dev, kwargs)
        ranges = []
        for x in flat(list(args) + list(kw.values())):
            if hasattr(x, "untyped_storage"):
                s = x.untyped_storage()
                ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
        launch["kernel"], launch["ranges"] = getattr(self.fn, "__name__", "?"), ranges
        return args, kw

    def check(kind, ptrs, mask):
        itemsize = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
        stray = _stray_lanes(ptrs.data, mask.data, itemsize, launch["ranges"])
        if stray.size:
            raise AssertionError(f"{kind} outside every tensor argument in {launch['kernel']} "
                                 f"({stray.size} lanes, first address {int(stray[0]):#x}) at {_kernel_line()}")

    def masked_load(self, ptrs, mask, other, *rest):
        check("load", ptrs, mask)
        return saved[1](self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return saved[2](self, ptrs, value, mask, *rest)

    for o, n, f in zip(owners, names, (init_args, masked_load, masked_store)):
        setattr(o, n, f)
    try:
        yield
    finally:
        for o, n, f in zip(owners, names, saved):
            setattr(o, n, f)
