"""The routed experts of a MoE layer (``kimik3.model.moe.RoutedExperts``) for a few tokens, in two Triton kernels
and no sort: the serving decode step (1 to ~64 tokens, K = 4..16), forward only.

Per token t and each of its K experts e = ids[t, k] (a token may name one expert more than once: each occurrence
counts), in fp32 (fp64 is not taken):

    gate = x[t] @ w_gate[e]    up = x[t] @ w_up[e]                         (fp32 accumulation)
    h[t, k] = situ_glu(gate, up) * weights[t, k], rounded to x's dtype    (as the reference before W_down)
    y[t] = sum over k of h[t, k] @ w_down[e]                              (one fp32 accumulator over F and k)

stored in x's dtype. Weights of another dtype than x are rounded to x's dtype as they are read (the reference's
``w.to(x.dtype)``). Unlike the reference's bf16 path, gate, up and the K per-expert outputs are not rounded to
bf16 on the way (they stay in fp32 registers), so the result is at least as close to an fp32 computation.

At a few tokens the expert matmuls are GEMVs bound by weight bandwidth: each chosen expert's three matrices are
read once per token that chose it (no grouping of the tokens of one expert, which would need the sort). Kernel 1
has a program per (routed row, F block): it walks L in chunks, multiplying x's chunk into the [L chunk, F block]
tiles of w_gate[e] and w_up[e] (a broadcast multiply into a 2-D fp32 accumulator, reduced over L once at the end),
applies SiTU-GLU (``kimik3.ops.glue.situ``'s overflow-free tanh and sigmoid) and the row weight, and writes the
hidden row block [T K, F] in x's dtype. Kernel 2 has a program per (token, L block): it walks the token's K
experts and F in chunks, accumulating hidden[t K + k] @ w_down[e][:, L block] in fp32, and writes y[t, L block].

An id outside 0..E-1 (e.g. -1 for a padding row of a CUDA graph's fixed batch) contributes nothing, and its rows
read no weights (masked loads; ids are not checked otherwise: reading them would be a host sync). Shapes decide
everything at launch (block sizes from T, L and F; L, F and K are compile-time constants), so the call can be
captured in a CUDA graph and replayed with new x, weights and ids. Strides: any, for every input (unit strides
along the rows' last dims are what keeps the loads vectorised).

Legend: T tokens, K experts per token, E experts, L latent width, F expert hidden width, R = T K routed rows.
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import _jit, check_triton_device, describe, on_device, tl, triton
from kimik3.ops.glue.situ import _sigmoid_parts, _tanh_sech2

__all__ = ["SMALL_BATCH_MAX_ROWS", "routed_experts_small"]

# Up to how many routed rows (T K) this path is meant; beyond, the sorted grouped matmuls read each expert's weights
# once for all its rows. A suggestion for the caller, to be tuned on a GPU: nothing here enforces it.
SMALL_BATCH_MAX_ROWS = 256

# Both kernels are bound by how many weight bytes are in flight, so their blocks are chosen to give the grid at
# least TARGET_PROGRAMS programs (an H100 / H200 has 132 SMs) and each program a large tile (a loop step's loads;
# the H100 sweep that chose these is in benchmarks/NOTES-serve.md).
# Kernel 1 (gate and up): a program's F block, halved from GATE_BLOCK_F_MAX to GATE_BLOCK_F_MIN while the grid is
# short of the target, and the L chunk of one loop step filling GATE_TILE_ELEMS. K3's F = 3072 gives 48 F blocks
# of 64, so one token's 16 rows make 768 programs at [64, 64] tiles (a 64-element row segment is a whole 128-byte
# line in bf16); the debug preset's 4 rows of F = 384 make 48 programs at [128, 32] tiles instead of 24.
GATE_BLOCK_F_MAX = 64
GATE_BLOCK_F_MIN = 32
GATE_TILE_ELEMS = 4096
# Kernel 2 (down): the L block (the grid's second axis) is halved from the max down to the min while the grid is
# short of the target: at one token K3's L = 3584 gives 56 programs at 64, 224 at 16. The F chunk of one loop step
# fills DOWN_TILE_ELEMS elements (64 a thread at 4 warps): [512, 16] tiles at L blocks of 16, which keep twice the
# bytes of [256, 16] in flight a program when the grid cannot grow.
DOWN_BLOCK_L_MAX = 64
DOWN_BLOCK_L_MIN = 16
DOWN_TILE_ELEMS = 8192
TARGET_PROGRAMS = 256
NUM_WARPS = 4

_DTYPES = (torch.float32, torch.bfloat16)


def _blocks(T: int, R: int, L: int, F: int) -> tuple[int, int, int, int]:
    """(gate BLOCK_L, gate BLOCK_F, down BLOCK_L, down BLOCK_F) for T tokens of R routed rows, from the shapes only
    (see the constants above)."""
    gate_f = min(GATE_BLOCK_F_MAX, triton.next_power_of_2(F))
    while gate_f > GATE_BLOCK_F_MIN and R * triton.cdiv(F, gate_f) < TARGET_PROGRAMS:
        gate_f //= 2
    gate_l = min(triton.next_power_of_2(L), GATE_TILE_ELEMS // gate_f)
    down_l = min(DOWN_BLOCK_L_MAX, triton.next_power_of_2(L))
    while down_l > DOWN_BLOCK_L_MIN and T * triton.cdiv(L, down_l) < TARGET_PROGRAMS:
        down_l //= 2
    down_f = max(1, min(triton.next_power_of_2(F), DOWN_TILE_ELEMS // down_l))
    return gate_l, gate_f, down_l, down_f


def _check(x_TL, weights_TK, ids_TK, w_gate_ELF, w_up_ELF, w_down_EFL) -> None:
    named = {"x_TL": x_TL, "weights_TK": weights_TK, "ids_TK": ids_TK, "w_gate_ELF": w_gate_ELF,
             "w_up_ELF": w_up_ELF, "w_down_EFL": w_down_EFL}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if x_TL.ndim != 2 or x_TL.shape[1] < 1:
        raise ValueError(f"x_TL must be 2-D [T, L] with L >= 1, got {describe(x_TL)}")
    if w_gate_ELF.ndim != 3 or min(w_gate_ELF.shape) < 1:
        raise ValueError(f"w_gate_ELF must be 3-D [E, L, F] with E, L, F >= 1, got {describe(w_gate_ELF)}")
    T, L = x_TL.shape
    E, L_w, F = w_gate_ELF.shape
    if L_w != L:
        raise ValueError(f"w_gate_ELF [E, L, F] has L = {L_w} but x_TL [T, L] has L = {L}")
    if w_up_ELF.shape != w_gate_ELF.shape:
        raise ValueError(f"w_up_ELF must have w_gate_ELF's shape {tuple(w_gate_ELF.shape)}, got {describe(w_up_ELF)}")
    if w_down_EFL.shape != (E, F, L):
        raise ValueError(f"w_down_EFL must be [E, F, L] = {(E, F, L)}, got {describe(w_down_EFL)}")
    if ids_TK.ndim != 2 or ids_TK.shape[0] != T:
        raise ValueError(f"ids_TK must be 2-D [T={T}, K], got {describe(ids_TK)}")
    if weights_TK.shape != ids_TK.shape:
        raise ValueError(f"weights_TK must have ids_TK's shape {tuple(ids_TK.shape)}, got {describe(weights_TK)}")
    if ids_TK.dtype != torch.int64:
        raise ValueError(f"ids_TK must be int64 (the router's ids), got {ids_TK.dtype}")
    if weights_TK.dtype != torch.float32:
        raise ValueError(f"weights_TK must be fp32 (the router's mixture weights), got {weights_TK.dtype}")
    for name in ("x_TL", "w_gate_ELF", "w_up_ELF", "w_down_EFL"):
        if named[name].dtype not in _DTYPES:
            raise ValueError(f"{name} must be fp32 or bf16, got {named[name].dtype}")
    for name, t in named.items():
        if t.device != x_TL.device:
            raise ValueError(f"{name} is on {t.device} but x_TL on {x_TL.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in named.values()):
        raise RuntimeError("routed_experts_small is forward only (inference): call it under torch.no_grad() or "
                           "torch.inference_mode(), or with inputs that do not require grad")
    check_triton_device(x_TL, "routed_experts_small")


@torch.compiler.disable  # an opaque kernel call to torch.compile: traced, its launcher breaks on symbolic sizes
def routed_experts_small(x_TL: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                         w_gate_ELF: torch.Tensor, w_up_ELF: torch.Tensor, w_down_EFL: torch.Tensor) -> torch.Tensor:
    """``RoutedExperts.forward`` for a few tokens without a sort: y_TL [T, L] in x's dtype, contiguous.

    x_TL [T, L] fp32 or bf16; weights_TK [T, K] fp32 (the mixture weights); ids_TK [T, K] int64 (experts, repeats
    allowed; ids outside 0..E-1 contribute nothing); w_gate_ELF, w_up_ELF [E, L, F] and w_down_EFL [E, F, L], fp32
    or bf16 (rounded to x's dtype as read). All on one device: CUDA, or CPU when the kernels were decorated under
    TRITON_INTERPRET=1. Any strides. Forward only: raises when grad is enabled and an input requires grad. Two
    launches (none at T = 0 or K = 0), no host sync; see the module docstring for the math.
    """
    _check(x_TL, weights_TK, ids_TK, w_gate_ELF, w_up_ELF, w_down_EFL)
    T, L = x_TL.shape
    E, _, F = w_gate_ELF.shape
    K = ids_TK.shape[1]
    dev = x_TL.device
    if T == 0 or K == 0:
        return torch.zeros(T, L, dtype=x_TL.dtype, device=dev)
    hidden_RF = torch.empty(T * K, F, dtype=x_TL.dtype, device=dev)
    y_TL = torch.empty(T, L, dtype=x_TL.dtype, device=dev)
    gate_l, gate_f, down_l, down_f = _blocks(T, T * K, L, F)
    with on_device(dev):
        _gate_up_kernel[(T * K, triton.cdiv(F, gate_f))](
            x_TL, x_TL.stride(0), x_TL.stride(1),
            ids_TK, ids_TK.stride(0), ids_TK.stride(1),
            weights_TK, weights_TK.stride(0), weights_TK.stride(1),
            w_gate_ELF, *w_gate_ELF.stride(), w_up_ELF, *w_up_ELF.stride(),
            hidden_RF, E,
            K=K, L=L, F=F, BLOCK_L=gate_l, BLOCK_F=gate_f, num_warps=NUM_WARPS,
        )
        _down_kernel[(T, triton.cdiv(L, down_l))](
            hidden_RF, ids_TK, ids_TK.stride(0), ids_TK.stride(1),
            w_down_EFL, *w_down_EFL.stride(), y_TL, E,
            K=K, L=L, F=F, BLOCK_F=down_f, BLOCK_L=down_l, num_warps=NUM_WARPS,
        )
    return y_TL


@_jit
def _gate_up_kernel(
    x_ptr, s_xt, s_xl, ids_ptr, s_it, s_ik, rw_ptr, s_rt, s_rk,
    wg_ptr, s_ge, s_gl, s_gf, wu_ptr, s_ue, s_ul, s_uf, h_ptr, E,
    K: tl.constexpr, L: tl.constexpr, F: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Program (routed row r = t K + k, F block): h[r, F block] = situ_glu(x[t] @ w_gate[e], x[t] @ w_up[e])
    * weights[t, k] with e = ids[t, k], in x's dtype; zero for an id outside 0..E-1 (its weights unread)."""
    r = tl.program_id(0)
    t = r // K
    k = r - t * K
    e = tl.load(ids_ptr + t.to(tl.int64) * s_it + k * s_ik)
    valid = (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    row_w = tl.load(rw_ptr + t.to(tl.int64) * s_rt + k * s_rk, mask=valid, other=0.0).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = (cols < F) & valid
    g_base = wg_ptr + e * s_ge + cols[None, :] * s_gf
    u_base = wu_ptr + e * s_ue + cols[None, :] * s_uf
    x_row = x_ptr + t.to(tl.int64) * s_xt
    acc_g = tl.zeros([BLOCK_L, BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_L, BLOCK_F], dtype=tl.float32)
    for l0 in tl.range(0, L, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        lmask = ls < L
        ls64 = ls.to(tl.int64)
        xv = tl.load(x_row + ls64 * s_xl, mask=lmask, other=0.0).to(tl.float32)
        m = lmask[:, None] & cmask[None, :]
        # (weights rounded to x's dtype, as the reference's w.to(x.dtype); a no-op when the dtypes agree)
        wg = tl.load(g_base + ls64[:, None] * s_gl, mask=m, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        wu = tl.load(u_base + ls64[:, None] * s_ul, mask=m, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc_g += xv[:, None] * wg
        acc_u += xv[:, None] * wu
    gate = tl.sum(acc_g, axis=0)
    up = tl.sum(acc_u, axis=0)
    tg, _ = _tanh_sech2(gate * 0.25, False)
    tu, _ = _tanh_sech2(up / 25.0, False)
    s, _ = _sigmoid_parts(gate)
    h = (4.0 * tg * s) * (25.0 * tu) * row_w
    tl.store(h_ptr + r.to(tl.int64) * F + cols, h.to(h_ptr.dtype.element_ty), mask=cols < F)


@_jit
def _down_kernel(
    h_ptr, ids_ptr, s_it, s_ik, wd_ptr, s_de, s_df, s_dl, y_ptr, E,
    K: tl.constexpr, L: tl.constexpr, F: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Program (token t, L block): y[t, L block] = sum over k of h[t K + k] @ w_down[ids[t, k]][:, L block], one
    fp32 accumulator over k and F (one loop over the K x F chunks, so that its loads pipeline across experts);
    experts outside 0..E-1 are skipped (masked: their weights unread)."""
    NF: tl.constexpr = (F + BLOCK_F - 1) // BLOCK_F
    t = tl.program_id(0).to(tl.int64)
    ls = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = ls < L
    acc = tl.zeros([BLOCK_F, BLOCK_L], dtype=tl.float32)
    for i in tl.range(0, K * NF):
        k = i // NF
        fs = (i - k * NF) * BLOCK_F + tl.arange(0, BLOCK_F)
        e = tl.load(ids_ptr + t * s_it + k * s_ik)
        valid = (e >= 0) & (e < E)
        e = tl.where(valid, e, 0)
        fmask = (fs < F) & valid
        fs64 = fs.to(tl.int64)
        hv = tl.load(h_ptr + (t * K + k) * F + fs64, mask=fmask, other=0.0).to(tl.float32)
        w = tl.load(wd_ptr + e * s_de + fs64[:, None] * s_df + ls[None, :] * s_dl,
                    mask=fmask[:, None] & lmask[None, :], other=0.0)
        acc += hv[:, None] * w.to(h_ptr.dtype.element_ty).to(tl.float32)
    y = tl.sum(acc, axis=0)
    tl.store(y_ptr + t * L + ls, y.to(y_ptr.dtype.element_ty), mask=lmask)
