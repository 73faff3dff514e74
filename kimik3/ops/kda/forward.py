"""The KDA forward pipeline on the Triton / Gluon kernels, stage by stage (``dispatch.py`` picks each stage's kernel).

Layout and contract as ``chunk.chunk_kda_torch`` (fla layout: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
states [N, H, K, V] fp32; ``cu_seqlens`` packs N sequences into B == 1). Chunks of C = 64 tokens, sub-tiles of 16;
the math is ``chunk.py``'s, exploiting K3's gate bound (g >= g_min = -5):

1. ``prologue.py``  the fused gate, Gamma = the within-chunk cumulative log-decay, q / k L2 norms, beta's sigmoid;
2. ``intra.py``     Aqk (lower) and A = diag(beta) Akk (strictly lower) per chunk;
3. ``solve.py``     T = (I + A)^-1;
4. ``wy.py``        W = T (beta k e^Gamma), U = T (beta v) and the scan operands qg, kg, e^Gamma_C
                    (``gluon/wy.py`` on Hopper);
5. ``fwd_scan.py``  the state scan v_new = U - W S, S <- e^Gamma_C S + kg^T v_new, and o = scale (qg S + Aqk v_new)
                    (``gluon/scan.py`` on Hopper, the output in the scan).
A forward alone on Hopper runs on 16-token tiles instead (``prep16.py`` + ``gluon/scan16.py``); a training forward
keeps the 64-token intermediates the backward (``backward.py``) reads.

Accumulation is always fp32. fp32 inputs: every product at "tf32x3" (about fp32 accuracy on tensor cores). 16-bit
inputs: every product on 16-bit operands, with v_new and Aqk split into 16-bit high and low parts in the scan's
products; W is stored 16-bit, U fp32 (v_new = U - W S needs its low bits) -- fla 0.6.0's precision class
(``benchmarks/kda_precision.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from . import fwd_scan, intra, prologue, solve, wy
from .dispatch import Call, select
from .plan import ChunkPlan, dot_dtype, next_pow2, scratch
from .preact import L2_EPS


def kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
    plan: ChunkPlan,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, g_min: float = -5.0,
    use_gate: bool = False, use_l2: bool = False, use_beta_sigmoid: bool = False,
    return_aux: bool = False,
):
    """Forward only. All tensors contiguous on one device. Returns (o, final_state or None), and with return_aux the
    intermediates the backward reads as a third element."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > 256 or V > 512:
        raise ValueError(f"triton KDA supports K <= 256 and V <= 512, got K={K} V={V}")
    dev = q.device
    DT = dot_dtype(q.dtype)
    PREC = "tf32x3" if DT == tl.float32 else "tf32"
    hilo = DT != tl.float32  # the scans' v_new / Aqk hi-lo splits
    N, NT = plan.N, plan.NT
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    if NT == 0:
        if ht is not None:
            ht.copy_(initial_state.float() if initial_state is not None else torch.zeros_like(ht))
        return (o, ht, None) if return_aux else (o, ht)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    kernels = select(Call.of(q, v, NT, return_aux, scale))

    if kernels["forward"].impl == "16-token tiles":
        from . import prep16
        from .gluon import scan16

        tplan = plan.tiles(prep16.TILE)
        prep = prep16.prep16_outputs(tplan, H, K, dev, q.dtype)
        prep16.launch(q, k, g, beta, A_log, dt_bias, prep, tplan, H, K, scale, g_min, use_gate, use_l2,
                      use_beta_sigmoid, L2_EPS)
        scan16.launch(prep, v, h0, ht, o, tplan, H, K, V)
        return o, ht

    # 1. the prologue
    BKF = next_pow2(K)
    BK, BV = min(64, BKF), min(64, next_pow2(V))
    G = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    qn, kn, betan = q, k, beta
    if use_l2:
        qn, kn = torch.empty_like(q), torch.empty_like(k)
    if use_beta_sigmoid:
        betan = torch.empty(beta.shape, device=dev, dtype=torch.float32)
    alog, dtb = (A_log, dt_bias) if use_gate else (G, G)
    prologue.launch_prologue(g, G, q, k, qn, kn, beta, betan, alog, dtb, plan, H, K, BKF, BK, float(g_min), use_gate,
                             use_l2, use_beta_sigmoid)
    # 2. Aqk, A; 3. T over A
    aqk = scratch((NT, H, 64, 64), dev)
    tinv = scratch((NT, H, 64, 64), dev)
    intra.launch(qn, kn, G, betan, aqk, tinv, plan, H, K, BK, DT, PREC)
    solve.launch(tinv, plan, H, PREC)
    # 4. W, U and the scan operands (in the inputs' dtype; U fp32)
    w = torch.empty(B, T, H, K, device=dev, dtype=q.dtype)
    qg = torch.empty(B, T, H, K, device=dev, dtype=q.dtype)
    kg = torch.empty(B, T, H, K, device=dev, dtype=q.dtype)
    eg = torch.empty(NT, H, K, device=dev, dtype=torch.float32)
    u = torch.empty(B, T, H, V, device=dev, dtype=torch.float32)
    if kernels["wy"].impl == "gluon/wy":
        from .gluon import wy as gluon_wy

        gluon_wy.launch(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K)
    else:
        wy.launch(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K, V, BK, BV, DT, PREC)
    # 5. the state scan and the output, storing the chunks' entry states h and v_new (the backward reads them, and so
    # does the Triton output kernel; a forward alone where the Gluon scan applies runs on 16-token tiles instead)
    h = torch.empty(NT, H, K, V, device=dev, dtype=q.dtype)
    vn = torch.empty(B, T, H, V, device=dev, dtype=torch.float32)
    if kernels["scan"].impl == "gluon/scan":
        from .gluon import scan as gluon_scan

        gluon_scan.launch(kg, eg, w, u, h0, h, vn, ht, plan, H, K, V, qg=qg, aqk=aqk, o=o, scale=scale)
    else:
        fwd_scan.launch(kg, eg, w, u, h0, h, vn, ht, qg, aqk, o, plan, H, K, V, scale, PREC, DT, hilo)
    if not return_aux:
        return o, ht
    aux = dict(G=G, aqk=aqk, tinv=tinv, w=w, u=u, q=qn, k=kn, beta=betan, qg=qg, kg=kg, eg=eg, h=h, vn=vn)
    return o, ht, aux
