"""The parallel layers on NCCL with one process: the same code path a multi-GPU run takes.

    torchrun --nproc_per_node 1 benchmarks/parallel_smoke.py      # on a GPU machine

Checks, each against the plain single-device computation on the same inputs (bf16 model, the
`debug` preset's MoE layer and KDA shapes): the MoonEP expert-parallel LatentMoE (forward and
expert-weight gradients), KDA context parallelism (`kcp_kda` outputs and gradients), and the
MoonEP planner's latency at E=896, R=64 (direct and as a CUDA graph). Prints PASS/FAIL lines.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kimik3.config import K3Config  # noqa: E402
from kimik3.model.k3 import K3ForCausalLM  # noqa: E402
from kimik3.ops.kda import chunk_kda  # noqa: E402
from kimik3.parallel.kcp import kcp_kda  # noqa: E402
from kimik3.parallel.moonep import apply_expert_parallel  # noqa: E402
from kimik3.parallel.moonep_plan import plan, planned_quota  # noqa: E402

FAILED: list[str] = []


def verdict(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_expert_parallel(device: torch.device) -> None:
    config = K3Config.preset("debug")
    torch.manual_seed(0)
    moe_ref = K3ForCausalLM(config, device=device, seed=0).layers[1].ffn
    x = torch.randn(2048, config.dim, device=device, dtype=moe_ref.routed_down.weight.dtype)
    upstream = torch.randn_like(x)
    out_ref = moe_ref(x)
    (out_ref.float() * upstream.float()).sum().backward()
    moe = K3ForCausalLM(config, device=device, seed=0).layers[1].ffn
    apply_expert_parallel(moe, dist.group.WORLD, planner="moonep")
    out = moe(x)
    (out.float() * upstream.float()).sum().backward()
    verdict("MoonEP EP forward (nccl, world 1, bf16)", rel(out, out_ref) < 1e-2, f"rel err {rel(out, out_ref):.2e}")
    for name in ("w_gate_ELF", "w_down_EFL"):
        got, want = getattr(moe.experts, name).grad, getattr(moe_ref.experts, name).grad
        verdict(f"MoonEP EP grad {name}", rel(got, want) < 2e-2, f"rel err {rel(got, want):.2e}")


def check_kcp(device: torch.device) -> None:
    torch.manual_seed(0)
    B, T, H, K = 1, 1000, 16, 64
    q, k, v = (torch.randn(B, T, H, K, device=device) for _ in range(3))
    q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    g = -5 * torch.rand(B, T, H, K, device=device)
    beta = torch.rand(B, T, H, device=device)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    o_ref, _ = chunk_kda(*inputs, backend="torch")
    o_ref.sum().backward()
    grads_ref = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    o, _ = kcp_kda(*inputs, group=dist.group.WORLD)
    o.sum().backward()
    verdict("KCP kda output (nccl, world 1)", rel(o, o_ref) < 1e-4, f"rel err {rel(o, o_ref):.2e}")
    worst = max(rel(t.grad, r) for t, r in zip(inputs, grads_ref))
    verdict("KCP kda grads", worst < 1e-4, f"worst rel err {worst:.2e}")


def planner_latency(device: torch.device) -> None:
    experts, ranks, k, tokens = 896, 64, 16, 4096
    probs = torch.distributions.Dirichlet(torch.full((experts,), 0.3)).sample().to(device)
    loads = torch.distributions.Multinomial(ranks * tokens * k, probs).sample().long()
    plan(loads, ranks).validate()
    for _ in range(10):
        plan(loads, ranks, check=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        plan(loads, ranks, check=False)
    torch.cuda.synchronize()
    direct = (time.perf_counter() - start) / 200
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan(loads, ranks, check=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan(loads, ranks, check=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    replay = (time.perf_counter() - start) / 200
    planned_quota(loads, ranks)            # captures the layer's graph once
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        quota = planned_quota(loads, ranks)
    torch.cuda.synchronize()
    api = (time.perf_counter() - start) / 200
    same = torch.equal(quota, plan(loads, ranks).quota)
    verdict("planned_quota (CUDA graph) equals plan()", same, f"{api * 1e3:.3f} ms per call")
    loads2 = loads.roll(17)
    verdict("planned_quota on new loads", torch.equal(planned_quota(loads2, ranks), plan(loads2, ranks).quota), "")
    print(f"MoonEP planner E={experts} R={ranks}: {direct * 1e3:.3f} ms direct, {replay * 1e3:.3f} ms graph replay, "
          f"{api * 1e3:.3f} ms planned_quota (copy in, replay, copy out)")


def main() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    try:
        check_expert_parallel(device)
        check_kcp(device)
        planner_latency(device)
    finally:
        dist.destroy_process_group()
    print("SUMMARY:", "all passed" if not FAILED else f"FAILED {FAILED}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
