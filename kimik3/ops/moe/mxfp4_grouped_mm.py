"""Grouped matmul over MXFP4 expert weights: ``y[r] = x[r] @ dequantize(W)[e(r)]`` for rows sorted by expert, the
weights read packed (E2M1 codes two a byte, E8M0 scales one per 32 elements along I) and decoded on the device.

The weight is an ``MXTensor``, ``to_kernel_order(quantize(w_EIO, "mxfp4", axis=-2))``: codes [E, O, I/2] (uint8,
two elements a byte, each 32-bit word's bits in kernel order, ``kimik3.quant.kernel_order``, which the kernels decode
in nine integer operations a word of eight) and scales [E, O, I/32] (uint8 E8M0 codes, 2^(code - 127), 255 = NaN),
i.e. blocks along I, the reduction axis. At 4.25 bits an element they are 3.8x smaller than bf16, which is what a decode
step's expert matmuls (a few rows an expert, bound by weight bandwidth) gain.

Four routes, chosen from the shapes and the device (``mxfp4_route``):

- **mma** (bf16 activations, decode sizes, compute capability >= 9.0): Gluon kernels that decode the weights
  straight into the tensor cores' operand registers and multiply y^T = W x^T: on Hopper up to 64 rows an expert
  with ``wgmma``, warp-specialised, x's tiles and the codes streamed into shared memory by TMA
  (kimik3/ops/moe/mxfp4_wgmma.py); on later GPUs up to 8 rows an expert on ``mma.sync`` (mxfp4_mma.py); ~4
  instructions a weight element where the kernels below take ~6-7.
- **gemv** (at most one row an expert on average: a decode step's experts): a Triton kernel whose program takes
  one row and a [BLOCK_N] column tile of its expert, decodes [BLOCK_N, BLOCK_K] weight tiles in registers as the
  registers route does, and multiplies them with the row on the CUDA cores (fp32 products summed per column once,
  after the loop). No tile of rows is padded to tl.dot's 16, and the small column tiles give many programs, each
  with the next iteration's codes already in flight (loaded one iteration ahead): what a weight-bandwidth-bound
  step needs. Rows that share an expert each read its weights (from L2 after the first).
- **registers** (from the mma route's rows up to ``DEQUANTIZE_ROWS``, and fp32 activations): a Triton kernel (CUDA;
  CPU tensors under TRITON_INTERPRET=1 for the tests) whose programs decode their [BLOCK_N, BLOCK_K] weight tile to
  bf16 in registers (``mxfp4_dequantize.decode_words``: the codes read as int32 words, two elements placed by one to
  four integer operations, the tile's columns in a bit-reversed order within each 8 that x's tile is put in too) and
  multiply it as ``tl.dot``'s A operand, y^T = W x^T (bf16 operands, fp32 accumulation; fp32 activations take the
  tile converted to fp32 into an IEEE fp32 dot). On Hopper that operand goes to wgmma from registers, and x's rows are
  the instruction's N (8 to 256), so a few rows an expert waste no tile. Hopper has no FP4 tensor cores; the weight
  bytes a step reads shrink 3.8x.
- **dequantize** (bf16 activations, at least ``DEQUANTIZE_ROWS`` rows an expert on average): the weights decoded
  once to bf16 (``mxfp4_dequantize``), then ``torch._grouped_mm``. Where a row tile of the registers route would
  decode each weight tile again for every row tile, and run its dot at half the tensor cores' rate behind the
  decode, this pays one pass over the weights in bf16 on top of the bf16 GEMM. It needs a transient bf16 copy of
  the weights (E x O x I x 2 bytes).

The gemv and registers kernels (and the mma one) load a weight tile's codes and scales one iteration ahead of their
decode (in registers: Triton's pipeliner stages only a dot's direct operands, and these go through the decode
first), so a program always has a tile's bytes in flight.

The registers kernel groups without a host sync: its grid is a fixed number of programs from the shapes only,
``M_TILES`` row tiles x ``cdiv(O, BLOCK_N)`` column tiles, with M_TILES = min(R, R // BLOCK_M + E + 1), a bound on
the row tiles of the E experts plus one more group, the rows past ``offsets_E[-1]`` (if any: they are written as
zeros, so the output is defined for a padded batch). Each program reads ``offsets_E`` (E + 1 values), computes each
group's tile count and their running sum (``tl.cumsum``), and finds its group and row range; programs past the real
tiles return at once. The gemv kernel's program finds its row's expert by counting the offsets at or below the
row. Offsets are clamped to 0..R as read (out-of-range offsets cannot make the kernel read or write
outside x or y; the result is then meaningless, not checked: that would be a host sync). Row tiles are ordered in
groups of ``GROUP_M`` within each column tile (the weight column block stays in L2 across an expert's row tiles, the
x rows across the column tiles of the group).

Shapes and the device decide everything at launch (the route and block sizes from R / E, O, I and the GPU's
compute capability), so the call can be captured in a CUDA graph and replayed with new x, weights and offsets.
Forward only.

The torch reference, and the CPU path, is ``dequantize`` + ``grouped_mm_loop``; ``mxfp4_backend`` makes the choice
(``glue_backend``'s: CUDA -> the kernel, CPU -> torch, ``backend=`` to force one).

Legend: R rows (sorted by expert), E experts, I in features (the reduction axis), O out features, H = I / 2 code
bytes a row, B = I / 32 scale blocks a row.
"""

