"""The MoonEP layer reads nothing back to the host, forward or backward: counted on gloo ranks (CPU), and on a GPU
caught by CUDA's sync debug mode at world size 1 (the last test).

A CPU has no device synchronisation to catch, so every Python-level way of reading a tensor's values on the
host is patched to count its calls (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()``,
``int()``, ``float()``, ``index()``, ``nonzero``, ``repeat_interleave`` by tensor counts without an output
size) while a LatentMoE under expert parallelism runs forward and backward. Under MoonEP the count must be
zero; plain EP ("none") must read exactly one count in forward (the documented one), which also shows the
counter sees reads. The grouped matmul is replaced by a gather-based one without host reads: on CPU the
real one loops over experts with their row counts on the host, on CUDA it is one kernel taking device
offsets (``kimik3.ops.moe.grouped_mm``)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from kimik3.parallel.moonep import apply_expert_parallel
from tests.parallel.gloo import run_ranks
from tests.parallel.test_moonep import TOKENS_PER_RANK, moe_and_inputs

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Counts (and remembers where) tensor values are read on the host while active."""

    def __init__(self):
        self.seen: list[str] = []
        self.saved = {}

    def _wrap(self, owner, name, when=lambda *a, **k: True):
        original = getattr(owner, name)
        self.saved[(owner, name)] = original

        def counted(*args, **kwargs):
            if when(*args, **kwargs):
                self.seen.append(f"{name} at {traceback.extract_stack(limit=3)[0]}")
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    def __enter__(self):
        for name in READS:
            self._wrap(torch.Tensor, name)
        self._wrap(torch.Tensor, "nonzero")
        self._wrap(torch, "nonzero")
        for owner in (torch, torch.Tensor):  # tensor repeats without output_size: the size is read on the host
            self._wrap(owner, "repeat_interleave", when=_sized_on_host)
        return self

    def __exit__(self, *exc):
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)


def _sized_on_host(*args, **kwargs) -> bool:
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


def gathered_mm(x_RI, w_EIO, counts_E):
    """``grouped_mm`` without host reads: each row times its expert's gathered weight."""
    experts = torch.arange(counts_E.numel(), device=x_RI.device)
    ids_R = torch.repeat_interleave(experts, counts_E, output_size=x_RI.shape[0])
    return torch.bmm(x_RI[:, None, :], w_EIO.index_select(0, ids_R)).squeeze(1)


def _worker(rank, world):
    import kimik3.parallel.moonep as moonep
    from kimik3.parallel.moonep import apply_expert_parallel

    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    out = {}
    for planner in ("moonep", "none"):
        moe, x, upstream = moe_and_inputs(TOKENS_PER_RANK * world)
        apply_expert_parallel(moe, dist.group.WORLD, planner=planner)
        reference = moe(x[mine])           # the real grouped matmul
        real, moonep.grouped_mm = moonep.grouped_mm, gathered_mm
        try:
            with HostReads() as forward:
                y = moe(x[mine])
            with HostReads() as backward:
                (y * upstream[mine]).sum().backward()
        finally:
            moonep.grouped_mm = real
        print(f"rank {rank} {planner}: forward reads {forward.seen}, backward reads {backward.seen}")
        quota = moe.experts.last_quota
        out[f"{planner}.reads"] = torch.tensor([len(forward.seen), len(backward.seen)])
        out[f"{planner}.close"] = torch.tensor(torch.allclose(y, reference, rtol=1e-5, atol=1e-6))
        # foreign experts hosted somewhere: the weight exchange ran with real experts in it
        owner = torch.arange(quota.shape[0]) // (quota.shape[0] // world)
        out[f"{planner}.foreign"] = ((quota > 0) & (owner[:, None] != torch.arange(world))).sum()
        out[f"{planner}.grad"] = moe.experts.w_gate_ELF.grad
    return out


def test_moonep_layer_reads_nothing_on_the_host(tmp_path):
    outs = run_ranks(_worker, 2, tmp_path)
    for rank, out in enumerate(outs):
        assert out["moonep.reads"].tolist() == [0, 0], f"rank {rank}: MoonEP read values on the host"
        # plain EP sizes its expert buffers by its routing-dependent row count: one read, in forward
        assert out["none.reads"].tolist() == [1, 0], f"rank {rank}: {out['none.reads'].tolist()}"
        assert bool(out["moonep.close"]) and bool(out["none.close"])
        assert out["moonep.grad"].abs().sum() > 0
    assert sum(int(o["moonep.foreign"]) for o in outs) > 0   # the skewed router made MoonEP move experts
    assert sum(int(o["none.foreign"]) for o in outs) == 0


def _cuda_sync_worker(planner: str) -> tuple[bool, str]:
    """In a process group of one NCCL rank on one GPU: a bf16 LatentMoE under expert parallelism, warmed up once,
    then forward + backward with CUDA's sync debug mode at "error". Returns (raised, message)."""
    moe, x, upstream = moe_and_inputs(TOKENS_PER_RANK)
    moe, x, upstream = (t.to("cuda", torch.bfloat16) for t in (moe, x, upstream))
    apply_expert_parallel(moe, dist.group.WORLD, planner=planner)
    (moe(x) * upstream).sum().backward()            # lazy initialisation (cuBLAS, Triton compiles) outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (moe(x) * upstream).sum().backward()
        return False, ""
    except RuntimeError as error:
        return True, str(error)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moonep_layer_has_no_cuda_sync_at_world_size_one(tmp_path):
    """On the GPU (the issue's check at world size 1): MoonEP's forward and backward make no host synchronisation;
    plain EP's routing-dependent buffer size is caught by the same check (which shows it sees syncs)."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        moonep = _cuda_sync_worker("moonep")
        plain = _cuda_sync_worker("none")
    finally:
        dist.destroy_process_group()
    assert moonep == (False, ""), f"MoonEP synchronised with the host: {moonep[1]}"
    assert plain[0] and "synchroniz" in plain[1], plain
