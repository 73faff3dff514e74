import os

import torch

# Without CUDA, Triton kernels can only run under the interpreter, and Triton decides that when a
# kernel is decorated: set it here, before any test module imports triton or the kernels (a module
# that imports triton at collection, ahead of tests/ops/test_kda_triton.py, would otherwise leave
# every kernel compiled-only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI gives 2 cores and runs 2 xdist workers: one intra-op thread each avoids oversubscription,
# which makes the many small ops in these tests spin-wait and run several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