from __future__ import annotations

import functools

import torch

from kimik3.ops.glue.common import _jit, check_triton_device, describe, glue_backend, on_device, tl, triton
from kimik3.ops.moe.grouped_mm import ExpertGroups, grouped_mm_loop
from kimik3.ops.moe.mxfp4_dequantize import (as_words, check_mxfp4_weight, decode_words, mxfp4_dequantize,
                                              permute_words)
from kimik3.ops.moe.mxfp8_rows import mma_width
from kimik3.quant.mx import BLOCK_SIZE, MXTensor, dequantize

__all__ = ["gemv_blocks", "mma_available", "mxfp4_backend", "mxfp4_blocks", "mxfp4_grouped_mm",
           "mxfp4_grouped_mm_reference", "mxfp4_mma_order", "mxfp4_route", "wgmma_available"]

_DTYPES = (torch.bfloat16, torch.float32)

# Block sizes by the mean rows an expert (R / E): BLOCK_M its next power of two, from DECODE_ROWS (the smallest tile
# tl.dot takes) to PREFILL_ROWS. The kernel multiplies y^T = W x^T, so the decoded weight tile is the dot's A operand,
# which Hopper's wgmma takes from registers, and the rows of x its N. Up to 64 rows an expert: BLOCK_K = 64, 4 warps,
# one stage (the codes are prefetched by hand) and BLOCK_N = 128 where that still gives WIDE_GRID programs (K3's
# 112 local experts on 8 GPUs), else 64 (8 experts: 128 would leave an H100's SMs with ~1.5 programs each). From 65
# rows: 128 x 128 x 64 at 4 warps. The fastest of a sweep at 8 and 112 experts, 16-512 rows an expert, 4 and 8
# warps, BLOCK_N 64-256, BLOCK_K 32-128 (benchmarks/NOTES-quant.md).
DECODE_ROWS = 16
PREFILL_ROWS = 128
WIDE_GRID = 1024
GROUP_M = 8
# From this many rows an expert on average (bf16 activations) the weights are decoded once and the bf16 grouped GEMM
# runs. Below it the registers route's single pass over the codes wins; above it, decoding every weight tile again
# for each row tile costs more than one decode pass plus the bf16 GEMM. At K3's shapes the two were level at 256 rows
# an expert (either faster, by call) and the registers route slower at 512, with 8 and with 112 experts
# (``benchmarks/mxfp4_experts.py`` times both; the figures are in benchmarks/NOTES-quant.md).
DEQUANTIZE_ROWS = 320
# The gemv route's tile: 16 weight rows x 256 elements (128 code bytes a row: four 32-byte sectors) over 4 warps, 16
# code bytes a thread an iteration; K3's O = 3072 over 8 local experts gives 1,536 programs at one row an expert. The
# fastest of a sweep of column tiles 16-128, 128-512 elements, 2-8 warps, 1-3 stages, with and without the prefetch
# and unrolled (benchmarks/NOTES-quant.md).
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS = 16, 256, 4
# Up to this many rows an expert on average (bf16 activations, a device ``mma_available`` says yes to) the mma route
# runs: the weights decoded into the tensor cores' operand registers. On Hopper (``wgmma_available``) up to MMA_ROWS,
# by ``mxfp4_wgmma`` (warp-specialised, wgmma); elsewhere up to SYNC_ROWS, by ``mxfp4_mma`` (mma.sync, 8 rows a
# pass). Above, the registers route is faster (benchmarks/mxfp4_experts.py, NOTES-quant.md).
SYNC_ROWS = 8
MMA_ROWS = 64
ROUTES = ("auto", "mma", "gemv", "registers", "dequantize")


