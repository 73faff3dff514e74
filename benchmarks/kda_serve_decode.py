"""The serving engine's KDA decode step on the GPU: the pooled kernel path against the torch path it replaced.

The engine's KDA layer advances the pool rows in place through ``kda_decode`` (the Triton kernel on CUDA). The peer
is ``backend="torch"`` of the same call: gather every live sequence's recurrent state out of the pool, the torch
one-token step (``recurrent_kda_step`` after the pre-activations), scatter the new states back, as the engine did
before the kernel. Both run in one process, on the same inputs:

  state   the state update alone: B sequences on a pool of 2B rows, H96 D128 fp32 (K3's KDA layer), raw K3
          inputs (gate, L2 norm and beta sigmoid fused);
  layer   K3's whole KDA layer (``K3Config.preset("k3")`` widths, bf16 weights, random init) decoding one token
          for B pooled sequences: projections, short conv, the state update, norm and output projection.

Each pair is checked against each other before it is timed (outputs and pool rows). Medians by
``triton.testing.do_bench``; the state figure counts the state's fp32 read and write once (2 * B * H * K * V * 4 bytes).

    python benchmarks/kda_serve_decode.py [--batches 1,16,64,256] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Report, log, rel  # noqa: E402
from harness import bench as _do_bench  # noqa: E402
from kda_k3 import decode_inputs, k3_decode_kwargs  # noqa: E402

REPORT = Report(rows=[])
RESULTS, verdict = REPORT.results, REPORT.verdict
bench = functools.partial(_do_bench, warmup=10, rep=50)  # (a smoke test replaces it with one wall-clock call)


def state_step(B: int, H: int = 96, D: int = 128, device: str = "cuda") -> dict:
    """The state update alone, torch path vs kernel, on the same pool."""
    from kimik3.ops.kda import kda_decode

    (q, k, v, z, beta), pool, slots, gen = decode_inputs(B, H, D, device)
    a_log, dt_bias = torch.rand(H, device=device, generator=gen), torch.randn(H, D, device=device, generator=gen)
    kw = k3_decode_kwargs(a_log, dt_bias)
    pools = {name: pool.clone() for name in ("torch", "triton")}
    outs = {name: kda_decode(q, k, v, z, beta, pools[name], slots, backend=name, **kw) for name in pools}
    # The torch path rounds the normalised q and k to bf16; the kernel keeps them in fp32.
    # That alone moves the new state by ~1e-3 relative at these inputs: the bounds allow it, a wrong kernel is O(1).
    e_o, e_s = rel(outs["torch"], outs["triton"]), rel(pools["torch"][slots], pools["triton"][slots])
    verdict(f"state B{B} kernel vs torch path", e_o < 1e-2 and e_s < 3e-3, f"o {e_o:.1e} state {e_s:.1e}")
    del pools, outs
    times = {name: bench(lambda name=name: kda_decode(q, k, v, z, beta, pool, slots, backend=name, **kw))
             for name in ("torch", "triton")}
    return {"B": B, "torch_ms": times["torch"], "triton_ms": times["triton"],
            "TBps": 2 * B * H * D * D * 4 / (times["triton"] * 1e-3) / 1e12}


def layer_step(B: int, layer, config, device: str = "cuda") -> dict:
    """K3's KDA layer decoding one token for B pooled sequences, torch path vs kernel."""
    from kimik3.model.cache import KDAState

    H, D = config.kda.num_heads, config.kda_head_dim
    gen = torch.Generator(device=device).manual_seed(B)
    x = torch.randn(B, 1, config.dim, device=device, generator=gen).bfloat16()
    pool = torch.randn(2 * B, H, D, D, device=device, generator=gen) * 0.1
    slots = torch.randperm(2 * B, device=device, generator=gen)[:B]
    conv = torch.randn(B, 3 * H * D, config.kda.conv_kernel - 1, device=device, generator=gen).bfloat16()

    def step(backend: str, p: torch.Tensor) -> torch.Tensor:
        os.environ["KIMIK3_KDA_BACKEND"] = backend
        try:
            return layer(x, KDAState(conv, None, pool_PHKV=p, slots_B=slots))
        finally:
            del os.environ["KIMIK3_KDA_BACKEND"]

    pools = {name: pool.clone() for name in ("torch", "triton")}
    with torch.no_grad():
        outs = {name: step(name, pools[name]) for name in pools}
        e_o, e_s = rel(outs["torch"].float(), outs["triton"].float()), rel(pools["torch"][slots], pools["triton"][slots])
        verdict(f"layer B{B} kernel vs torch path", e_o < 2e-2 and e_s < 3e-3, f"out {e_o:.1e} state {e_s:.1e}")
        del pools, outs
        times = {name: bench(lambda name=name: step(name, pool)) for name in ("torch", "triton")}
    return {"B": B, "torch_ms": times["torch"], "triton_ms": times["triton"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64,256", help="comma list of batch sizes (sequences per step)")
    parser.add_argument("--no-layer", action="store_true", help="the state update alone")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="write kda_serve_decode.json here (default $OUT)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("FAIL no CUDA device: this benchmark times the Triton decode kernel")
        return 1
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.time()
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    log("\n| B | state: torch path ms | kernel ms | kernel TB/s | speedup |")
    for B in batches:
        r = state_step(B)
        RESULTS["rows"].append({"section": "state", **r})
        log(f"| {B} | {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | {r['TBps']:.2f} | "
            f"{r['torch_ms'] / r['triton_ms']:.1f}x |")
        torch.cuda.empty_cache()
    if not args.no_layer:
        from kimik3 import K3Config
        from kimik3.model.kda import KDA

        config = K3Config.preset("k3")
        torch.manual_seed(0)
        layer = KDA(config).to(device="cuda", dtype=torch.bfloat16)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        log(f"\nK3 KDA layer (dim {config.dim}, H{config.kda.num_heads}, D{config.kda_head_dim}), bf16, one token")
        log("| B | layer: torch path ms | kernel path ms | speedup |")
        for B in batches:
            r = layer_step(B, layer, config)
            RESULTS["rows"].append({"section": "layer", **r})
            log(f"| {B} | {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | {r['torch_ms'] / r['triton_ms']:.1f}x |")
            torch.cuda.empty_cache()
    return REPORT.finish(t0, args.out, "kda_serve_decode.json")


if __name__ == "__main__":
    sys.exit(main())
