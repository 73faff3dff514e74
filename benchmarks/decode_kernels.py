"""The decode step's small kernels, configuration by configuration: the MoE's few-token experts
(``kimik3.ops.moe.small_batch``: the gate kernel's F block x L chunk, the down kernel's L block x F chunk, warps),
KDA's decode and verify kernels (``kimik3.ops.kda.decode_kernel``: V block, warps), the AttnRes mix with its norm
(``kimik3.ops.glue.attnres``: warps), and the argmax over vocabulary rows (``kimik3.ops.sampling.row_argmax``'s
chunk against ``torch.argmax``, which is then the peer).

Each configuration is timed as a CUDA graph of back-to-back launches over distinct weights or states, one set a
layer, as a decode step meets them (from DRAM, not from L2 after the previous launch): the graph's
``do_bench`` median over the launches. The configuration the code picks is marked; every configuration's output is
checked against the default's first (the same math in another tiling: bf16 within 1e-2, FAIL otherwise).

Shapes: the debug preset's experts (top-4 of 32, L 512, F 384, 23 layers) at 1 and 4 tokens and K3's (top-16 of 64
loaded, L 3,584, F 3,072, 2 weight sets of 1 GB a matrix) at 1 token; KDA with the debug preset's heads (16 x 64,
18 layers) at batch 1, 4 and 16, and K3's (96 x 128, 4 layers) at batch 1; verification at T = 4 (and 2 at batch 1);
the mix + norm of 2 to 4 entries of D = 1,024 at 1, 4 and 16 rows (48 a debug step); the argmax over 1, 4, 16 and 64
rows of 163,840 bf16 logits and over a 32,768-id draft head's row.

    python benchmarks/decode_kernels.py [--parts moe,kda,attnres,argmax] [--json OUT]

CUDA only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench, graphed, log, rel  # noqa: E402


def graph_time_us(launch, layers: int) -> float:
    """us a launch: ``launch(i)`` for i < layers captured as one CUDA graph (``harness.graphed``), replayed."""
    return bench(graphed(lambda: [launch(i) for i in range(layers)]), warmup=10, rep=100) * 1e3 / layers


def report(name: str, times: dict[str, float], default: str, failed: list[str]) -> dict:
    best = sorted(times.items(), key=lambda kv: kv[1])
    log(f"{name}: default {default} {times[default]:.2f} us; best " + ", ".join(f"{k} {v:.2f}" for k, v in best[:4])
        + (f"; FAIL (differs from the default): {failed}" if failed else ""))
    return {"default": default, "us": times, "failed": failed}


def moe(name: str, T: int, K: int, E: int, L: int, F: int, layers: int) -> dict:
    """The gate and down kernels of ``routed_experts_small`` over every block configuration of the sweep."""
    import triton

    from kimik3.ops.moe import small_batch as sb

    dev, bf16 = "cuda", torch.bfloat16
    weights = [(torch.randn(E, L, F, device=dev, dtype=bf16) * L ** -0.5,
                torch.randn(E, L, F, device=dev, dtype=bf16) * L ** -0.5,
                torch.randn(E, F, L, device=dev, dtype=bf16) * F ** -0.5) for _ in range(layers)]
    x = torch.randn(T, L, device=dev, dtype=bf16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    mix = torch.rand(T, K, device=dev)
    hidden = torch.empty(T * K, F, device=dev, dtype=bf16)
    y = torch.empty(T, L, device=dev, dtype=bf16)
    gate_l0, gate_f0, down_l0, down_f0 = sb._blocks(T, T * K, L, F)

    def gate(i, block_f, block_l, warps):
        wg, wu, _ = weights[i]
        sb._gate_up_kernel[(T * K, triton.cdiv(F, block_f))](
            x, *x.stride(), ids, *ids.stride(), mix, *mix.stride(), wg, *wg.stride(), wu, *wu.stride(), hidden, E,
            K=K, L=L, F=F, BLOCK_L=block_l, BLOCK_F=block_f, num_warps=warps)

    def down(i, block_l, block_f, warps):
        sb._down_kernel[(T, triton.cdiv(L, block_l))](
            hidden, ids, *ids.stride(), weights[i][2], *weights[i][2].stride(), y, E,
            K=K, L=L, F=F, BLOCK_F=block_f, BLOCK_L=block_l, num_warps=warps)

    out = {}
    for kind, configs, default in (
            ("gate_up", [(f, c, w) for f, c, w in itertools.product((16, 32, 64), (64, 128, 256), (2, 4))
                         if f * c <= 16384 and f <= triton.next_power_of_2(F) and c <= triton.next_power_of_2(L)],
             (gate_f0, gate_l0, sb.NUM_WARPS)),
            ("down", sorted({(c, max(1, min(triton.next_power_of_2(F), tile // c)), w)
                             for c, tile, w in itertools.product((8, 16, 32), (4096, 8192), (2, 4))
                             if c <= triton.next_power_of_2(L)} | {(down_l0, down_f0, sb.NUM_WARPS)}),
             (down_l0, down_f0, sb.NUM_WARPS))):
        run = gate if kind == "gate_up" else down
        result = hidden if kind == "gate_up" else y
        label = (lambda c: f"F{c[0]} L{c[1]} w{c[2]}") if kind == "gate_up" else (lambda c: f"L{c[0]} F{c[1]} w{c[2]}")
        if kind == "down":
            gate(0, gate_f0, gate_l0, sb.NUM_WARPS)   # the down kernel reads layer 0's hidden rows
        run(0, *default)
        ref = result.clone()
        times, failed = {}, []
        for config in configs:
            run(0, *config)
            if rel(ref, result) > 1e-2:
                failed.append(label(config))
            times[label(config)] = graph_time_us(lambda i, c=config: run(i, *c), layers)
        out[kind] = report(f"{name} {kind}", times, label(default), failed)
    return out


def kda(name: str, B: int, H: int, K: int, T: int, layers: int) -> dict:
    """The decode kernel (T = 0) or the verify kernel over T tokens, over V blocks and warps."""
    import triton

    from kimik3.ops.kda import decode_kernel as dk

    dev, bf16, V = "cuda", torch.bfloat16, K
    rows = B * max(T, 1)
    pools = [torch.randn(B + 1, H, K, V, device=dev) * 0.1 for _ in range(layers)]
    q, k, g = (torch.randn(rows, H, K, device=dev, dtype=bf16) for _ in range(3))
    v = torch.randn(rows, H, V, device=dev, dtype=bf16)
    beta = torch.randn(rows, H, device=dev, dtype=bf16)
    a_log, dt_bias = torch.randn(H, device=dev), torch.randn(H * K, device=dev)
    slots = torch.arange(B, device=dev)
    steps = torch.empty(max(T, 1), B, H, K, V, device=dev)
    o = torch.empty(B, max(T, 1), H, V, device=dev, dtype=bf16)
    pre = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    def run(i, block_v, warps):
        if T == 0:   # the pool is advanced in place: a fresh copy for the check, the timing does not care
            return dk.launch_decode(q, k, v, g, beta, pools[i], slots, A_log=a_log, dt_bias=dt_bias, **pre,
                                    block_v=block_v, num_warps=warps)
        dk._verify_kernel[(triton.cdiv(V, block_v), B * H)](
            q, k, v, g, beta, pools[i], slots, steps, o, a_log, dt_bias, q.stride(0), k.stride(0), v.stride(0),
            g.stride(0), beta.stride(0), B, H, K ** -0.5, -5.0, T=T, K=K, V=V, BK=K, BV=block_v,
            USE_GATE=True, USE_L2=True, USE_BETA_SIG=True, EPS=dk.L2_EPS, num_warps=warps)
        return o

    block_v0, warps0 = dk._default_blocks(K, V, B * H)
    saved = pools[0].clone()
    ref = run(0, block_v0, warps0).clone()
    times, failed = {}, []
    for block_v, warps in itertools.product((16, 32, 64), (1, 2, 4)):
        pools[0].copy_(saved)
        if rel(ref, run(0, block_v, warps)) > 1e-2:
            failed.append(f"BV{block_v} w{warps}")
        times[f"BV{block_v} w{warps}"] = graph_time_us(lambda i, c=(block_v, warps): run(i, *c), layers)
    return report(name, times, f"BV{block_v0} w{warps0}", failed)


def attnres(name: str, R: int, N: int, D: int = 1024, layers: int = 48) -> dict:
    """``attnres_mix_norm``'s kernel (with its norm) over warps, each checked against the default's output."""
    import triton

    from kimik3.ops.glue import attnres as ar
    from kimik3.ops.glue.common import blocks

    dev, bf16 = "cuda", torch.bfloat16
    sets = [[torch.randn(R, D, device=dev, dtype=bf16) for _ in range(N)] for _ in range(layers)]
    kw, q, nw = (torch.rand(D, device=dev) + 0.5 for _ in range(3))
    out = torch.empty(R, D, device=dev, dtype=bf16)
    block_r, block_d, warps0 = blocks(R, D)

    def run(i, warps):
        xs = tuple(sets[i])
        ar._attnres_fwd_kernel[(triton.cdiv(R, block_r),)](
            xs, tuple(x.stride(0) for x in xs), 0, kw, q, nw, out, out, 0, out, R, D, 1e-6, 1e-6, N=N,
            STACKED=False, NORM=True, ADD=False, BLOCK_R=block_r, BLOCK_D=block_d, F64=False, num_warps=warps)
        return out

    ref = run(0, warps0).clone()
    times, failed = {}, []
    for warps in (1, 2, 4, 8, 16):
        if rel(ref, run(0, warps)) > 1e-2:
            failed.append(f"w{warps}")
        times[f"w{warps}"] = graph_time_us(lambda i, w=warps: run(i, w), layers)
    return report(name, times, f"w{warps0}", failed)


def argmax(name: str, rows: int, V: int, layers: int = 8) -> dict:
    """``row_argmax`` at several chunk sizes against ``torch.argmax`` (each checked equal to it first)."""
    import triton

    from kimik3.ops.sampling import argmax as am

    logits = [torch.randn(rows, V, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    ref = logits[0].argmax(-1)
    times = {"torch.argmax": graph_time_us(lambda i: logits[i].argmax(-1), layers)}
    failed = []
    for chunk in (1024, 2048, 4096, 8192):
        if triton.cdiv(V, chunk) > am.MAX_CHUNKS:
            continue
        if not torch.equal(am.row_argmax(logits[0], backend="triton", chunk=chunk), ref):
            failed.append(f"chunk {chunk}")
        times[f"chunk {chunk}"] = graph_time_us(lambda i, c=chunk: am.row_argmax(logits[i], backend="triton", chunk=c),
                                                layers)
    default = "torch.argmax" if am.argmax_backend(logits[0]) == "torch" else f"chunk {am.CHUNK}"
    return report(name, times, default, failed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="moe,kda,attnres,argmax",
                        help="some of moe, kda, attnres, argmax (default: all)")
    parser.add_argument("--json", default=None, help="write every configuration's time here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels.py times CUDA kernels: no CUDA device here")
    torch.manual_seed(0)
    parts = args.parts.split(",")
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a launch, graphs of back-to-back launches")
    results = {}
    if "moe" in parts:
        results["moe debug T1"] = moe("moe debug T1", 1, 4, 32, 512, 384, 23)
        results["moe debug T4"] = moe("moe debug T4", 4, 4, 32, 512, 384, 23)
        results["moe k3 T1"] = moe("moe k3 T1", 1, 16, 64, 3584, 3072, 2)
    if "kda" in parts:
        for B in (1, 4, 16):
            results[f"kda decode debug B{B}"] = kda(f"kda decode debug B{B}", B, 16, 64, 0, 18)
            results[f"kda verify debug B{B} T4"] = kda(f"kda verify debug B{B} T4", B, 16, 64, 4, 18)
        results["kda verify debug B1 T2"] = kda("kda verify debug B1 T2", 1, 16, 64, 2, 18)
        results["kda decode k3 B1"] = kda("kda decode k3 B1", 1, 96, 128, 0, 4)
        results["kda verify k3 B1 T4"] = kda("kda verify k3 B1 T4", 1, 96, 128, 4, 4)
    if "attnres" in parts:
        for R in (1, 4, 16):
            for N in (2, 4):
                results[f"attnres mix+norm R{R} N{N}"] = attnres(f"attnres mix+norm R{R} N{N}", R, N)
    if "argmax" in parts:
        for rows in (1, 4, 16, 64):
            results[f"argmax {rows} x 163840"] = argmax(f"argmax {rows} x 163840", rows, 163_840)
        results["argmax 1 x 32768"] = argmax("argmax 1 x 32768", 1, 32_768)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r.get("failed") or any(v.get("failed") for v in r.values() if isinstance(v, dict))
                    for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
