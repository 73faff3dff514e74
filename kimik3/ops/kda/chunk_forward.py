"""Forward algebra of the chunkwise KDA path (``chunk.py`` has the math): decay factors, tile
inverses and solves, the per-chunk quantities and the sequential state loop."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .chunk_layout import _LOG2_FLOOR, SUBTILE, _chunk_view, _consts, _Plan


def _decay_logs(g: torch.Tensor, plan: _Plan) -> Tuple[torch.Tensor, torch.Tensor]:
    """Within-tile cumulative decays from the gates, base 2.

    Returns the row factor e = exp(Gamma_t - eps_{i-1}) [X, C, K] (eps_{i-1}:
    Gamma just before t's tile) and the tile totals [I, X, K] (base 2).
    """
    B, T, H, K, C = plan.B, plan.T, plan.H, plan.K, plan.C
    R, I = SUBTILE, C // SUBTILE
    X = plan.n * H
    c = _consts(C, g.device)
    g32 = g.float()
    e = torch.empty(X, C, K, device=g.device)
    tot = torch.empty(I, X, K, device=g.device)
    if plan.fast:
        # One matmul in token layout (16-token tiles never straddle chunks);
        # the exp2 pass then writes chunk-major.
        nc = T // C
        g_rows = g32.reshape(B * T // R, R, H * K)
        lc = torch.bmm(c.tri_RR.expand(g_rows.shape[0], R, R), g_rows).view(B, nc, I, R, H, K)
        torch.exp2(lc.permute(1, 0, 4, 2, 3, 5), out=e.view(nc, B, H, I, R, K))
        tot.view(I, nc, B, H, K).copy_(lc[:, :, :, R - 1].permute(2, 1, 0, 3, 4))
    else:
        gc = _chunk_view(g32, plan).view(X * I, R, K)
        lc = torch.bmm(c.tri_RR.expand(X * I, R, R), gc).view(X, I, R, K)
        torch.exp2(lc, out=e.view(X, I, R, K))
        tot.copy_(lc[:, :, R - 1].transpose(0, 1))
    return e, tot


# --------------------------------------------------------------------------
# per-chunk algebra
# --------------------------------------------------------------------------


def _tile_inverses(n_ZRR: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 for strictly lower triangular 16 x 16 tiles N [Z, R, R].

    Forward substitution, vectorised over the tiles: 15 rank-1 updates of
    whole rows (row m of every inverse is final once the rows above it have
    been removed from it). Returns [Z, R, R], zeros above the diagonal exactly.
    """
    Z, R, _ = n_ZRR.shape
    y_ZRR = torch.zeros(Z, R, R, device=n_ZRR.device)
    y_ZRR.diagonal(dim1=1, dim2=2).fill_(1.0)
    for m in range(R - 1):
        y_ZRR[:, m + 1 :].addcmul_(n_ZRR[:, m + 1 :, m : m + 1], y_ZRR[:, m : m + 1], value=-1.0)
    return y_ZRR


def _solve_lower_(
    rk: torch.Tensor, kc2: torch.Tensor, lastf: torch.Tensor, dinv: torch.Tensor, rhs: torch.Tensor
) -> torch.Tensor:
    """rhs <- (I + L)^-1 rhs in place, L = diag(beta) A_strict of every chunk.

    Block forward substitution over the 16-row tiles. The diagonal tiles'
    inverses are dinv [X, I, R, R]; the part of L left of the diagonal tiles
    is never formed: with kc2_j = k exp(eps_j - Gamma_s), tile i's product
    with the solved rows is rk_i F_i, where the state
    F_i = sum_{j<i} exp(eps_{i-1} - eps_j) kc2_j^T Y_j follows
    F_{i+1} = exp(tau_i) F_i + kc2_i^T Y_i.
    Shapes: rk, kc2 [X, I, R, K]; lastf [X, I, K] = exp(tau); rhs [X, C, D].
    """
    I, R = dinv.shape[1], dinv.shape[2]
    f = None
    for i in range(I):
        a, b = i * R, (i + 1) * R
        z = rhs[:, a:b]
        if i:
            z = torch.baddbmm(z, rk[:, i], f, alpha=-1.0)
        y = torch.bmm(dinv[:, i], z)
        rhs[:, a:b] = y
        if i < I - 1:
            f_next = torch.bmm(kc2[:, i].transpose(1, 2), y)
            if i:
                f_next.addcmul_(f, lastf[:, i].unsqueeze(-1))
            f = f_next
    return rhs


def _solve_upper_(
    rk: torch.Tensor, kc2: torch.Tensor, lastf: torch.Tensor, dinv: torch.Tensor, rhs: torch.Tensor
) -> torch.Tensor:
    """rhs <- (I + L)^-T rhs in place: block back substitution, as ``_solve_lower_``.

    Tile i's product with the later solved rows is kc2_i P_i, with
    P_i = sum_{m>i} exp(eps_{m-1} - eps_i) rk_m^T Y_m, P_{i-1} = rk_i^T Y_i + exp(tau_i) P_i.
    """
    I, R = dinv.shape[1], dinv.shape[2]
    p = None
    for i in range(I - 1, -1, -1):
        a, b = i * R, (i + 1) * R
        z = rhs[:, a:b]
        if i < I - 1:
            z = torch.baddbmm(z, kc2[:, i], p, alpha=-1.0)
        y = torch.bmm(dinv[:, i].transpose(1, 2), z)
        rhs[:, a:b] = y
        if i:
            p_next = torch.bmm(rk[:, i].transpose(1, 2), y)
            if i < I - 1:
                p_next.addcmul_(p, lastf[:, i].unsqueeze(-1))
            p = p_next
    return rhs


class _Saved(NamedTuple):
    """Forward chunk quantities kept for the backward pass (float32)."""

    q: torch.Tensor  # [*pre, C, K] chunk views of the inputs
    k: torch.Tensor
    v: torch.Tensor  # [*pre, C, V]
    beta: torch.Tensor  # [*pre, C]
    e: torch.Tensor  # [X, C, K] exp(Gamma_t - eps_{i-1})
    rows: torch.Tensor  # [X, I, 2, R, K] per row tile: q * e, then beta * k * e
    kcd: torch.Tensor  # [X, I, R, K] own-tile columns k * exp(eps_{i-1} - Gamma_s) = k / e
    kc2: torch.Tensor  # [X, I, R, K] columns seen from later tiles: k_s exp(eps_i - Gamma_s)
    lastf: torch.Tensor  # [X, I, K] exp(tau_i), tau_i the tile's total log-decay
    to_end: torch.Tensor  # [X, I, K] exp(Gamma_C - eps_i)
    decay: torch.Tensor  # [X, K] exp(Gamma_C)
    ad: torch.Tensor  # [X * I, 2, R, R] Aqk (lower) and diag(beta) A (strict) on the diagonal tiles
    dinv: torch.Tensor  # [X, I, R, R] inverses of the diagonal tiles of I + diag(beta) A_strict
    wu0: torch.Tensor  # [X, C, K + V] [W, U0]
    kdec: torch.Tensor  # [X, C, K] exp(Gamma_C - Gamma_s) * k_s
    m: torch.Tensor  # [X, K, K] chunk transition
    entry: torch.Tensor  # [X, K, V] state entering every chunk
    u: torch.Tensor  # [X, C, V] delta values
    hst: torch.Tensor  # [X, I, K, V] tile-level states H_i


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state0: torch.Tensor, plan: _Plan, keep: bool,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[_Saved]]:
    """o (unscaled q) [X, C, V], final states [Y, K, V] and, if keep, the saved quantities."""
    H, K, V, C = plan.H, plan.K, plan.V, plan.C
    R, I = SUBTILE, C // SUBTILE
    X = plan.n * H
    pre = plan.pre
    c = _consts(C, q.device)
    qv, kv, vv, bv = (_chunk_view(x, plan) for x in (q, k, v, beta))
    e, tot = _decay_logs(g, plan)

    # Tile-level factors from one small matmul (see _consts), floored where
    # they only ever shrink a term, then one exp2.
    ex = torch.mm(c.coef, tot.view(I, X * K)).view(-1, X, K)
    ex[: 2 * I + 1].clamp_min_(_LOG2_FLOOR)
    ex = torch.exp2(ex, out=ex)
    start = ex[:I].transpose(0, 1)  # [X, I, K] exp(eps_{i-1})
    to_end = ex[I : 2 * I].transpose(0, 1)  # [X, I, K] exp(Gamma_C - eps_i)
    decay = ex[2 * I]  # [X, K] exp(Gamma_C)
    lastf = ex[2 * I + 1 :].transpose(0, 1)  # [X, I, K] exp(tau_i) >= e^-80
    del tot

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=q.device)

    def tiles(x: torch.Tensor) -> torch.Tensor:  # chunk buffer [X, .., D] -> [*pre, I, R, D]
        return x.view(*pre, I, R, x.shape[-1])

    def src_tiles(x: torch.Tensor) -> torch.Tensor:  # input view [*pre, C, D] -> [*pre, I, R, D]
        return x.unflatten(-2, (I, R))

    # Per-token factors. Rows: exp(Gamma_t - eps_{i-1}) in [e^-80, 1]; own-tile
    # columns exp(eps_{i-1} - Gamma_s) in [1, e^80]; columns seen from later
    # tiles and by the state update: exp(eps_i - Gamma_s) in [e^-80, 1].
    e_t = tiles(e)
    rows = new(X, I, 2, R, K)  # q and k rows of each tile side by side
    rq, rk = rows[:, :, 0], rows[:, :, 1]  # [X, I, R, K] views
    torch.mul(src_tiles(qv), e_t, out=rq.view(*pre, I, R, K))
    torch.mul(src_tiles(kv), src_tiles(bv.unsqueeze(-1)), out=rk.view(*pre, I, R, K)).mul_(e_t)
    kcd = new(X, I, R, K)
    torch.div(src_tiles(kv), e_t, out=tiles(kcd))
    kc2 = torch.mul(kcd, lastf.unsqueeze(2), out=new(X, I, R, K))
    kdec = torch.mul(kc2, to_end.unsqueeze(2), out=new(X, I, R, K)).view(X, C, K)

    # Only the diagonal tiles of Aqk and A are ever formed (one small matmul):
    # the rest enters through tile-level states. Aqk[t, t] = (q_t e_t) . (k_t / e_t)
    # = q_t . k_t up to rounding; the backward treats it as exactly q_t . k_t.
    ad = torch.bmm(rows.view(X * I, 2 * R, K), kcd.view(X * I, R, K).transpose(1, 2)).view(X * I, 2, R, R)
    ad[:, 0].mul_(c.lower_RR)
    ad[:, 1].mul_(c.strict_RR)  # diag(beta) A_strict
    dinv = _tile_inverses(ad[:, 1]).view(X, I, R, R)
    if not keep:
        del e, e_t, kcd

    # [W, U0] = (I + diag(beta) A_strict)^-1 [beta * K_gamma, beta * V], in place.
    wu0 = new(X, C, K + V)
    torch.mul(rk, start.unsqueeze(2), out=wu0[..., :K].view(X, I, R, K))
    torch.mul(src_tiles(vv), src_tiles(bv.unsqueeze(-1)), out=tiles(wu0[..., K:]))
    _solve_lower_(rk, kc2, lastf, dinv, wu0)
    if not keep:
        del dinv
    w, u0 = wu0[..., :K], wu0[..., K:]
    mb = torch.bmm(kdec.transpose(1, 2), wu0)  # [K_dec^T W, K_dec^T U0]
    m = mb[..., :K].neg()
    m.diagonal(dim1=1, dim2=2).add_(decay)
    if not keep:
        del kdec

    entry, final = _state_loop(m, mb[..., K:], state0.reshape(-1, K, V), plan.step_counts, H)
    del mb
    u = torch.baddbmm(u0, w, entry, alpha=-1.0)

    # Outputs from tile-level states H_i = exp(eps_{i-1}) S + sum_{j<i} exp(eps_{i-1} - eps_j) kc2_j^T u_j
    # (H_0 = S, H_{i+1} = exp(tau_i) H_i + kc2_i^T u_i): o_t = (q_t e_t) H_i + own-tile Aqk times u.
    u_t = u.view(X * I, R, V)
    hst = new(X, I, K, V)
    z = torch.bmm(kc2.view(X * I, R, K).transpose(1, 2), u_t).view(X, I, K, V)  # (last tile's unused)
    hst[:, 0] = entry
    for i in range(I - 1):
        torch.addcmul(z[:, i], hst[:, i], lastf[:, i].unsqueeze(-1), out=hst[:, i + 1])
    del z
    o = torch.bmm(rq.reshape(X * I, R, K), hst.view(X * I, K, V))
    o.baddbmm_(ad[:, 0], u_t)
    saved = None
    if keep:
        saved = _Saved(
            qv, kv, vv, bv, e, rows, kcd, kc2, lastf, to_end, decay, ad, dinv, wu0, kdec, m, entry, u, hst
        )
    return o.view(X, C, V), final, saved


