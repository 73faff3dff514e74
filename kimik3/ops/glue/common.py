"""What the glue kernels share: the backend choice, block sizes, and the second stage of the parameter-grad
reductions.

The backward kernels reduce a per-row product (e.g. ``g * x * r`` for an RMSNorm weight) over all rows. Each of
their G programs walks its share of the row blocks and writes one fp32 partial sum [D]; ``reduce_partials`` then
adds the G partials (in a fixed order: the gradients are deterministic) and writes the parameters' grads in their
dtypes. G depends on the shapes and the device only, never on values.

Legend: R rows (all leading dims flattened), D width, G backward programs (partial sums).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # the torch paths still work; backend "triton" refuses (``glue_backend``)
    triton = tl = None

    def _jit(fn):
        return fn

__all__ = ["MAX_WIDTH", "glue_backend"]

# The kernels keep a whole row (next power of two of D) in registers; K3's widest row is D = 7168 (8192).
MAX_WIDTH = 16384
# Elements per row tile: rows of small D are batched into one program up to this (8 a thread at 8 warps).
TILE_ELEMS = 2048
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def glue_backend(x: torch.Tensor, backend: str = "auto", max_width: int = MAX_WIDTH) -> str:
    """"triton" or "torch" for a glue op (``AttnResMix``, ``RMSNorm``) on rows of ``x`` [..., D].

    "auto": the Triton kernels for CUDA tensors when triton is installed and D <= ``max_width``, else torch (CPU
    tensors stay on torch even under TRITON_INTERPRET=1, as ``paged_mla_backend`` and ``kda_backend`` do). "triton"
    forces the kernels: CUDA tensors, or CPU tensors when the kernels were decorated under TRITON_INTERPRET=1.
    Shapes and devices only (no host sync); errors are raised, never answered by a fallback.
    """
    choice = (backend or "auto").lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if choice == "auto":
        ok = x.is_cuda and triton is not None and x.ndim >= 1 and x.shape[-1] <= max_width
        return "triton" if ok else "torch"
    if choice == "triton":
        check_triton_device(x, "backend 'triton'")
    return choice


def through_operator(*tensors) -> bool:
    """Whether an op on these inputs goes through its custom operator: when autograd must record it, and whenever
    torch.compile traces (a direct Triton launch does not trace with symbolic sizes). Otherwise (eager inference)
    the ops call their forward kernel directly: the same launch, without the operator's host overhead."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def interpreted() -> bool:
    """Whether the glue kernels run under Triton's interpreter (decided when they were decorated, i.e. when
    TRITON_INTERPRET=1 was set before this package was imported)."""
    return _INTERPRETED


