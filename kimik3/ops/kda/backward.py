"""The KDA backward pipeline on the Triton / Gluon kernels (chunk 64, 16-token sub-tiles), exploiting the gate
bound.

Math (per chunk, state S entering it; ``chunk.py`` / ``docs/kda.md`` for the forward):
    Gamma = chunk-local cumsum of g,  qg = q e^Gamma,  kg = k e^(Gamma_C - Gamma),  eg = e^Gamma_C,
    Rk = beta k e^Gamma,  Rv = beta v,  T = (I + A)^-1 with A[t, s] = beta_t sum_c k_t k_s e^(Gamma_t - Gamma_s)
    (s < t),  W = T Rk,  U = T Rv,  v_new = U - W S,
    o = scale (qg S + Aqk v_new),  S' = eg * S + kg^T v_new   (Aqk lower, diagonal included).

Backward, with dO = scale * do and dS' the gradient of the chunk's exit state:
    dv_new = Aqk^T dO + kg dS'                         (reverse scan, stage 1)
    dS     = qg^T dO - W^T dv_new + eg * dS'           (reverse scan, stage 1)
    dqg = dO S^T, dkg = v_new dS'^T, deg = rowsum(S * dS'), dAqk = dO v_new^T   (stage 2)
    dRv = T^T dv_new, dRk = -dRv S^T, dA = -(dRk W^T + dRv U^T) (strict lower)  (stage 2)
    then the chain rule through the exponentials (dGamma = x * dx for every x = y e^(+-Gamma)) and
    through Aqk / A on dense 16 x 16 blocks (stage 3), and dg = suffix sum of dGamma over the chunk.

Stages (``dispatch.py`` picks each one's kernel; the forward's ``aux`` holds every intermediate they read):
  1. ``bwd_scan.py``   the state gradients: the state-independent scale Aqk^T dO, the reverse scan adding kg dS'
                       (dh [NT, H, K, V] fp32, dv_new, d initial_state), then dRv = T^T dv_new over dv_new
                       (``gluon/bwd_scan.py`` on Hopper: all three in one kernel);
  2. ``bwd_wy.py``     the V-contractions per chunk: dv, partial dq / dk / dGamma / dbeta, dAqk and dA (as partials)
                       (``gluon/bwd_wy.py`` on Hopper: dA and dbeta whole);
  3. ``bwd_intra.py``  the gradients through Aqk and A, the partials added, and dGamma turned into dg by a suffix
                       sum over the chunk, with the fused pre-activations' chain rules (``gluon/bwd_intra.py`` on
                       Hopper for the first part);
  4. ``preact_bwd.py`` the L2 norm's and sigmoid's chain rules, where stage 3 cannot hold them (K > 128).

All matmuls are tl.dot with fp32 accumulation. Operands: fp32 at tf32x3 for fp32 inputs; for 16-bit inputs fp32 at
tf32, except in the state-gradient scan, which takes 16-bit operands with hi / lo splits as the forward scan did.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl

from . import bwd_scan, bwd_wy
from .bwd_intra import bwd_intra
from .dispatch import Call, select
from .plan import ChunkPlan, dot_dtype, next_pow2
from .preact_bwd import PreactInputs, preact_bwd_triton


def kda_bwd(do: torch.Tensor, dht: Optional[torch.Tensor], aux: dict, v: torch.Tensor, scale: float,
            plan: ChunkPlan, need_dh0: bool = True, preact: Optional[PreactInputs] = None):
    """Backward from the forward's ``aux`` (``forward.kda_fwd(..., return_aux=True)``). Returns (dq, dk, dv, dg,
    dbeta, dh0 or None, d A_log, d dt_bias). Without ``preact``: the core gradients, w.r.t. the kernel's q, k
    (after any L2 norm), v, g (the log-decay after any fused gate), beta (after any sigmoid) and the initial
    state, fp32 but dv in v's dtype (written once, by the WY backward); the last two None. With ``preact`` (the
    fused pre-activations' raw inputs): dq, dk, dg, dbeta w.r.t. the raw q, k, gate input, beta, and the gate
    parameters' gradients (None without the gate)."""
    q, k, G, beta = aux["q"], aux["k"], aux["G"], aux["beta"]
    qg, kg, eg, w, u, h, vn = (aux[x] for x in ("qg", "kg", "eg", "w", "u", "h", "vn"))
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    N, NT = plan.N, plan.NT
    f32 = dict(device=dev, dtype=torch.float32)
    # every token lies in a chunk of the plan (cu_seqlens ends at T: ``check_kda_inputs``), and the kernels
    # below write every gradient element of their chunks: no zero fill
    alloc = torch.empty if plan.covers(B * T) else torch.zeros
    dq = alloc(B, T, H, K, **f32)
    dk = alloc(B, T, H, K, **f32)
    dg = alloc(B, T, H, K, **f32)
    dv = alloc(B, T, H, V, device=dev, dtype=v.dtype)
    dbeta = alloc(B, T, H, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if need_dh0 else None
    if NT == 0:
        if dh0 is not None:
            dh0.copy_(dht.float() if dht is not None else torch.zeros_like(dh0))
        return _preact_grads(preact, dq, dk, dv, dg, dbeta, dh0)
    PREC = "tf32x3" if q.dtype == torch.float32 else "tf32"
    BKF = next_pow2(K)
    # V blocks of at least 32 columns (masked when V < 32): a V = 16 backward hit an illegal address on the H200
    # (Triton 3.6; K = 100 and 130, V = 16), while every V >= 24 shape with 32-column blocks ran clean
    # (``benchmarks/kda_gpu_probe.py``).
    BK, BV = min(64, BKF), min(64, max(32, next_pow2(V)))
    # the state-gradient scan takes 16-bit operands (with the hi / lo splits) when the forward scan did
    scan_dt = dot_dtype(qg.dtype)
    acc = scan_dt != tl.float32 and scale != 0  # its products accumulated in place (a zero scale has no mantissa)
    do = do.contiguous()
    dht = dht.float().contiguous() if dht is not None else None
    dh = torch.empty(NT, H, K, V, **f32)
    dvn = torch.empty(B, T, H, V, **f32)
    kernels = select(Call.of(q, v, NT, True, scale))
    # 1. the state gradients, then dRv over dv_new
    if kernels["bwd_scan"].impl == "gluon/bwd_scan":
        from .gluon import bwd_scan as gluon_bwd_scan

        gluon_bwd_scan.launch(qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H, scale, aqk=aux["aqk"], tinv=aux["tinv"])
    else:
        bwd_scan.launch(aux["aqk"], aux["tinv"], qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H, K, V, BKF, BV, scale,
                        PREC, scan_dt, acc)
    # 2. the WY backward: one partial of dA and dbeta per part (the Gluon kernel: one)
    gluon_wy = kernels["bwd_wy"].impl == "gluon/bwd_wy"
    npart = 1 if gluon_wy else bwd_wy.parts(K, BK)
    daqk = torch.empty(NT, H, 64, 64, **f32)
    da = torch.empty(npart, NT, H, 64, 64, **f32)
    dbeta_parts = dbeta if npart == 1 else torch.empty(npart, B, T, H, **f32)
    if gluon_wy:
        from .gluon import bwd_wy as gluon_bwd_wy

        gluon_bwd_wy.launch(q, k, v, G, beta, w, u, h, dh, vn, dvn, do, dq, dk, dg, dv, dbeta_parts, daqk, da, plan, H,
                            scale)
    else:
        bwd_wy.launch(q, k, v, G, beta, w, u, h, dh, vn, dvn, do, dq, dk, dg, dv, dbeta_parts, daqk, da, plan, H, K, V,
                      BKF, BK, BV, scale, PREC)
    # 3. dg holds dGamma (partial) here; the intra backward adds the intra-chunk part and turns it into dg in place
    # (applying the fused pre-activations' chain rules too where it can)
    raw = bwd_intra(q, k, G, beta, daqk, da, dq, dk, dg, dbeta_parts, dbeta, plan, npart, PREC,
                    kernels["bwd_intra"].impl == "gluon/bwd_intra", preact)
    if raw is not None:
        gq, gk, gz, gb, ga, gd = raw
        return gq, gk, dv, gz, gb, dh0, ga, gd
    # 4. the pre-activations' chain rules by their own pass
    return _preact_grads(preact, dq, dk, dv, dg, dbeta, dh0)


def _preact_grads(preact: Optional[PreactInputs], dq, dk, dv, dg, dbeta, dh0):
    """``kda_bwd``'s result from the core gradients: the fused pre-activations' chain rules by their own
    pass when ``preact`` is given."""
    if preact is None or not preact.any():
        return dq, dk, dv, dg, dbeta, dh0, None, None
    p = preact
    gq, gk, gz, gb, ga, gd = preact_bwd_triton(p.q, p.k, p.z, p.beta, dq, dk, dg, dbeta, p.A_log, p.dt_bias, p.g_min,
                                               p.use_gate, p.use_l2, p.use_beta_sigmoid)
    return gq, gk, dv, gz, gb, dh0, ga, gd