def mxfp4_blocks(R: int, E: int, O: int, I: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from the shapes and the activations' dtype only (see the
    constants above). fp32 activations (a check, not a serving path) take an FMA dot, whose operand tiles live in
    registers: at most 32 x 64 x 32 (no spills on sm_90)."""
    rows = R / max(E, 1)
    block_m = DECODE_ROWS
    while block_m < PREFILL_ROWS and block_m < rows:
        block_m *= 2
    wide = block_m > 64 or max(E, 1) * triton.cdiv(O, 128) >= WIDE_GRID
    block_n, block_k, num_warps, num_stages = 128 if wide else 64, 64, 4, 1
    if dtype == torch.float32:
        block_m, block_n, block_k, num_warps, num_stages = min(block_m, 32), min(block_n, 64), 32, 4, 1
    block_n = max(16, min(block_n, triton.next_power_of_2(O)))
    block_k = max(32, min(block_k, triton.next_power_of_2(I)))
    return block_m, block_n, block_k, num_warps, num_stages


def gemv_blocks(O: int, I: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the gemv route: ``GEMV_*`` clipped to small O and I."""
    return (max(16, min(GEMV_BLOCK_N, triton.next_power_of_2(O))),
            max(32, min(GEMV_BLOCK_K, triton.next_power_of_2(I))), GEMV_WARPS)


