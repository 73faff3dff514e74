"""Stage 5 of the KDA backward (Triton): the fused pre-activations' chain rules (gate, q/k L2 norm, beta sigmoid).

The core backward returns gradients w.r.t. what the kernels consumed: the normalised q, k, the log-decay g and the
post-sigmoid beta. This pass maps them back to the raw inputs in one read of each tensor:

    q^ = q / sqrt(sum q^2 + eps):     dq = (dq^ - q^ (q^ . dq^)) / sqrt(sum q^2 + eps)      (same for k)
    g = g_min sigmoid(x), x = exp(A_log) (z + dt_bias):   t = dg g_min s (1 - s),  dz = t exp(A_log),
                                      d dt_bias = sum_tokens dz,  d A_log = sum_{tokens, K} t x
    beta = sigmoid(b):                db = dbeta s (1 - s)

The two parameter gradients are reduced per program into fp32 partials and summed in torch
(deterministic: no atomics). The same chain rules (``l2_bwd_rows``, ``gate_bwd``, ``sigmoid_bwd``) run
inside the intra-chunk backward (``bwd_intra.py``), which saves this pass its reads of the fp32 gradients;
this pass runs where that cannot: K > 128 with the L2 norm or the sigmoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .plan import next_pow2
from .preact import L2_EPS
from .prologue import gate_params

ROWS = 32  # tokens per program


@dataclass(frozen=True)
class PreactInputs:
    """The raw inputs of the fused pre-activations and which of them ran, for a backward that maps the core
    gradients back to them (``backward.kda_bwd(..., preact=...)``). z: the gate's raw input (the
    log-decay itself when the gate is not fused)."""

    q: torch.Tensor
    k: torch.Tensor
    z: torch.Tensor
    beta: torch.Tensor
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    g_min: float
    use_gate: bool
    use_l2: bool
    use_beta_sigmoid: bool

    def any(self) -> bool:
        return self.use_gate or self.use_l2 or self.use_beta_sigmoid


@triton.jit
def l2_bwd_rows(x, dx, EPS: tl.constexpr):
    """Per row of the fp32 tiles x (the raw rows, whole: every column of K) and dx (the gradient w.r.t. the
    normalised rows): the gradient w.r.t. x."""
    rn = tl.rsqrt(tl.sum(x * x, axis=1) + EPS)
    xh = x * rn[:, None]
    return (dx - xh * tl.sum(xh * dx, axis=1)[:, None]) * rn[:, None]


@triton.jit
def gate_grad(dg, z, rate, bias, g_min, m):
    """The gate g = g_min sigmoid(x) with x = rate (z + bias), elementwise from its gradient dg (fp32): returns
    (t, x) with t = dg g'(x) = dg g_min s (1 - s), s = sigmoid(x) (0 where m is false), so that dz = t rate,
    d dt_bias sums t rate and d A_log sums t x."""
    x = rate * (z + bias)
    s = tl.sigmoid(x)
    return tl.where(m, dg * g_min * s * (1.0 - s), 0.0), x


@triton.jit
def gate_bwd(z_ptr, alog_ptr, dtb_ptr, dz_ptr, pd_ptr, pa_ptr, off, m, cols, cm, dg, i_h, pd_at, pa_at, g_min,
             K: tl.constexpr):
    """The gate's chain rule on a tile of head i_h (offsets off, mask m; its key columns cols, mask cm) from dg
    (fp32): stores dz in dz_ptr's dtype, and this program's partials of d dt_bias (its column sums, at
    pd_ptr + pd_at + cols) and of d A_log (one value, at pa_ptr + pa_at)."""
    z = tl.load(z_ptr + off, mask=m, other=0.0).to(tl.float32)
    rate, bias = gate_params(alog_ptr, dtb_ptr, i_h, cols, cm, K)
    t, x = gate_grad(dg, z, rate, bias[None, :], g_min, m)
    dz = t * rate
    tl.store(dz_ptr + off, dz.to(dz_ptr.dtype.element_ty), mask=m)
    tl.store(pd_ptr + pd_at + cols, tl.sum(dz, axis=0), mask=cm)
    tl.store(pa_ptr + pa_at, tl.sum(tl.sum(t * x, axis=1), axis=0))


@triton.jit
def sigmoid_bwd(b, db):
    """d b from the gradient db w.r.t. sigmoid(b) (fp32)."""
    s = tl.sigmoid(b)
    return db * s * (1.0 - s)


@triton.jit
def _l2_bwd(x_ptr, dx_ptr, out_ptr, off, m, EPS: tl.constexpr):
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    dx = tl.load(dx_ptr + off, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, l2_bwd_rows(x, dx, EPS).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _preact_bwd_kernel(
    q_ptr, k_ptr, z_ptr, b_ptr, dq_ptr, dk_ptr, dg_ptr, db_ptr, alog_ptr, dtb_ptr,
    dq_out, dk_out, dz_out, db_out, pa_ptr, pd_ptr, NTOK, H, g_min,
    K: tl.constexpr, BKF: tl.constexpr, ROWS: tl.constexpr, EPS: tl.constexpr,
    USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    rows = i_b.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BKF)
    rm = rows < NTOK
    cm = c < K
    m = rm[:, None] & cm[None, :]
    off = rows[:, None] * (H * K) + i_h * K + c[None, :]
    if USE_L2:
        _l2_bwd(q_ptr, dq_ptr, dq_out, off, m, EPS)
        _l2_bwd(k_ptr, dk_ptr, dk_out, off, m, EPS)
    if USE_GATE:
        dg = tl.load(dg_ptr + off, mask=m, other=0.0).to(tl.float32)
        gate_bwd(z_ptr, alog_ptr, dtb_ptr, dz_out, pd_ptr, pa_ptr, off, m, c, cm, dg, i_h, (i_b * H + i_h) * K,
                 i_b * H + i_h, g_min, K)
    if USE_BETA_SIG:
        boff = rows * H + i_h
        b = tl.load(b_ptr + boff, mask=rm, other=0.0).to(tl.float32)
        db = tl.load(db_ptr + boff, mask=rm, other=0.0).to(tl.float32)
        tl.store(db_out + boff, sigmoid_bwd(b, db).to(db_out.dtype.element_ty), mask=rm)


def preact_bwd_triton(
    q: torch.Tensor, k: torch.Tensor, z: torch.Tensor, beta: torch.Tensor,
    dq: torch.Tensor, dk: torch.Tensor, dg: torch.Tensor, dbeta: torch.Tensor,
    A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], g_min: float,
    use_gate: bool, use_l2: bool, use_beta_sigmoid: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients w.r.t. the raw (q, k, z, beta, A_log, dt_bias) from those w.r.t. the kernel's inputs
    (dq, dk, dg, dbeta: fp32, contiguous, q's layout). A stage that was not fused passes its gradient
    through unchanged; the raw-input gradients come back in the raw inputs' dtypes."""
    B, T, H, K = q.shape
    ntok = B * T
    nb = triton.cdiv(ntok, ROWS)
    dq_out = torch.empty_like(q) if use_l2 else dq.to(q.dtype)
    dk_out = torch.empty_like(k) if use_l2 else dk.to(k.dtype)
    dz_out = torch.empty_like(z) if use_gate else dg.to(z.dtype)
    db_out = torch.empty_like(beta) if use_beta_sigmoid else dbeta.to(beta.dtype)
    pa = torch.empty(nb, H, device=q.device, dtype=torch.float32) if use_gate else dg
    pd = torch.empty(nb, H, K, device=q.device, dtype=torch.float32) if use_gate else dg
    if ntok > 0 and (use_gate or use_l2 or use_beta_sigmoid):
        _preact_bwd_kernel[(nb, H)](
            q, k, z, beta, dq, dk, dg, dbeta,
            A_log if use_gate else dg, dt_bias if use_gate else dg,
            dq_out, dk_out, dz_out, db_out, pa, pd, ntok, H, float(g_min),
            K=K, BKF=next_pow2(K), ROWS=ROWS, EPS=L2_EPS,
            USE_GATE=use_gate, USE_L2=use_l2, USE_BETA_SIG=use_beta_sigmoid, num_warps=4,
        )
    if not use_gate:
        return dq_out, dk_out, dz_out, db_out, None, None
    d_alog = pa.sum(0).to(A_log.dtype)
    d_dtb = pd.sum(0).to(dt_bias.dtype).view_as(dt_bias)
    return dq_out, dk_out, dz_out, db_out, d_alog, d_dtb
