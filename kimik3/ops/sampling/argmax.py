"""The argmax over a vocabulary row (greedy decoding, a speculative verification, the draft's proposals), split
over the row.

``torch.argmax`` over a few rows of 163,840 logits reduces each row in one block of threads, latency-bound at small
batch (a decode step's 1 to 4 rows). Here the row is cut into chunks of CHUNK entries, one program each: the first
kernel writes every chunk's largest value, the first index holding it and whether the chunk holds a NaN; the second
picks, per row, among its chunks. The answer is ``torch.argmax``'s exactly: the first index of the largest value,
a NaN ranking above everything (the first NaN wins), an all -inf row giving index 0.

Shapes decide the launches (no host sync): a decode step that calls it can be captured in a CUDA graph. The torch
reference, and the CPU path, is ``torch.argmax``; ``argmax_backend`` makes the choice.

Legend: R rows (all leading dims), V the row's length, C chunks a row.
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import _jit, describe, glue_backend, on_device, tl, triton

__all__ = ["CHUNK", "MIN_WIDTH", "argmax_backend", "row_argmax"]

CHUNK = 4096       # entries of a row a program reads (fp32 in registers: 16 KB)
MAX_CHUNKS = 1024  # the second kernel holds a row's chunk results in one block
MIN_WIDTH = 8192   # below this a row is one chunk's work: torch.argmax's own reduction is as good
_KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def argmax_backend(x: torch.Tensor, backend: str = "auto") -> str:
    """"triton" or "torch" for ``row_argmax`` of ``x`` [..., V]: ``glue_backend``'s choice with rows of at most
    CHUNK x MAX_CHUNKS, and under "auto" only fp32 / bf16 / fp16 rows of at least MIN_WIDTH; "triton" forces the
    kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if glue_backend(x, backend, max_width=CHUNK * MAX_CHUNKS) == "torch":
        return "torch"
    auto = (backend or "auto").lower() == "auto"
    if x.dtype not in _KERNEL_FLOATS:   # compared in fp32: fp64 values could tie there
        if auto:
            return "torch"
        raise ValueError(f"row_argmax's kernels take fp32, bf16 or fp16 rows, got {x.dtype}")
    return "torch" if auto and x.shape[-1] < MIN_WIDTH else "triton"


def row_argmax(x: torch.Tensor, backend: str = "auto", chunk: int | None = None) -> torch.Tensor:
    """``x.argmax(-1)``: int64 [...] for x [..., V] (floating, any strides). ``chunk``: entries a program reads (a
    power of two; default CHUNK; tests take small ones to cover many chunks at small V)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        raise ValueError(f"row_argmax takes a tensor [..., V], got {describe(x)}")
    if argmax_backend(x, backend) == "torch":
        return x.argmax(dim=-1)
    V = x.shape[-1]
    if V == 0:
        raise ValueError("row_argmax: the rows are empty (V = 0), which have no argmax")
    block = chunk or CHUNK
    if block & (block - 1) or block < 16:
        raise ValueError(f"chunk must be a power of two >= 16, got {block}")
    chunks = triton.cdiv(V, block)
    if chunks > MAX_CHUNKS:
        raise ValueError(f"row_argmax: {V} entries a row make {chunks} chunks of {block}, over {MAX_CHUNKS}")
    rows_2d = x.reshape(-1, V)
    if rows_2d.stride(-1) != 1:
        rows_2d = rows_2d.contiguous()
    R = rows_2d.shape[0]
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out.view(x.shape[:-1])
    values = torch.empty(R, chunks, dtype=torch.float32, device=x.device)
    firsts = torch.empty(R, chunks, dtype=torch.int64, device=x.device)
    nans = torch.empty(R, chunks, dtype=torch.int32, device=x.device)
    with on_device(x.device):
        _chunk_kernel[(R, chunks)](rows_2d, rows_2d.stride(0), V, values, firsts, nans, chunks, BLOCK=block,
                                   num_warps=8 if block >= 2048 else 4)
        _pick_kernel[(R,)](values, firsts, nans, out, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)),
                           num_warps=1)
    return out.view(x.shape[:-1])


@_jit
def _chunk_kernel(x_ptr, stride_r, V, val_ptr, idx_ptr, nan_ptr, C, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's largest non-NaN value, the first index holding it, whether it holds a NaN
    (then the index is its first NaN's)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(x_ptr + r * stride_r + cols, mask=inside, other=float("-inf")).to(tl.float32)
    nan = x != x
    big = 2147483647
    first_nan = tl.min(tl.where(nan, cols, big), axis=0)
    xv = tl.where(nan, float("-inf"), x)
    best = tl.max(xv, axis=0)
    first = tl.min(tl.where(inside & (xv == best), cols, big), axis=0)
    has_nan = first_nan < big
    tl.store(val_ptr + r * C + c, best)
    tl.store(idx_ptr + r * C + c, tl.where(has_nan, first_nan, first).to(tl.int64))
    tl.store(nan_ptr + r * C + c, has_nan.to(tl.int32))


@_jit
def _pick_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    """Program (row): the first NaN's index when a chunk holds one, else the first index of the largest value."""
    r = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, BLOCK_C)
    inside = cs < C
    vals = tl.load(val_ptr + r * C + cs, mask=inside, other=float("-inf"))
    idxs = tl.load(idx_ptr + r * C + cs, mask=inside, other=0)
    nans = tl.load(nan_ptr + r * C + cs, mask=inside, other=0) != 0
    big = 9223372036854775807
    first_nan = tl.min(tl.where(nans, idxs, big), axis=0)
    best = tl.max(tl.where(nans, float("-inf"), vals), axis=0)
    first = tl.min(tl.where(inside & ~nans & (vals == best), idxs, big), axis=0)
    tl.store(out_ptr + r, tl.where(first_nan < big, first_nan, first))