def _state_loop(
    m_XKK: torch.Tensor, add_XKV: torch.Tensor, state_YKV: torch.Tensor, step_counts: Tuple[int, ...], H: int,
    reverse: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The sequential part: S <- m S + add, one chunk step at a time.

    Forward (reverse=False): state_YKV enters step 0; returns the state
    entering every chunk [X, K, V] and the states after each sequence's last
    chunk [Y, K, V]. Reverse: m is applied transposed, state_YKV is the
    gradient of the final states; returns the gradient of every chunk's exit
    state [X, K, V] and of the initial states [Y, K, V].

    Chunks are step-major and sequences sorted so that the ones still running
    at step j are the first step_counts[j]; the others keep their state.
    """
    Y, K, V = state_YKV.shape
    X = m_XKK.shape[0]
    steps = range(len(step_counts) - 1, -1, -1) if reverse else range(len(step_counts))
    if all(cnt * H == Y for cnt in step_counts):
        # Every sequence has every chunk: states live in one buffer, no copies.
        J = len(step_counts)
        buf = torch.empty(J + 1, Y, K, V, device=state_YKV.device)
        m_J = m_XKK.view(J, Y, K, K)
        if reverse:
            m_J = m_J.transpose(-1, -2)
        add_J = add_XKV.view(J, Y, K, V).unbind(0)
        m_J = m_J.unbind(0)
        buf[J if reverse else 0] = state_YKV
        bufs = buf.unbind(0)
        for j in steps:
            src, dst = (j + 1, j) if reverse else (j, j + 1)
            torch.baddbmm(add_J[j], m_J[j], bufs[src], out=bufs[dst])
        if reverse:
            return buf[1:].view(X, K, V), buf[0]
        return buf[:J].view(X, K, V), buf[J]

    offsets = [0]
    for cnt in step_counts:
        offsets.append(offsets[-1] + cnt * H)
    cur = state_YKV.clone()
    per_chunk = torch.empty(X, K, V, device=state_YKV.device)
    for j in steps:
        lo, hi = offsets[j], offsets[j + 1]
        rows = hi - lo
        snap = per_chunk[lo:hi]
        snap.copy_(cur[:rows])
        m = m_XKK[lo:hi].transpose(-1, -2) if reverse else m_XKK[lo:hi]
        torch.baddbmm(add_XKV[lo:hi], m, snap, out=cur[:rows])
    return per_chunk, cur
