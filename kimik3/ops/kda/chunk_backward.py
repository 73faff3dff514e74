"""Hand-written backward of the chunkwise KDA path (first order; ``chunk.py`` has the math)."""

from __future__ import annotations

from typing import Tuple

import torch

from .chunk_forward import _Saved, _solve_upper_, _state_loop
from .chunk_layout import SUBTILE, _consts, _Plan


def _backward(f: _Saved, dO: torch.Tensor, dfinal: torch.Tensor, plan: _Plan) -> Tuple[torch.Tensor, ...]:
    """Gradients in chunk layout: dq, dk, dv, dg [X, C, D], dbeta [X, C], dstate0 [Y, K, V].

    dO [X, C, V] is the gradient of the unscaled-q output (already times scale).
    """
    H, K, V, C = plan.H, plan.K, plan.V, plan.C
    R, I = SUBTILE, C // SUBTILE
    X = plan.n * H
    pre = plan.pre
    c = _consts(C, dO.device)
    S, u = f.entry, f.u
    w = f.wu0[..., :K]
    rq = f.rows[:, :, 0]
    do_t = dO.view(X * I, R, V)

    # Aqk^T dO and Q_gamma^T dO from tile-level states (the transpose of the
    # forward's): with Y_i = (q_i e_i)^T dO_i, P_j = sum_{i>j} exp(eps_{i-1} - eps_j) Y_i
    # (P_{I-1} = 0, P_{j-1} = Y_j + exp(tau_j) P_j) and P_{-1} = Q_gamma^T dO:
    # (Aqk^T dO)_s = kc2_s P_j + own-tile Aqk^T dO.
    yq = torch.bmm(rq.reshape(X * I, R, K).transpose(1, 2), do_t).view(X, I, K, V)
    pst = torch.empty(X, I, K, V, device=dO.device)
    pst[:, I - 1].zero_()
    for j in range(I - 1, 0, -1):
        torch.addcmul(yq[:, j], pst[:, j], f.lastf[:, j].unsqueeze(-1), out=pst[:, j - 1])
    qg_t_do = torch.addcmul(yq[:, 0], pst[:, 0], f.lastf[:, 0].unsqueeze(-1))
    del yq
    aqk_t_do = torch.bmm(f.kc2.view(X * I, R, K), pst.view(X * I, K, V))
    aqk_t_do.baddbmm_(f.ad[:, 0].transpose(1, 2), do_t)
    aqk_t_do = aqk_t_do.view(X, C, V)
    del pst

    # Sequential: gradient of every chunk's exit state and of the initial state,
    # dS = M^T dS_end + Q_eff^T dO with Q_eff = Q_gamma - Aqk W.
    qdo = qg_t_do.baddbmm_(w.transpose(1, 2), aqk_t_do, alpha=-1.0)
    dexit, dstate0 = _state_loop(f.m, qdo, dfinal, plan.step_counts, H, reverse=True)
    del qdo

    # dU, then d(beta V) = T^T dU (in place), d(beta K_gamma) = -T^T dU S^T and
    # d(diag(beta) A_strict) = -(T^T dU) U^T  (U = T R, R = beta (V - K_gamma S)).
    dvb = aqk_t_do.baddbmm_(f.kdec, dexit)
    _solve_upper_(f.rows[:, :, 1], f.kc2, f.lastf, f.dinv, dvb)
    # q and k sides of each row tile side by side: g = [dO, -d(beta V)] per tile.
    g = torch.empty(X, I, 2, R, V, device=dO.device)
    g[:, :, 0] = dO.view(X, I, R, V)
    torch.neg(dvb.view(X, I, R, V), out=g[:, :, 1])
    g_t = g.view(X * I, 2 * R, V)
    rows_t = f.rows.view(X * I, 2 * R, K)
    u_t = u.view(X * I, R, V)
    dkdec = torch.bmm(u, dexit.transpose(1, 2))
    ddecay = torch.linalg.vecdot(dexit, S)  # [X, K]

    # Own tiles: [dAqk, d(diag(beta) A_strict)] on the diagonal tiles.
    da_d = torch.bmm(g_t, u_t.transpose(1, 2)).view(X * I, 2, R, R)
    daqk_diag = torch.empty(X * I, R, device=dO.device)  # dAqk[t, t]
    daqk_diag.copy_(da_d[:, 0].diagonal(dim1=1, dim2=2))
    daqk_diag = daqk_diag.view(X, C, 1)
    da_d.mul_(c.strict_RR)
    da_d = da_d.view(X * I, 2 * R, R)
    # Rows (q and k together): everything before the tile, inter-chunk state
    # included, is in H_i (Q_gamma = rq exp(eps_{i-1}), beta K_gamma = rk exp(eps_{i-1})).
    drows = torch.bmm(g_t, f.hst.view(X * I, K, V).transpose(1, 2))
    drows.baddbmm_(da_d, f.kcd.view(X * I, R, K))
    drows = drows.view(X, I, 2, R, K)
    # Columns: own tile kcd = k / e; later tiles kc2 = k exp(eps_j - Gamma_s) times
    # exp(eps_{i-1} - eps_j), through states P'_j = sum_{i>j} exp(eps_{i-1} - eps_j) g_i^T rows_i
    # (P'_{I-1} = 0, P'_{j-1} = Y_j + exp(tau_j) P'_j).
    yt = torch.bmm(g_t.transpose(1, 2), rows_t).view(X, I, V, K)
    pst2 = torch.empty(X, I, V, K, device=dO.device)
    pst2[:, I - 1].zero_()
    for j in range(I - 1, 0, -1):
        torch.addcmul(yt[:, j], pst2[:, j], f.lastf[:, j].unsqueeze(1), out=pst2[:, j - 1])
    del yt, g, g_t
    dkc2 = torch.bmm(u_t, pst2.view(X * I, V, K)).view(X, C, K)
    del pst2
    dkcd = torch.bmm(da_d.transpose(1, 2), rows_t).view(X, C, K)

    # d Gamma (natural log units): rows add, columns subtract; then dg = suffix
    # sums over the chunk. K_dec's share is taken as the same products that
    # enter dGamma_C, so the two cancel exactly where they should.
    dgam = torch.linalg.vecdot(f.rows, drows, dim=2).view(X, C, K)
    dgam.addcmul_(f.kcd.view(X, C, K), dkcd, value=-1.0)
    dgam.addcmul_(f.kc2.view(X, C, K), dkc2, value=-1.0)
    kdk = torch.mul(f.kdec, dkdec)
    dgam.sub_(kdk)
    dgam[:, -1].add_(kdk.sum(1)).addcmul_(f.decay, ddecay)
    del kdk
    # Suffix sums: within each tile, then the totals of the later tiles.
    dg = torch.bmm(c.triu_RR.expand(X * I, R, R), dgam.view(X * I, R, K)).view(X, I, R, K)
    later = torch.bmm(c.sup_II.expand(X, I, I), dg[:, :, 0])  # [X, I, K]
    dg = dg.add_(later.unsqueeze(2)).view(X, C, K)
    del dgam, later

    def tiles(x: torch.Tensor) -> torch.Tensor:  # chunk buffer [X, C, D] -> [*pre, C, D]
        return x.view(*pre, C, x.shape[-1])

    e = f.e
    # [dq, d(beta * k)] from the rows: times e.
    dqk = drows.mul_(e.view(X, I, 1, R, K))
    dq = dqk[:, :, 0].reshape(X, C, K)
    tiles(dq).addcmul_(tiles(daqk_diag), f.k)
    dk_rows = dqk[:, :, 1].view(*pre, I, R, K)
    dbeta = torch.linalg.vecdot(dk_rows, f.k.unflatten(-2, (I, R))).reshape(X, C)
    dk = torch.empty(X, C, K, device=dO.device)
    torch.mul(dk_rows, f.beta.unflatten(-1, (I, R)).unsqueeze(-1), out=dk.view(*pre, I, R, K))
    dk.addcdiv_(dkcd, e)
    # kc2 and K_dec = kc2 exp(Gamma_C - eps_j): d k = (dkc2 + to_end dK_dec) exp(eps_j - Gamma_s).
    dkc2.view(X, I, R, K).addcmul_(dkdec.view(X, I, R, K), f.to_end.unsqueeze(2))
    fk = torch.div(f.lastf.unsqueeze(2), e.view(X, I, R, K), out=torch.empty(X, I, R, K, device=dO.device))
    dk.addcmul_(dkc2, fk.view(X, C, K))
    tiles(dk).addcmul_(tiles(daqk_diag), f.q)
    dbeta += torch.linalg.vecdot(tiles(dvb), f.v).reshape(X, C)
    dv = torch.empty(X, C, V, device=dO.device)
    torch.mul(tiles(dvb), f.beta.unsqueeze(-1), out=tiles(dv))
    return dq, dk, dv, dg, dbeta, dstate0