def check_triton_device(x: torch.Tensor, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton, which is not installed")
    if not x.is_cuda and not interpreted():
        raise ValueError(f"{what} needs CUDA tensors, or TRITON_INTERPRET=1 set before kimik3.ops.glue is imported "
                         f"for CPU ones; got {x.device} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})")


def check_width(D: int, what: str) -> None:
    if not 1 <= D <= MAX_WIDTH:
        raise ValueError(f"{what}: the Triton kernels take widths 1..{MAX_WIDTH} (a whole row per program), got {D}")


def check_param(p, D: int, device: torch.device, name: str) -> None:
    if not isinstance(p, torch.Tensor) or p.ndim != 1 or p.shape[0] != D:
        raise ValueError(f"{name} must be a 1-D tensor [D={D}], got {describe(p)}")
    if p.dtype not in _FLOATS:
        raise ValueError(f"{name} must be a floating tensor (fp32, bf16, fp16 or fp64), got {p.dtype}")
    if p.device != device:
        raise ValueError(f"{name} is on {p.device} but the inputs on {device}")


# A depthwise conv's kernel may come as up to three pieces [C_i, W] stacked along C (KDA's q, k and v convs),
# read in place; their pointers travel as a tuple (one kernel specialisation per count).
MAX_CONV_WEIGHTS = 3


def check_conv_weights(weights, C: int, device: torch.device, x_name: str) -> tuple[torch.Tensor, ...]:
    """A conv kernel given as one tensor [C, W] or 1 to MAX_CONV_WEIGHTS tensors [C_i, W] (any float dtype and
    strides, W >= 2, sum C_i = C, on ``device``), checked; returned as a tuple."""
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    if not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= MAX_CONV_WEIGHTS:
        raise ValueError(f"weights must be one tensor [C, W] or 1 to {MAX_CONV_WEIGHTS} tensors [C_i, W], got "
                         f"{describe(weights)}" + (f" of length {len(weights)}" if isinstance(weights, (list, tuple))
                                                   else ""))
    weights = tuple(weights)
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or w.ndim != 2 or w.shape[0] < 1 or w.dtype not in _FLOATS:
            raise ValueError(f"weights[{i}] must be a floating tensor [C_i >= 1, W], got {describe(w)}")
        if w.device != device:
            raise ValueError(f"weights[{i}] is on {w.device} but {x_name} on {device}")
    W = weights[0].shape[1]
    if any(w.shape[1] != W for w in weights):
        raise ValueError(f"the weights disagree on the kernel width W: {[tuple(w.shape) for w in weights]}")
    if W < 2:
        raise ValueError(f"the kernel width W must be >= 2 (a state of W-1 >= 1 inputs), got {W}")
    if sum(w.shape[0] for w in weights) != C:
        raise ValueError(f"the weights' channels {[w.shape[0] for w in weights]} sum to "
                         f"{sum(w.shape[0] for w in weights)}, {x_name} has C = {C}")
    return weights


def check_float(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{name} must be fp32, bf16, fp16 or fp64, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"{name} must be [..., D] with D >= 1, got {tuple(x.shape)}")


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite Python number >= 0 (not a tensor: reading one is a host sync), "
                         f"got {eps!r}")
    return float(eps)


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [R, D] with unit stride along D: a view when one exists, else a copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def blocks(R: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) from the shapes only: a whole row (next power of two of D) a program, as many
    rows as fit TILE_ELEMS (at most the next power of two of R), 8 elements a thread a tile, 1 to 16 warps (16
    a thread from D > 4096 up: ptxas caps a 512-thread program at 128 registers, a 1024-thread one at 64)."""
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(triton.next_power_of_2(max(R, 1)), TILE_ELEMS // block_d))
    num_warps = max(1, min(16, block_r * block_d // 256))
    return block_r, block_d, num_warps


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def backward_programs(row_blocks: int, device: torch.device, programs: int | None = None) -> int:
    """G, the backward's programs (each writes one partial sum): two per SM on a GPU, 2 under the interpreter (so
    that the CPU tests walk several row blocks a program), never more than the row blocks."""
    if programs is None:
        programs = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else 2
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be a positive int, got {programs!r}")
    return max(1, min(programs, row_blocks))


def row_chunks(row_blocks: int, device: torch.device, programs: int | None = None,
               per_sm: int = 2) -> tuple[int, int]:
    """(ITERS, G) for a backward that gives each of G programs ITERS consecutive row blocks (the last ones possibly
    past the rows) in one loop of a constant trip count, which the compiler can pipeline (and the interpreter can
    run: it takes no tensor bounds in range(), triton#9171). ITERS above 8 is rounded up to m 2^e with m in 4..8
    (at most four values an octave: few specialisations) and G = cdiv(row_blocks, ITERS): at most
    ``backward_programs``' count (with ``per_sm`` programs an SM instead of 2; the cap ``programs`` included), at
    least half of it, and 4/5 of it once ITERS > 8."""
    if programs is None and device.type == "cuda":
        programs = per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    target = backward_programs(row_blocks, device, programs)
    iters = -(-row_blocks // target) if row_blocks > 0 else 1
    if iters > 8:
        e = iters.bit_length() - 3
        iters = -(-iters // (1 << e)) << e
    return iters, max(1, -(-row_blocks // iters))


# A program's shared memory for a pipelined loop's buffers (two such programs fit an SM's 227 KB on sm_90), and the
# most stages worth having: 4 tiles in flight a program (RMSNorm at D = 1024: 2 programs an SM x 4 x 8 KB; AttnRes:
# 8 x 4 x 2 KB), about what covers the memory's latency at full bandwidth.
PIPELINE_BYTES = 96 * 1024
MAX_STAGES = 5


def pipeline_stages(stage_bytes: int) -> int:
    """num_stages of a loop whose iteration loads ``stage_bytes``: buffers (num_stages - 1 of them) within
    PIPELINE_BYTES, at most MAX_STAGES; 1 (no pipelining) when not even one fits."""
    return max(1, min(MAX_STAGES, 1 + PIPELINE_BYTES // max(1, stage_bytes)))


# reduce_partials' blocks for a G of hundreds to a thousand: 16 columns a program (D / 16 programs, not D / 128, to
# spread the second stage over the SMs) and 128 partials a step (8 steps for G = 1024, not 64).
WIDE_REDUCE = dict(block_d=16, block_g=128)


def on_device(device: torch.device):
    """Launch on the tensors' GPU whatever the current device is (Triton launches on the current one)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def compute_f64(*tensors: torch.Tensor) -> bool:
    """The kernels compute in fp32, or in fp64 when any input is fp64 (for gradcheck)."""
    return any(t.dtype == torch.float64 for t in tensors)


def reduce_partials(partial_GD: torch.Tensor, a_D: torch.Tensor, b_D: torch.Tensor | None, f64: bool, *,
                    block_d: int = 128, block_g: int = 16):
    """Second stage of a parameter-grad reduction: total = sum over G of partial_GD [G, D] (fp32/fp64).

    With b_D None: returns total in a_D's dtype (RMSNorm: the weight's grad). Otherwise, for a parameter product
    w = a * b: returns (total * b in a's dtype, total * a in b's dtype), the grads of a and b (AttnRes: key norm
    weight and query). One launch: a program per ``block_d`` columns, which adds ``block_g`` partials a step
    (powers of two; the sum's order, fixed, depends on them)."""
    G, D = partial_GD.shape
    out_a = torch.empty(D, dtype=a_D.dtype, device=a_D.device)
    two = b_D is not None
    out_b = torch.empty(D, dtype=b_D.dtype, device=b_D.device) if two else out_a
    block_d = min(block_d, triton.next_power_of_2(D))
    block_g = min(block_g, triton.next_power_of_2(G))
    with on_device(partial_GD.device):
        _reduce_partials_kernel[(triton.cdiv(D, block_d),)](
            partial_GD, a_D, b_D if two else a_D, out_a, out_b, G, D,
            TWO=two, BLOCK_G=block_g, BLOCK_D=block_d, F64=f64, num_warps=4,
        )
    return (out_a, out_b) if two else out_a


@_jit
def sum_partials(part_ptr, G, D, cols, cmask, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr):
    """The sum over G of the contiguous partials [G, D] at columns ``cols`` [BLOCK_D] (``cmask`` in range), added in
    a fixed order, in fp32 (fp64 with F64): the second stage of every backward's parameter-grad reduction."""
    ct = tl.float64 if F64 else tl.float32
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=ct)
    g0 = 0
    while g0 < G:  # (a while loop: Triton 3.6's interpreter cannot take tensor bounds in range(), triton#9171)
        gs = g0 + tl.arange(0, BLOCK_G)
        m = (gs < G)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + gs.to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0).to(ct)
        g0 += BLOCK_G
    return tl.sum(acc, axis=0)


@_jit
def _reduce_partials_kernel(
    part_ptr, a_ptr, b_ptr, out_a_ptr, out_b_ptr, G, D,
    TWO: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Program (D block): sums the contiguous partials [G, D] over G (fixed order) -> out_a (= total, or total * b
    with TWO) and, with TWO, out_b = total * a; each stored in its pointer's dtype."""
    ct = tl.float64 if F64 else tl.float32
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    total = sum_partials(part_ptr, G, D, cols, cmask, BLOCK_G, BLOCK_D, F64)
    if TWO:
        a = tl.load(a_ptr + cols, mask=cmask, other=0.0).to(ct)
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ct)
        tl.store(out_a_ptr + cols, (total * b).to(out_a_ptr.dtype.element_ty), mask=cmask)
        tl.store(out_b_ptr + cols, (total * a).to(out_b_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out_a_ptr + cols, total.to(out_a_ptr.dtype.element_ty), mask=cmask)


# Read once: a module constant is what torch.compile traces through (it cannot take the type of a Triton kernel).
_INTERPRETED = triton is not None and type(_reduce_partials_kernel).__name__ == "InterpretedFunction"
