"""The gloo launcher the distributed tests share."""

import torch, torch.distributed as dist
from tests.parallel.gloo import run_ranks

def worker(rank, world, scale):
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    return {"x": x * scale}

def test_run_ranks_collects_each_ranks_tensors(tmp_path):
    outs = run_ranks(worker, 2, tmp_path, 2.0)
    assert all(torch.equal(o["x"], torch.full((3,), 6.0)) for o in outs)
