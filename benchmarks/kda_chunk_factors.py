"""Numerics of a chunk-level intra backward (a design for a Gluon kernel; NOTES-kda.md, seventeenth session).

    python benchmarks/kda_chunk_factors.py [--seeds 3]        # CPU, a few seconds

One chunk (64 tokens, K = 128): the intra-chunk sums the backward's kernel 4 computes (dq's row part, the gradient x
of beta k, dk's column part) evaluated three ways: in fp64 directly (the reference), in fp32 as the Triton "rows"
kernel does (per row tile i and column tile j, exponents referenced at tile i's first or last token), and in fp32
in the chunk form with factor recurrences: one [64, 16] x [16, K] product per column tile, whose row tiles are
rescaled by per-column factors e^(Gamma_j0 - Gamma_(j-1)0) <= 1 as the loop passes them, so that no exponential is
taken per element of a [64, K] tile. Prints each form's largest relative error for random gates, every gate at the
bound (-5) and a mix, and fails if a form is not finite.
"""

import argparse
import sys

import torch


def ref(q, k, G, beta, daqk, da):
    """The three sums in fp64, directly: every (t, s, column) factor e^(Gamma_t - Gamma_s)."""
    q, k, G, beta, daqk, da = (x.double() for x in (q, k, G, beta, daqk, da))
    decay = torch.exp(G[:, None, :] - G[None, :, :])  # [t, s, column]
    lower = torch.tril(torch.ones(64, 64, dtype=torch.float64))
    strict = torch.tril(lower, -1)
    dq = torch.einsum("ts,tsc,sc->tc", daqk * lower, decay, k)
    x = torch.einsum("ts,tsc,sc->tc", da * strict, decay, k)
    dk = torch.einsum("ts,tsc,tc->sc", daqk * lower, decay, q) \
        + torch.einsum("ts,tsc,tc->sc", da * strict, decay, beta[:, None] * k)
    return dq, x, dk


def _tile(i):
    return slice(16 * i, 16 * i + 16)


def rows_form(q, k, G, beta, daqk, da):
    """fp32, as the Triton "rows" kernel: per row tile i and column tile j, references at tile i's first token (row
    side) or last token (column side)."""
    dq, x, dk = (torch.zeros_like(q) for _ in range(3))
    for i in range(4):
        ti = _tile(i)
        g_first, g_last = G[16 * i], G[16 * i + 15]
        acc_q, acc_b, acc_c = (torch.zeros(16, q.shape[1]) for _ in range(3))
        for j in range(i + 1):
            kc = k[_tile(j)] * torch.exp(g_first - G[_tile(j)])
            acc_q += daqk[ti, _tile(j)] @ kc
            acc_b += da[ti, _tile(j)] @ kc
        for m in range(i, 4):
            tm = _tile(m)
            f = torch.exp(G[tm] - g_last)
            acc_c += daqk[tm, ti].T @ (q[tm] * f) + da[tm, ti].T @ (beta[tm, None] * k[tm] * f)
        dq[ti] = acc_q * torch.exp(G[ti] - g_first)
        x[ti] = acc_b * torch.exp(G[ti] - g_first)
        dk[ti] = acc_c * torch.exp(g_last - G[ti])
    return dq, x, dk


def chunk_form(q, k, G, beta, daqk, da):
    """fp32, 64-row products with factor recurrences: no exponential per element of a [64, K] tile besides the last
    two (each row against its own tile's reference)."""
    row_tile = torch.arange(64) // 16
    g_first, g_last = G[0::16], G[15::16]  # [4, K]: Gamma at each tile's first and last token
    acc_q, acc_b = torch.zeros_like(q), torch.zeros_like(q)
    for j in range(4):  # row side: the reference moves forward a tile at a time, for the row tiles it has reached
        kc = k[_tile(j)] * torch.exp(g_first[j] - G[_tile(j)])  # factors in [1, e^75]
        if j:
            step = torch.exp(g_first[j] - g_first[j - 1])  # per column, <= 1
            reached = (row_tile >= j)[:, None]
            acc_q = torch.where(reached, acc_q * step, acc_q)
            acc_b = torch.where(reached, acc_b * step, acc_b)
        acc_q = acc_q + daqk[:, _tile(j)] @ kc
        acc_b = acc_b + da[:, _tile(j)] @ kc
    acc_c = torch.zeros_like(q)
    for m in range(3, -1, -1):  # column side: the reference moves back a tile at a time
        tm = _tile(m)
        f = torch.exp(G[tm] - g_last[m])  # in [1, e^75]
        if m < 3:
            acc_c = torch.where((row_tile <= m)[:, None], acc_c * torch.exp(g_last[m + 1] - g_last[m]), acc_c)
        acc_c = acc_c + daqk[tm, :].T @ (q[tm] * f) + da[tm, :].T @ (beta[tm, None] * k[tm] * f)
    to_first = torch.exp(G - g_first[row_tile])
    return acc_q * to_first, acc_b * to_first, acc_c * torch.exp(g_last[row_tile] - G)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args(argv)
    gates = [("random gates", lambda: -torch.rand(64, 128) * 5),
             ("all at the bound", lambda: torch.full((64, 128), -5.0)),
             ("mixed", lambda: torch.where(torch.rand(64, 128) < 0.5, -5.0, -0.01))]
    for name, gate in gates:
        errs = {"rows": [], "chunk": []}
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            q = torch.nn.functional.normalize(torch.randn(64, 128), dim=-1)
            k = torch.nn.functional.normalize(torch.randn(64, 128), dim=-1)
            G = gate().cumsum(0)
            beta = torch.rand(64)
            daqk = torch.randn(64, 64).tril()
            da = torch.randn(64, 64).tril(-1)
            r = ref(q, k, G, beta, daqk, da)
            for form, fn in (("rows", rows_form), ("chunk", chunk_form)):
                out = fn(q, k, G, beta, daqk, da)
                if not all(torch.isfinite(o).all() for o in out):
                    raise SystemExit(f"{name}: the {form} form is not finite")
                errs[form].append(max(rel(o, t) for o, t in zip(out, r)))
        print(f"{name}: largest relative error of dq_row / x / dk_col over {args.seeds} seeds: "
              f"rows form {max(errs['rows']):.2e}, chunk form {max(errs['chunk']):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
