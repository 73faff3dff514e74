"""What the Triton stages of KDA share: launch grids, chunk and sequence indexing, the state tiles of the scans and
the 16-bit hi / lo split (every helper is inlined by the compiler).

Chunk-local kernels split into parts (the forward's four column tiles of A and its K / V blocks of W, U; the
backward's WY partials and intra key blocks) read the same chunk tiles in every part. Their parts run innermost on
grid axis 0 (``part_grid`` / ``_chunk_part``), so a chunk's parts are scheduled together and share those reads
through L2.
"""

from __future__ import annotations

import triton
import triton.language as tl


def part_grid(NT: int, H: int, NP: int) -> tuple:
    """Launch grid for NT chunks x H heads x NP parts per (chunk, head); the kernel reads its indices with
    ``_chunk_part``."""
    return (NT * NP, H)


@triton.jit
def _scan_program(cu_ptr, coff_ptr, H, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr):
    """A scan program (V block, sequence x head): its head, its sequence's token range [bos, eos) and
    first global chunk, the state columns (ck over K, cv over this V block) and the offsets and mask
    of its [K, V] state tile in an [N, H, K, V] tensor."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + i_n).to(tl.int64)
    ck = tl.arange(0, BKF)
    cv = i_v * BV + tl.arange(0, BV)
    s_off = (i_n * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    sm = (ck < K)[:, None] & (cv < V)[None, :]
    return i_h, bos, eos, coff, ck, cv, s_off, sm


@triton.jit
def _state_tile(ptr, s_off, sm, HAS: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr):
    """A scan program's starting [BKF, BV] fp32 tile: loaded from ``ptr`` (an initial state or its
    gradient) when the caller has one, else zeros."""
    if HAS:
        return tl.load(ptr + s_off, mask=sm, other=0.0).to(tl.float32)
    return tl.zeros([BKF, BV], dtype=tl.float32)


@triton.jit
def _load_rows(ptr, row_off, rmask, c0, climit, B: tl.constexpr):
    """[R, B] tile: element (r, c) at ptr + row_off[r] + c0 + c, masked by rmask[r] and c0 + c < climit (0 where
    masked). The WY backward kernel's form: with the equivalent [R, B] offsets its sm_90 code differs."""
    c = tl.arange(0, B)
    return tl.load(ptr + row_off[:, None] + c0 + c[None, :], mask=rmask[:, None] & (c0 + c < climit)[None, :],
                   other=0.0)


@triton.jit
def _chunk_part(NP: tl.constexpr):
    """(global chunk i_t as int64, head, part in [0, NP)) of a program launched on ``part_grid``."""
    pid = tl.program_id(0)
    return (pid // NP).to(tl.int64), tl.program_id(1), pid % NP


@triton.jit
def _chunk_bounds(i_t, cidx_ptr, cu_ptr, C: tl.constexpr = 64):
    """Chunk i_t of a plan of C-token chunks (global chunk index): its first token and its number of valid tokens
    (<= C). Per-chunk buffers ([NT, ...]) are indexed by i_t: it equals chunk_off[n] + (chunk within n)."""
    i_n = tl.load(cidx_ptr + 2 * i_t).to(tl.int64)
    i_c = tl.load(cidx_ptr + 2 * i_t + 1).to(tl.int64)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    t0 = bos + i_c * C
    return t0, tl.minimum(C, eos - t0)


@triton.jit
def _chunk_block(i_t, i_h, i_b, cidx_ptr, cu_ptr, H, D: tl.constexpr, B: tl.constexpr):
    """Chunk i_t's [64, B] tile of head i_h at columns block i_b in a [.., H, D] tensor (token layout): the
    chunk's first token, its rows and valid-row mask, the columns and their mask, the tile's mask and
    offsets."""
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    r = tl.arange(0, 64)
    c = i_b * B + tl.arange(0, B)
    rv = r < L
    cm = c < D
    return t0, r, rv, c, cm, rv[:, None] & cm[None, :], (t0 + r)[:, None] * (H * D) + i_h * D + c[None, :]


@triton.jit
def _chunk_columns(i_t, i_h, i_b, cidx_ptr, cu_ptr, H, D: tl.constexpr, B: tl.constexpr):
    """Chunk i_t's first token and valid length, and column block i_b of head i_h in a [.., H, D] tensor (token
    layout): the B columns, their mask, and their offsets in the chunk's first row (the next row H D further)."""
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    c = i_b * B + tl.arange(0, B)
    return t0, L, c, c < D, (t0 * H + i_h) * D + c


@triton.jit
def _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H):
    """``_chunk_bounds`` of chunk i_t, its 64 row indices, and head i_h's beta on them (fp32, 0 past L)."""
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    r = tl.arange(0, 64)
    beta = tl.load(beta_ptr + (t0 + r) * H + i_h, mask=r < L, other=0.0).to(tl.float32)
    return t0, L, r, beta


@triton.jit
def _chunk_tiles(i_c, bos, eos, i_h, H, K: tl.constexpr, V: tl.constexpr, ck, cv):
    """Chunk i_c of a sequence: its 64 row indices, the valid-row mask, the token-layout offsets and
    masks of its [64, K] and [64, V] tiles."""
    r = tl.arange(0, 64)
    t0 = bos + i_c * 64
    rv = r < tl.minimum(64, eos - t0)
    mk = rv[:, None] & (ck < K)[None, :]
    mv = rv[:, None] & (cv < V)[None, :]
    ko = (t0 + r)[:, None] * (H * K) + i_h * K + ck[None, :]
    vo = (t0 + r)[:, None] * (H * V) + i_h * V + cv[None, :]
    return r, rv, mk, mv, ko, vo


@triton.jit
def _split16(x, DT: tl.constexpr):
    """fp32 x as a 16-bit high part and the 16-bit remainder (hi + lo holds ~16 mantissa bits)."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)