def mma_available(device: torch.device) -> bool:
    """Whether the mma route can run on ``device``: a CUDA GPU of compute capability 9.0 or more (its bf16x2
    multiplies) and a Triton with Gluon. Cached per device (the decode path asks on every call)."""
    return device.type == "cuda" and _mma_available(device.index if device.index is not None else
                                                    torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _mma_available(index: int) -> bool:
    if triton is None or torch.cuda.get_device_capability(index) < (9, 0):
        return False
    from kimik3.ops.kda.dispatch import gluon_available

    return gluon_available()


def wgmma_available(device: torch.device) -> bool:
    """Whether the mma route runs ``mxfp4_wgmma`` on ``device``: ``mma_available`` on a Hopper GPU (compute
    capability 9.x; wgmma is not an instruction of later architectures, whose mma route keeps to mma.sync). Cached
    per device, as ``mma_available``."""
    return device.type == "cuda" and _wgmma_available(device.index if device.index is not None else
                                                      torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _wgmma_available(index: int) -> bool:
    return _mma_available(index) and torch.cuda.get_device_capability(index)[0] == 9


def mxfp4_route(R: int, E: int, O: int, dtype: torch.dtype, route: str = "auto", mma: bool = False,
                wgmma: bool = False) -> str:
    """"mma", "gemv", "registers" or "dequantize" for ``R`` rows over ``E`` experts of ``O`` outputs and ``dtype``
    activations (the module docstring says what each is); ``mma``: whether the device runs the mma route
    (``mma_available``), ``wgmma``: with ``mxfp4_wgmma`` (``wgmma_available``). "auto" takes "mma" for bf16 up to
    ``MMA_ROWS`` rows an expert on average where ``mxfp4_wgmma`` runs (``SYNC_ROWS`` where only mma.sync does),
    else "gemv" up to one row an expert (R <= E); "dequantize" for bf16 from ``DEQUANTIZE_ROWS`` rows an expert on
    average where ``torch._grouped_mm`` takes the shape (O a multiple of 8); "registers" between and for fp32
    activations, which never go through "mma" or "dequantize"."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    fits = dtype == torch.bfloat16 and O % 8 == 0
    if route == "dequantize" and not fits:
        raise ValueError(f"route 'dequantize' runs torch._grouped_mm in bf16: it takes bf16 activations and O a "
                         f"multiple of 8, got {dtype} and O = {O}")
    if route == "mma" and (dtype != torch.bfloat16 or not mma):
        raise ValueError(f"route 'mma' multiplies bf16 activations on a CUDA GPU of compute capability >= 9.0 with "
                         f"a Triton that has Gluon: got {dtype}{'' if mma else ' on a device without it'}")
    if route != "auto":
        return route
    if mma and dtype == torch.bfloat16 and R <= (MMA_ROWS if wgmma else SYNC_ROWS) * max(E, 1):
        return "mma"
    if R <= E:
        return "gemv"
    return "dequantize" if fits and R >= DEQUANTIZE_ROWS * max(E, 1) else "registers"


def mxfp4_backend(x_RI: torch.Tensor, backend: str = "auto") -> str:
    """"triton" or "torch" for ``mxfp4_grouped_mm`` on rows ``x_RI``: ``glue_backend``'s choice (CUDA tensors ->
    the kernel, CPU ones -> the reference; "triton" forces the kernel, which takes CPU tensors under the
    interpreter), with no width bound (the kernel loops over I)."""
    return glue_backend(x_RI, backend, max_width=max(1, x_RI.shape[-1]) if x_RI.ndim else 1)


def _offsets(groups, E: int, device: torch.device) -> torch.Tensor:
    if isinstance(groups, ExpertGroups):
        offsets_E = groups.offsets_E
        name = "groups.offsets_E"
    elif isinstance(groups, torch.Tensor):
        offsets_E = groups
        name = "offsets_E"
    else:
        raise ValueError(f"groups must be ExpertGroups or an int32 offsets tensor [E], got {type(groups).__name__}")
    if offsets_E.ndim != 1 or offsets_E.shape[0] != E:
        raise ValueError(f"{name} must be 1-D [E={E}] (the running row counts per expert), got {describe(offsets_E)}")
    if offsets_E.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (cumulative row counts, torch._grouped_mm's offs; counts per expert "
                         f"go through ExpertGroups.of), got {offsets_E.dtype}")
    if offsets_E.device != device:
        raise ValueError(f"{name} is on {offsets_E.device} but x_RI on {device}")
    return offsets_E


def _check(x_RI, w, groups, mma_order: bool = False) -> torch.Tensor:
    """Validates the arguments (the weight's code order is the route's to check; with ``mma_order``, x_RI as
    ``_mma_ordered_rows`` wants it); returns the offsets tensor."""
    if mma_order:
        check_mxfp4_weight(w)       # (its I, which the padded width follows)
        x_RI = _mma_ordered_rows(x_RI, w)
    if not isinstance(x_RI, torch.Tensor):
        raise ValueError(f"x_RI must be a tensor, got {type(x_RI).__name__}")
    if x_RI.ndim != 2:
        raise ValueError(f"x_RI must be 2-D [R, I], got {describe(x_RI)}")
    if x_RI.dtype not in _DTYPES:
        raise ValueError(f"x_RI must be bf16 or fp32, got {x_RI.dtype}")
    I = x_RI.shape[1]
    if I < BLOCK_SIZE or I % BLOCK_SIZE:
        raise ValueError(f"x_RI [R, I] has I = {I}: MXFP4 weights need I a positive multiple of {BLOCK_SIZE}")
    if not mma_order:               # (x in the MMA's order has the weight's I by construction)
        check_mxfp4_weight(w, I)
    E, O, _ = w.codes.shape
    if E < 1 or O < 1:
        raise ValueError(f"the weight's codes [E, O, I/2] need E, O >= 1, got {tuple(w.codes.shape)}")
    if w.codes.device != x_RI.device:
        raise ValueError(f"the weight is on {w.codes.device} but x_RI on {x_RI.device}")
    return _offsets(groups, E, x_RI.device)


def mxfp4_grouped_mm_reference(x_RI: torch.Tensor, w: MXTensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """The torch reference (and CPU path): the weight ``w`` (either code order) dequantised to x's dtype, then
    ``grouped_mm_loop`` over the rows up to ``offsets_E[-1]``; rows past it are zeros, as the kernel writes them.
    Reads the offsets on the host (a sync on CUDA); raises when they decrease or pass R."""
    R, I = x_RI.shape
    E, O, _ = w.codes.shape
    ends = offsets_E.tolist()
    starts = [0] + ends[:-1]
    if any(b < a for a, b in zip(starts, ends)) or ends[-1] > R:
        raise ValueError(f"offsets_E must be non-decreasing running row counts in 0..R={R}, got {ends}")
    counts_E = torch.tensor([b - a for a, b in zip(starts, ends)], dtype=torch.int64)
    y = grouped_mm_loop(x_RI[:ends[-1]], dequantize(w, dtype=x_RI.dtype), counts_E)
    if ends[-1] < R:
        y = torch.cat([y, y.new_zeros(R - ends[-1], O)])
    return y


def mxfp4_mma_order(R: int, E: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``mxfp4_grouped_mm`` (backend and route "auto") on ``R`` rows of ``dtype`` on ``device`` over ``E``
    experts reads them in the MMA's k order (``mxfp4_wgmma``: bf16 at decode sizes on a Hopper GPU): then a caller
    that makes the rows can write them so (``kimik3.ops.moe.mxfp8_rows``) and pass ``mma_order=True``, saving the
    kernel a pass over x."""
    return wgmma_available(device) and mxfp4_route(R, E, 8, dtype, mma=True, wgmma=True) == "mma"


@torch.compiler.disable  # an opaque kernel call to torch.compile: traced, its launcher breaks on symbolic sizes
def mxfp4_grouped_mm(x_RI: torch.Tensor, w: MXTensor, groups_or_offsets: ExpertGroups | torch.Tensor, *,
                     backend: str = "auto", route: str = "auto",
                     mma_order: bool = False, block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """``y[r] = x[r] @ dequantize(W)[e]`` for the rows r of expert e: y_RO [R, O] in x's dtype, contiguous.

    x_RI [R, I] bf16 or fp32, rows sorted by expert; w the MXFP4 weight [E, I, O] (I a multiple of 32) as
    ``to_kernel_order(quantize(w_EIO, "mxfp4", axis=-2))``: codes [E, O, I/2] and scales [E, O, I/32], the codes in
    kernel order for the Triton backend (the torch one takes either order); groups_or_offsets: ``ExpertGroups``
    or its ``offsets_E`` (int32 [E], the running row counts, ``torch._grouped_mm``'s offs). Rows past
    ``offsets_E[-1]`` come out as zeros. All on one device. ``backend``: "auto" (CUDA -> the Triton kernel, CPU ->
    the torch reference), "torch" or "triton" (CPU tensors need TRITON_INTERPRET=1 set before the kernels were
    imported). ``route`` (the Triton backend's): "auto" (``mxfp4_route``), "mma" (bf16 x on a CUDA GPU of compute
    capability >= 9.0), "gemv", "registers" or "dequantize" (bf16 x, O a multiple of 8). The kernels are forward
    only (raise when grad is enabled and x requires grad) and do no host sync; ``block_m`` / ``block_n`` /
    ``block_k`` / ``num_warps`` / ``num_stages`` override ``mxfp4_blocks``' choice for the registers route (for tests
    and tuning: block sizes powers of two, >= 16, BLOCK_K >= 32; num_warps a power of two; num_stages >= 1).
    ``mma_order``: x_RI is [R, mma_width(I)] in the MMA's k order (``mxfp8_rows``; contiguous), for a call that
    takes ``mxfp4_wgmma`` (``mxfp4_mma_order`` says when; any other raises).
    """
    offsets_E = _check(x_RI, w, groups_or_offsets, mma_order)
    codes_EOH, scales_EOB = w.codes, w.scales
    torch_backend = mxfp4_backend(x_RI, backend) == "torch"
    if mma_order and (route not in ("auto", "mma") or torch_backend
                      or not mxfp4_mma_order(x_RI.shape[0], codes_EOH.shape[0], x_RI.dtype, x_RI.device)):
        raise ValueError(f"mma_order=True: x in the MMA's order is read by the wgmma kernel only (bf16 on a Hopper "
                         f"GPU, at most {MMA_ROWS} rows an expert on average, route 'auto' or 'mma'); this call has "
                         f"{x_RI.dtype} on {x_RI.device}, {x_RI.shape[0]} rows over {codes_EOH.shape[0]} experts, "
                         f"route {route!r}")
    if torch_backend:
        return mxfp4_grouped_mm_reference(x_RI, w, offsets_E)
    if w.order != "kernel":     # (the kernels read kernel order; the rest of the weight is checked above)
        check_mxfp4_weight(w, order="kernel")
    if torch.is_grad_enabled() and x_RI.requires_grad:
        raise RuntimeError("mxfp4_grouped_mm's kernel is forward only (inference): call it under torch.no_grad() or "
                           "torch.inference_mode(), or use backend='torch'")
    check_triton_device(x_RI, "mxfp4_grouped_mm")
    R, I = x_RI.shape[0], 2 * codes_EOH.shape[2]
    E, O, _ = codes_EOH.shape
    blocks = (block_m, block_n, block_k, num_warps, num_stages)
    wgmma = wgmma_available(x_RI.device)
    chosen = mxfp4_route(R, E, O, x_RI.dtype, route, mma_available(x_RI.device), wgmma)
    if chosen != "registers" and any(b is not None for b in blocks):
        raise ValueError("block_m / block_n / block_k / num_warps / num_stages tune the registers route; this call "
                         f"takes the {chosen} route ({R} rows over {E} experts): pass route='registers'")
    if chosen == "dequantize":
        return _dequantized_grouped_mm(x_RI, w, offsets_E)
    if chosen == "mma" and wgmma:
        from kimik3.ops.moe.mxfp4_wgmma import mxfp4_wgmma  # (Gluon: imported only where it runs)

        return mxfp4_wgmma(x_RI, codes_EOH, scales_EOB, offsets_E, mma_order=mma_order)
    if chosen == "mma":
        from kimik3.ops.moe.mxfp4_mma import mxfp4_mma

        return mxfp4_mma(x_RI, codes_EOH, scales_EOB, offsets_E)
    if chosen == "gemv":
        return _gemv(x_RI, codes_EOH, scales_EOB, offsets_E)
    for name, given, least in (("block_m", block_m, 16), ("block_n", block_n, 16), ("block_k", block_k, 32),
                               ("num_warps", num_warps, 1)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < least
                                  or given & (given - 1)):
            raise ValueError(f"{name} must be a power of two >= {least}, got {given!r}")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    bm, bn, bk, warps, stages = mxfp4_blocks(R, E, O, I, x_RI.dtype)
    bm, bn, bk, warps, stages = block_m or bm, block_n or bn, block_k or bk, num_warps or warps, num_stages or stages
    y_RO = torch.empty(R, O, dtype=x_RI.dtype, device=x_RI.device)
    if R == 0:
        return y_RO
    m_tiles = min(R, R // bm + E + 1)
    grid = (m_tiles * triton.cdiv(O, bn),)
    words = as_words(codes_EOH)
    with on_device(x_RI.device):
        _mxfp4_grouped_mm_kernel[grid](
            x_RI, x_RI.stride(0), x_RI.stride(1),
            words, *words.stride()[:2], scales_EOB, *scales_EOB.stride(),
            offsets_E, y_RO, R, O, E, m_tiles,
            I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E + 1), GROUP_M=GROUP_M,
            FP32=x_RI.dtype == torch.float32, num_warps=warps, num_stages=stages,
        )
    return y_RO


def _mma_ordered_rows(x_RI, w: MXTensor) -> torch.Tensor:
    """x in the MMA's k order, checked for what the wgmma kernel's TMA reads (whole 128-element steps of the
    weights' I, contiguous, a 16-byte aligned base), as the [R, I] view the other checks take (w checked already)."""
    if not isinstance(x_RI, torch.Tensor) or x_RI.ndim != 2:
        raise ValueError(f"x_RI must be 2-D [R, I padded], got {describe(x_RI)}")
    I = 2 * w.codes.shape[2]
    if x_RI.shape[1] != mma_width(I):
        raise ValueError(f"x_RI in the MMA's order has whole 128-element steps of the weights' I = {I}: width "
                         f"{mma_width(I)}, got {describe(x_RI)}")
    if not x_RI.is_contiguous() or x_RI.data_ptr() % 16:
        raise ValueError("x_RI in the MMA's order is read by TMA: it must be contiguous, its base 16-byte aligned")
    return x_RI[:, :I]


def _gemv(x_RI: torch.Tensor, codes_EOH: torch.Tensor, scales_EOB: torch.Tensor,
          offsets_E: torch.Tensor) -> torch.Tensor:
    """The gemv route: a program per (row, column tile)."""
    R, I = x_RI.shape
    E, O, _ = codes_EOH.shape
    y_RO = torch.empty(R, O, dtype=x_RI.dtype, device=x_RI.device)
    if R == 0:
        return y_RO
    block_n, block_k, warps = gemv_blocks(O, I)
    words = as_words(codes_EOH)
    with on_device(x_RI.device):
        _mxfp4_gemv_kernel[(R * triton.cdiv(O, block_n),)](
            x_RI, x_RI.stride(0), x_RI.stride(1),
            words, *words.stride()[:2], scales_EOB, *scales_EOB.stride(),
            offsets_E, y_RO, R, O, E,
            I=I, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(E),
            num_warps=warps, num_stages=1,
        )
    return y_RO


def _dequantized_grouped_mm(x_RI: torch.Tensor, w: MXTensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """The dequantize route: the weights decoded to bf16 once, into a row-major [E + 1, I, O] buffer (the layout of
    a bf16 model's expert weights), then ``torch._grouped_mm``. The extra expert is zeros and owns the rows past
    the last offset, which thus come out as zeros without a pass over y. The offsets are made non-decreasing within
    0..R on the device (as the registers kernel clamps what it reads: bad offsets give a meaningless result, never
    an access outside x or y)."""
    R = x_RI.shape[0]
    E, O, H = w.codes.shape
    w_EIO = torch.empty(E + 1, 2 * H, O, dtype=torch.bfloat16, device=x_RI.device)
    w_EIO[E].zero_()
    mxfp4_dequantize(w, out=w_EIO[:E].transpose(1, 2))
    offs = torch.cat([torch.cummax(offsets_E.clamp(0, R), 0).values,
                      torch.full((1,), R, dtype=offsets_E.dtype, device=x_RI.device)]).to(torch.int32)
    return torch._grouped_mm(x_RI.contiguous(), w_EIO, offs=offs)


@_jit
def _load_codes(c_rows, s_rows, s_sb, nmask, k0, I: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K / 8] code words and [BLOCK_N, BLOCK_K / 32] scale codes of the weight tile at k0 (rows
    ``c_rows`` / ``s_rows``; masked past I and past O, scale 127 = 1 there)."""
    ws = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    bs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    words = tl.load(c_rows + ws[None, :], mask=nmask[:, None] & (ws < I // 8)[None, :], other=0)
    scales = tl.load(s_rows + bs[None, :] * s_sb, mask=nmask[:, None] & (bs < I // 32)[None, :], other=127)
    return words, scales


@_jit
def _mxfp4_grouped_mm_kernel(
    x_ptr, s_xr, s_xi, c_ptr, s_ce, s_co, sc_ptr, s_se, s_so, s_sb,
    off_ptr, y_ptr, R, O, E, M_TILES,
    I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, FP32: tl.constexpr,
):
    """Program (row tile, column tile): y[rows, cols] = x[rows] @ dequantize(W[e])[:, cols] for the expert e whose
    rows the tile covers (fp32 accumulator, stored in y's dtype); zeros for a tile of the group past
    offsets[E - 1]; nothing for a program past the real tiles."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(O, BLOCK_N)
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(M_TILES - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    # Groups g = 0..E: the experts, then the rows past offsets[E - 1]; [start, end) clamped to 0..R.
    g = tl.arange(0, BLOCK_E)
    ends = tl.load(off_ptr + g, mask=g < E, other=R)
    ends = tl.minimum(tl.maximum(ends, 0), R)
    starts = tl.load(off_ptr + tl.minimum(g - 1, E - 1), mask=g >= 1, other=0)
    starts = tl.minimum(tl.maximum(starts, 0), R)
    counts = tl.where(g <= E, tl.maximum(ends - starts, 0), 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)
    if pid_m >= tl.max(tiles_end, 0):
        return
    e = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)  # the group whose tiles hold pid_m
    here = g == e
    row0 = tl.sum(tl.where(here, starts, 0), 0) + (pid_m - tl.sum(tl.where(here, tiles_end - tiles, 0), 0)) * BLOCK_M
    row_end = tl.sum(tl.where(here, ends, 0), 0)

    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < O
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)   # y^T's tile: the decoded weights are the dot's A
    if e < E:
        ks = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * s_xr
        c_rows = c_ptr + e.to(tl.int64) * s_ce + cols.to(tl.int64)[:, None] * s_co
        s_rows = sc_ptr + e.to(tl.int64) * s_se + cols.to(tl.int64)[:, None] * s_so
        words, scales = _load_codes(c_rows, s_rows, s_sb, nmask, 0, I, BLOCK_K)
        for k0 in range(0, I, BLOCK_K):
            # The next tile's codes first (past the end: masked, no traffic), so that they are in flight while
            # this one decodes.
            next_words, next_scales = _load_codes(c_rows, s_rows, s_sb, nmask, k0 + BLOCK_K, I, BLOCK_K)
            kmask = (k0 + ks) < I
            x = tl.load(x_rows + (k0 + ks)[None, :] * s_xi, mask=rmask[:, None] & kmask[None, :], other=0.0)
            # The decoded tile's columns come in decode_words' order: x's are put in the same one.
            x = permute_words(x, BLOCK_M, BLOCK_K)
            w = decode_words(words, scales, BLOCK_N, BLOCK_K)
            if FP32:
                acc = tl.dot(w.to(tl.float32), tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
            words, scales = next_words, next_scales
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * O + cols[None, :], tl.trans(acc).to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@_jit
def _mxfp4_gemv_kernel(
    x_ptr, s_xr, s_xi, c_ptr, s_ce, s_co, sc_ptr, s_se, s_so, s_sb,
    off_ptr, y_ptr, R, O, E,
    I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Program (row r, column tile): y[r, cols] = x[r] @ dequantize(W[e])[:, cols] for r's expert e, the number of
    offsets (clamped to 0..R) at or below r; zeros for a row past offsets[E - 1]. The products in fp32, summed along
    the tile's K per column once after the loop."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(O, BLOCK_N)
    r = pid // n_tiles
    pid_n = pid % n_tiles
    g = tl.arange(0, BLOCK_E)
    ends = tl.load(off_ptr + g, mask=g < E, other=R)
    ends = tl.minimum(tl.maximum(ends, 0), R)
    e = tl.sum(((ends <= r) & (g < E)).to(tl.int32), 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < O
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if e < E:
        ks = tl.arange(0, BLOCK_K)
        x_row = x_ptr + r.to(tl.int64) * s_xr
        c_rows = c_ptr + e.to(tl.int64) * s_ce + cols.to(tl.int64)[:, None] * s_co
        s_rows = sc_ptr + e.to(tl.int64) * s_se + cols.to(tl.int64)[:, None] * s_so
        words, scales = _load_codes(c_rows, s_rows, s_sb, nmask, 0, I, BLOCK_K)
        for k0 in range(0, I, BLOCK_K):
            next_words, next_scales = _load_codes(c_rows, s_rows, s_sb, nmask, k0 + BLOCK_K, I, BLOCK_K)
            x = tl.load(x_row + (k0 + ks)[None, :] * s_xi, mask=((k0 + ks) < I)[None, :], other=0.0)
            x = permute_words(x, 1, BLOCK_K)
            w = decode_words(words, scales, BLOCK_N, BLOCK_K)
            acc += w.to(tl.float32) * x.to(tl.float32)
            words, scales = next_words, next_scales
    tl.store(y_ptr + r.to(tl.int64) * O + cols, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=nmask)
