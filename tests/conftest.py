import importlib.util
import os

import pytest
import torch

# Without CUDA, Triton kernels can only run under the interpreter, and Triton decides that when a
# kernel is decorated: set it here, before any test module imports triton or the kernels (a module
# that imports triton at collection, ahead of tests/ops/test_kda_triton.py, would otherwise leave
# every kernel compiled-only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under the interpreter, bf16 casts and dots as the GPU computes them, for every test alike: the fix is
# process-wide, so applied by one test module's setup it would also reach whichever modules a worker runs after it.
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from kimik3.ops.kda.interpreter import interpreter_bf16_fix

    interpreter_bf16_fix()

# CI gives 2 cores and runs 2 xdist workers: one intra-op thread each avoids oversubscription,
# which makes the many small ops in these tests spin-wait and run several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


_started: list[float] = []


def pytest_sessionstart(session):
    import time

    _started.append(time.monotonic())


def pytest_terminal_summary(terminalreporter):
    """The suite's wall time on its own line (before pytest's closing line, which CI reads)."""
    import time

    if _started and not os.environ.get("PYTEST_XDIST_WORKER"):
        elapsed = time.monotonic() - _started[0]
        terminalreporter.write_line(f"test suite wall time: {elapsed:.0f} s ({elapsed / 60:.1f} min)")


@pytest.fixture(autouse=True)
def _subnormals_restored():
    """Each test starts with subnormal floats kept, as a fresh process has them: ``kimik3 train`` on the CPU (and
    the draft trainer) flush them process-wide for speed, which would leak into later tests on the same worker
    (the MXFP4 decode under the interpreter computes through bf16 subnormals, value x 2^-126)."""
    torch.set_flush_denormal(False)
    yield
