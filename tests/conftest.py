import os

import torch

# CI gives 2 cores and runs 2 xdist workers: one intra-op thread each avoids oversubscription,
# which makes the many small ops in these tests spin-wait and run several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
