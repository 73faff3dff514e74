"""Block AttnRes mix (``kimik3.model.attnres.AttnResMix``) fused into one Triton kernel forward and two backward.

Per row (token) of width D, over N entries v_n, all in fp32 (as released):

    r_n = rsqrt(mean(v_n^2) + eps)    k_n = v_n r_n    s_n = k_n . w,  w = key_norm_weight * query
    p = softmax_n(s)                  out = sum_n p_n v_n   (stored in the last entry's dtype)

The unfused module is ~14 launches a mix (stack, cast, square, mean, add, rsqrt, mul, two parameter casts and
their product, matmul, softmax, matmul, cast). Here the forward is one program per block of rows that reads each
entry once, in its own dtype, straight from the caller's tensors (no ``torch.stack``: the entries' pointers are
passed as a tuple, up to MAX_ENTRIES; a longer list is stacked first), keeps a whole row in registers and runs an
online softmax over the entries. The backward recomputes r, s and p from the entries (nothing is saved but the
inputs) and launches twice: one kernel writes every entry's grad and per-program partial sums of dL/dw, one
(``common.reduce_partials``) sums them and writes the key norm weight's and query's grads. The first walks a block
of rows' g and entries in one pipelined loop with a runtime index (a tile's pointer picked by it), the entries
twice: pass 1 takes the softmax's statistics, pass 2 recomputes each entry's r, s, dp (its tile comes back from L2)
and writes its grad; its registers do not grow with N. Its tiles share one dtype: entries of several dtypes, or a g
of another, are stacked first in the promoted dtype (exactly), the grads cast back.

Backward, per row, with g = dL/dout:  dp_n = g . v_n,  ds_n = p_n (dp_n - sum_m p_m dp_m),
    dv_n = p_n g + ds_n r_n (w - s_n r_n v_n / D),   dw = sum over rows and n of ds_n r_n v_n,
    d key_norm_weight = dw * query,  d query = dw * key_norm_weight.

``attnres_mix_norm`` is the forward with the RMSNorm that always follows a block's mix fused in (the mix rounded to
the last entry's dtype, then normalised in fp32 and scaled by the norm's weight, as ``RMSNorm(mix(entries))``
computes it): one launch instead of two for the mixes of a decode step, forward only. With an ``addend`` it also
takes the add that makes the last entry (a block's running sum plus a sublayer's output, rounded as torch's add)
and returns that sum: one launch instead of three.

Shapes decide everything at launch (no host sync): a decode step that calls it can be captured in a CUDA graph.
The reference is ``kimik3.model.attnres.attnres_mix_reference`` (the formula through autograd); the CPU path is
``attnres_mix_torch`` there (the same backward by hand in torch ops); ``glue_backend`` makes the choice.

Legend: B batch, T tokens, N entries, D width, R = B * T rows (all leading dims), G backward programs.
"""

from __future__ import annotations

import functools

from typing import Sequence

import torch

from kimik3.ops.glue.common import (
    WIDE_REDUCE,
    _jit,
    blocks,
    check_eps,
    check_float,
    check_param,
    check_triton_device,
    check_width,
    compute_f64,
    describe,
    on_device,
    pipeline_stages,
    reduce_partials,
    row_chunks,
    rows_2d,
    tl,
    triton,
    through_operator,
)

__all__ = ["MAX_ENTRIES", "attnres_mix", "attnres_mix_backward", "attnres_mix_forward", "attnres_mix_norm"]

# Entries passed as separate pointers (one kernel specialisation per count); K3 mixes at most 9 (the embedding, 7
# block summaries, the last block's partial sum), the debug preset 3. Longer lists are stacked into one tensor first.
MAX_ENTRIES = 16


def _prepare(entries, key_norm_weight, query, eps):
    """Checks, then (xs, s_rows, s_entry, N, stacked, shape, dtype): the kernel's view of the entries, as a tuple
    of [R, D] tensors (one per entry) or, stacked, one [R, N, D] tensor."""
    eps = check_eps(eps)
    if isinstance(entries, torch.Tensor):
        check_float(entries, "entries")
        if entries.ndim < 2:
            raise ValueError(f"a stacked entries tensor must be [..., N, D], got {tuple(entries.shape)}")
        N, D = entries.shape[-2:]
        if N < 1:
            raise ValueError("entries must hold at least one entry, got N = 0")
        shape, dtype, device = entries.shape[:-2] + (D,), entries.dtype, entries.device
        x = entries.reshape(-1, N, D)
        if x.stride(-1) != 1 and D > 1:
            x = x.contiguous()
        xs, s_rows, s_entry, stacked = (x,), (x.stride(0),), x.stride(1), True
    else:
        if not isinstance(entries, (list, tuple)) or len(entries) == 0:
            raise ValueError(f"entries must be a non-empty list of tensors [..., D] or one tensor [..., N, D], "
                             f"got {describe(entries)}")
        for i, e in enumerate(entries):
            check_float(e, f"entries[{i}]")
        shape, dtype, device = entries[-1].shape, entries[-1].dtype, entries[-1].device
        for i, e in enumerate(entries):
            if e.shape != shape:
                raise ValueError(f"every entry must have the last entry's shape {tuple(shape)}, entries[{i}] has "
                                 f"{tuple(e.shape)}")
            if e.device != device:
                raise ValueError(f"entries[{i}] is on {e.device} but the last entry on {device}")
        N, D = len(entries), shape[-1]
        if N > MAX_ENTRIES:  # beyond the pointer tuple: one stacked tensor (promoted to a common dtype, as stack)
            x = torch.stack(list(entries), dim=-2).reshape(-1, N, D)
            xs, s_rows, s_entry, stacked = (x,), (x.stride(0),), x.stride(1), True
        else:
            xs = tuple(rows_2d(e) for e in entries)
            s_rows, s_entry, stacked = tuple(x.stride(0) for x in xs), 0, False
    check_width(D, "attnres_mix")
    check_param(key_norm_weight, D, device, "key_norm_weight")
    check_param(query, D, device, "query")
    check_triton_device(xs[0], "attnres_mix")
    return xs, s_rows, s_entry, N, stacked, shape, dtype, eps


def attnres_mix_forward(entries, key_norm_weight: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """The mix, forward only, in one launch (no autograd graph). Arguments as ``attnres_mix``."""
    xs, s_rows, s_entry, N, stacked, shape, dtype, eps = _prepare(entries, key_norm_weight, query, eps)
    return _forward(xs, s_rows, s_entry, N, stacked, shape, dtype, key_norm_weight, query, eps)


def attnres_mix_norm(entries, key_norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
                     norm_weight: torch.Tensor, norm_eps: float, addend: torch.Tensor | None = None):
    """``RMSNorm(mix)``: the mix of ``entries`` (arguments as ``attnres_mix``) rounded to the last entry's dtype,
    then ``x / sqrt(mean(x^2) + norm_eps) * norm_weight`` in fp32 (fp64 when any input is), stored in that dtype:
    [..., D], in one launch. Forward only (inference): refused while grad mode is on and an input requires grad.

    ``addend`` (the last entry's shape and dtype): the last entry is ``entries[-1] + addend`` (rounded to its dtype,
    as torch's add rounds), computed in the same launch; returns (the normalised mix, that sum)."""
    listed = [entries] if isinstance(entries, torch.Tensor) else list(entries)
    if addend is not None:
        if isinstance(entries, torch.Tensor):
            raise ValueError("attnres_mix_norm: an addend goes with a list of entries (its last one), not a stacked "
                             "tensor")
        last = listed[-1]
        check_float(addend, "addend")
        if addend.shape != last.shape or addend.dtype != last.dtype or addend.device != last.device:
            raise ValueError(f"addend must match the last entry ({tuple(last.shape)}, {last.dtype}, {last.device}), "
                             f"got {tuple(addend.shape)}, {addend.dtype}, {addend.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*listed, key_norm_weight, query, norm_weight,
                                                                  *([addend] if addend is not None else []))):
        raise RuntimeError("attnres_mix_norm is forward only (inference, no autograd): an input requires grad while "
                           "grad mode is on; call it under torch.no_grad() or torch.inference_mode()")
    if addend is not None and len(listed) > MAX_ENTRIES:   # stacked below: the sum made first
        total = listed[-1] + addend
        return attnres_mix_norm(listed[:-1] + [total], key_norm_weight, query, eps, norm_weight, norm_eps), total
    xs, s_rows, s_entry, N, stacked, shape, dtype, eps = _prepare(entries, key_norm_weight, query, eps)
    check_param(norm_weight, shape[-1], xs[0].device, "norm_weight")
    norm_eps = check_eps(norm_eps)
    return _forward(xs, s_rows, s_entry, N, stacked, shape, dtype, key_norm_weight, query, eps,
                    (norm_weight, norm_eps), None if addend is None else rows_2d(addend))


def _forward(xs, s_rows, s_entry, N, stacked, shape, dtype, kw, q, eps, norm=None, addend=None):
    """The forward launch; ``norm``: (weight, eps) of an RMSNorm applied to the mix in the same kernel, or None;
    ``addend`` [R, D]: added to the last entry in the kernel, the sum returned too: (out, sum)."""
    R, D = xs[0].shape[0], shape[-1]
    out = torch.empty(R, D, dtype=dtype, device=xs[0].device)
    total = torch.empty(R, D, dtype=dtype, device=xs[0].device) if addend is not None else None
    if R > 0:
        kw, q = kw.contiguous(), q.contiguous()
        nw, norm_eps = (norm[0].contiguous(), norm[1]) if norm is not None else (kw, 0.0)
        a, s_a = (addend, addend.stride(0)) if addend is not None else (out, 0)
        block_r, block_d, num_warps = blocks(R, D)
        with on_device(out.device):
            _attnres_fwd_kernel[(triton.cdiv(R, block_r),)](
                xs, s_rows, s_entry, kw, q, nw, out, a, s_a, total if total is not None else out, R, D, eps,
                norm_eps, N=N, STACKED=stacked, NORM=norm is not None, ADD=addend is not None, BLOCK_R=block_r,
                BLOCK_D=block_d, F64=compute_f64(*xs, kw, q, nw), num_warps=num_warps,
            )
    if total is None:
        return out.view(shape)
    return out.view(shape), total.view(shape)


def attnres_mix_backward(entries, key_norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
                         grad_out: torch.Tensor, *, programs: int | None = None):
    """Grads of the mix: (entries' grads, key_norm_weight's grad, query's grad), in their dtypes and shapes (a
    list for listed entries, one tensor [..., N, D] for a stacked one). grad_out: [..., D] like the output. Two
    launches; ``programs`` caps G (``common.row_chunks``)."""
    dx, dkw, dq = _grads_in_one(entries, key_norm_weight, query, eps, grad_out, programs)
    return _split_entry_grads(dx, entries, _stacked_grads(entries, grad_out)), dkw, dq


def _grads_in_one(entries, key_norm_weight, query, eps, grad_out, programs=None):
    """(dx, d key_norm_weight, d query) with the entries' grads in one tensor: [..., N, D] in the entries' and
    grad_out's promoted dtype where the kernel read them stacked (``_stacked_grads``), else [N, ..., D]
    (``_split_entry_grads`` makes them the entries')."""
    xs, s_rows, s_entry, N, stacked, shape, dtype, eps = _prepare(entries, key_norm_weight, query, eps)
    if not isinstance(grad_out, torch.Tensor) or grad_out.shape != shape:
        raise ValueError(f"grad_out must have the output's shape {tuple(shape)}, got {describe(grad_out)}")
    if grad_out.device != xs[0].device:
        raise ValueError(f"grad_out is on {grad_out.device} but the entries on {xs[0].device}")
    g = rows_2d(grad_out)
    if _mixed_dtypes(entries, grad_out):
        # The backward picks each tile's pointer (an entry's or g's) at run time, so they share one element type:
        # otherwise the entries and g are stacked in the promoted dtype (exact), the grads cast back (the same
        # rounding of the same fp32 / fp64 values).
        x = torch.stack([*(xs[0].unbind(1) if stacked else xs), g], dim=1)
        xs, s_rows, s_entry, stacked, g = (x,), (x.stride(0),), x.stride(1), True, x[:, N]
    dx, dkw, dq = _backward(xs, s_rows, s_entry, N, stacked, shape, key_norm_weight, query, eps, g, programs)
    return dx.view(*shape[:-1], N, shape[-1]) if stacked else dx.view(N, *shape), dkw, dq


def _mixed_dtypes(entries, grad_out) -> bool:
    listed = [entries] if isinstance(entries, torch.Tensor) else list(entries)
    return len({x.dtype for x in listed} | {grad_out.dtype}) > 1


def _stacked_grads(entries, grad_out) -> bool:
    """Whether the backward reads the entries as one stacked tensor, and so returns their grads as [..., N, D]: a
    stacked input, more entries than the pointer tuple takes, or entries and grad_out of several dtypes."""
    return isinstance(entries, torch.Tensor) or len(entries) > MAX_ENTRIES or _mixed_dtypes(entries, grad_out)


def _split_entry_grads(dx: torch.Tensor, entries, stacked: bool):
    """``_grads_in_one``'s dx as the entries' grads: one tensor for a stacked input; for listed ones, the views of
    its [N, ..., D] form, or (``stacked``) its [..., N, D] form's slices cast to each entry's dtype."""
    if isinstance(entries, torch.Tensor):
        return dx.to(entries.dtype)
    if not stacked:
        return list(dx.unbind(0))
    return [d.to(e.dtype) for d, e in zip(dx.unbind(-2), entries)]


def _bwd_blocks(R: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) of the backward: a whole row (next power of two of D) a program, 32 elements a
    thread (one warp up to D = 1024, several rows a program below; 8 warps at K3's D = 7168). Its loop runs ~20
    instructions an element (two passes, the reductions of both): fewer threads a row amortise each step's fixed
    part (index math, the pointer pick, the warps' exchanges) over more elements: at 8 a thread (the forward's
    tiles) it is bound by instruction issue, well under the memory's speed."""
    block_d = triton.next_power_of_2(D)
    num_warps = max(1, min(16, block_d // 1024))
    block_r = max(1, min(triton.next_power_of_2(max(R, 1)), 1024 * num_warps // block_d))
    return block_r, block_d, num_warps


def _backward(xs, s_rows, s_entry, N, stacked, shape, kw, q, eps, g, programs):
    R, D = xs[0].shape[0], shape[-1]
    device = xs[0].device
    # The grads in one contiguous buffer: [R, N, D] for a stack, else [N, R, D] (the entries' [R, D] slices)
    dx = torch.empty((R, N, D) if stacked else (N, R, D), dtype=xs[0].dtype, device=device)
    d_entry, d_row = (dx.stride(1), dx.stride(0)) if stacked else (dx.stride(0), dx.stride(1))
    kw_c, q_c = kw.contiguous(), q.contiguous()
    f64 = compute_f64(*xs, kw_c, q_c, g)
    block_r, block_d, num_warps = _bwd_blocks(R, D)
    # 8 warps an SM (single-warp programs 8 an SM, wider ones one): resident at any register count, each
    # program keeping STAGES - 1 tiles in flight
    iters, G = row_chunks(triton.cdiv(R, block_r), device, programs, per_sm=max(1, 8 // num_warps))
    partial = torch.empty(G, D, dtype=torch.float64 if f64 else torch.float32, device=device)
    if R == 0:
        partial.zero_()
    else:
        stages = pipeline_stages(block_r * block_d * xs[0].element_size())
        with on_device(device):
            _attnres_bwd_kernel[(G,)](
                xs, s_rows, s_entry, dx, d_entry, d_row, g, g.stride(0), kw_c, q_c, partial, R, D, eps,
                N=N, ITERS=iters, STACKED=stacked, BLOCK_R=block_r, BLOCK_D=block_d, F64=f64, STAGES=stages,
                num_warps=num_warps,
            )
    dkw, dq = reduce_partials(partial, kw, q, f64, **WIDE_REDUCE)
    return dx, dkw, dq


@torch.library.custom_op("kimik3::attnres_mix", mutates_args=())
def _attnres_mix_op(entries: list[torch.Tensor], stacked: bool, key_norm_weight: torch.Tensor, query: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """``entries``: the N entries, or (``stacked``) one tensor [..., N, D]."""
    return attnres_mix_forward(entries[0] if stacked else entries, key_norm_weight, query, eps)


@_attnres_mix_op.register_fake
def _(entries, stacked, key_norm_weight, query, eps):
    shape = entries[0].shape[:-2] + entries[0].shape[-1:] if stacked else entries[0].shape
    return entries[-1].new_empty(shape)


@torch.library.custom_op("kimik3::attnres_mix_backward", mutates_args=())
def _attnres_mix_backward_op(entries: list[torch.Tensor], stacked: bool, key_norm_weight: torch.Tensor,
                             query: torch.Tensor, eps: float, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """[the entries' grads in one tensor (``_grads_in_one``), key_norm_weight's grad, query's grad]."""
    return list(_grads_in_one(entries[0] if stacked else entries, key_norm_weight, query, eps, grad_out))


@_attnres_mix_backward_op.register_fake
def _(entries, stacked, key_norm_weight, query, eps, grad_out):
    N, shape = (entries[0].shape[-2] if stacked else len(entries)), grad_out.shape
    empties = [torch.empty_like(key_norm_weight), torch.empty_like(query)]
    if not _stacked_grads(entries[0] if stacked else entries, grad_out):
        return [entries[0].new_empty((N, *shape))] + empties
    promoted = functools.reduce(torch.promote_types, [x.dtype for x in entries] + [grad_out.dtype])
    return [grad_out.new_empty((*shape[:-1], N, shape[-1]), dtype=promoted)] + empties


def _setup_grads(ctx, inputs, output) -> None:
    entries, ctx.stacked, kw, q, ctx.eps = inputs
    ctx.save_for_backward(kw, q, *entries)


def _grads(ctx, grad_out):
    kw, q, *entries = ctx.saved_tensors
    dx, dkw, dq = _attnres_mix_backward_op(entries, ctx.stacked, kw, q, ctx.eps, grad_out)
    if ctx.stacked:
        dentries = [_split_entry_grads(dx, entries[0], True)]
    else:
        dentries = _split_entry_grads(dx, entries, _stacked_grads(entries, grad_out))
    return dentries, None, dkw, dq, None


_attnres_mix_op.register_autograd(_grads, setup_context=_setup_grads)


def attnres_mix(entries: Sequence[torch.Tensor] | torch.Tensor, key_norm_weight: torch.Tensor,
                query: torch.Tensor, eps: float) -> torch.Tensor:
    """The AttnRes mix of ``entries`` in the Triton kernels, differentiable -> [..., D] in the last entry's dtype.

    entries: N tensors [..., D] of one shape (fp32, bf16, fp16 or fp64; dtypes may differ: each is read in its own
    and its grad comes back in it), or one stacked tensor [..., N, D] (as ``torch.stack(entries, -2)``).
    key_norm_weight, query: [D], any float dtype (grads in their dtypes). eps: a Python float. All math in fp32
    (fp64 when any input is fp64). CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (no dispatch here:
    ``glue_backend`` and ``AttnResMix`` choose). Forward: one launch; backward: two. A custom operator
    (``kimik3::attnres_mix``): torch.compile traces around it.
    """
    stacked = isinstance(entries, torch.Tensor)
    if not stacked and not isinstance(entries, (list, tuple)):
        raise ValueError(f"entries must be a list of tensors or one stacked tensor, got {describe(entries)}")
    listed = [entries] if stacked else list(entries)
    if not through_operator(*listed, key_norm_weight, query):
        return attnres_mix_forward(entries, key_norm_weight, query, eps)
    return _attnres_mix_op(listed, stacked, key_norm_weight, query, check_eps(eps))   # (it checks the rest)


@_jit
def _entry_ptrs(xs, s_rows, s_entry, n: tl.constexpr, rows64, cols, STACKED: tl.constexpr):
    """Addresses [BLOCK_R, BLOCK_D] of entry n's rows: the n-th tensor of the tuple, or slot n of the stack."""
    if STACKED:
        return xs[0] + n * s_entry + rows64[:, None] * s_rows[0] + cols[None, :]
    else:
        return xs[n] + rows64[:, None] * s_rows[n] + cols[None, :]


@_jit
def _attnres_fwd_kernel(
    xs, s_rows, s_entry, kw_ptr, q_ptr, nw_ptr, out_ptr, a_ptr, s_a, sum_ptr, R, D, eps, norm_eps,
    N: tl.constexpr, STACKED: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Program (row block): out[rows] = sum_n softmax_n(s)_n v_n, one read of each entry (online softmax); with
    NORM, RMSNorm(out) with weight nw, out first rounded to the output's dtype (as a separate norm would read it);
    with ADD, the last entry is v + a, rounded to the sum's dtype and stored there (as a separate add)."""
    ct = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < R)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    w = tl.load(kw_ptr + cols, mask=cmask, other=0.0).to(ct) * tl.load(q_ptr + cols, mask=cmask, other=0.0).to(ct)
    m = tl.full([BLOCK_R], float("-inf"), dtype=ct)
    lsum = tl.zeros([BLOCK_R], dtype=ct)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=ct)
    for n in tl.static_range(N):
        v = tl.load(_entry_ptrs(xs, s_rows, s_entry, n, rows64, cols, STACKED), mask=mask, other=0.0).to(ct)
        if ADD and n == N - 1:
            a = tl.load(a_ptr + rows64[:, None] * s_a + cols[None, :], mask=mask, other=0.0).to(ct)
            v = (v + a).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + rows64[:, None] * D + cols[None, :], v, mask=mask)
            v = v.to(ct)
        r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        s = tl.sum((v * r[:, None]) * w[None, :], axis=1)  # keys first, then the dot (the module's order)
        m_new = tl.maximum(m, s)
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        lsum = lsum * alpha + e
        acc = acc * alpha[:, None] + e[:, None] * v
        m = m_new
    out = acc / lsum[:, None]
    if NORM:
        x = out.to(out_ptr.dtype.element_ty).to(ct)
        nw = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(ct)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + norm_eps)
        out = (x * r[:, None]) * nw[None, :]
    tl.store(out_ptr + rows64[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _entry_base(xs, s_rows, s_entry, n, N: tl.constexpr, STACKED: tl.constexpr):
    """(base pointer, row stride) of entry n, a runtime index: slot n of the stack, or the n-th pointer of the
    tuple picked by a chain of scalar selects (the tuple's entries share one dtype)."""
    if STACKED:
        return xs[0] + n.to(tl.int64) * s_entry, s_rows[0]
    else:
        base = xs[0]
        s_row = s_rows[0]
        for k in tl.static_range(1, N):
            base = tl.where(n == k, xs[k], base)
            s_row = tl.where(n == k, s_rows[k], s_row)
        return base, s_row


@_jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@_jit
def _attnres_bwd_kernel(
    xs, s_rows, s_entry, dx_ptr, d_entry, d_row, g_ptr, s_g, kw_ptr, q_ptr, part_ptr, R, D, eps,
    N: tl.constexpr, ITERS: tl.constexpr, STACKED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    F64: tl.constexpr, STAGES: tl.constexpr,
):
    """Program p of G: the ITERS row blocks from p ITERS on (those past R masked off), in one loop of ITERS (2 N + 1)
    steps, pipelined over STAGES stages, that loads one tile a step: a block's g (step 0), its entries (steps 1..N,
    pass 1: r_n, s_n and dp_n = g . v_n into an online softmax, with running max m, sum l and u = sum e^(s-m) dp),
    its entries again (steps N+1..2N, pass 2: from L2, as the block's N tiles were just read; r_n, s_n, dp_n
    recomputed by the same code, so the same values; dv_n written to dx_ptr + n d_entry + row d_row). No per-entry
    state is kept (N costs no registers). The program's share of dL/dw = sum ds_n r_n v_n goes to part_ptr[p]
    ([G, D], fp32 or fp64).

    The loads clamp their rows to R - 1 instead of masking them: their masks are then loop-invariant, and the
    pipeline carries no per-stage mask tiles (the rows past R compute garbage that is neither stored nor summed)."""
    ct = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(kw_ptr + cols, mask=cmask, other=0.0).to(ct) * tl.load(q_ptr + cols, mask=cmask, other=0.0).to(ct)
    dw = tl.zeros([BLOCK_R, BLOCK_D], dtype=ct)
    g = tl.zeros([BLOCK_R, BLOCK_D], dtype=ct)
    m = tl.full([BLOCK_R], float("-inf"), dtype=ct)
    lsum = tl.zeros([BLOCK_R], dtype=ct)
    u = tl.zeros([BLOCK_R], dtype=ct)
    row0 = pid.to(tl.int64) * (ITERS * BLOCK_R)
    for t in tl.range(0, ITERS * (2 * N + 1), num_stages=STAGES):
        j = t % (2 * N + 1)
        n = tl.where(j <= N, j - 1, j - N - 1)
        rows = row0 + (t // (2 * N + 1)) * BLOCK_R + tl.arange(0, BLOCK_R)
        rows_in = tl.minimum(rows, R - 1)
        base, s_row = _entry_base(xs, s_rows, s_entry, n, N, STACKED)
        base = tl.where(j == 0, g_ptr, base)
        s_row = tl.where(j == 0, s_g, s_row)
        tile = tl.load(base + rows_in[:, None] * s_row + cols[None, :], mask=cmask[None, :], other=0.0).to(ct)
        if j == 0:
            g = tile
            m = tl.full([BLOCK_R], float("-inf"), dtype=ct)
            lsum = tl.zeros([BLOCK_R], dtype=ct)
            u = tl.zeros([BLOCK_R], dtype=ct)
        else:
            v = tile
            r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
            s, dp = tl.reduce(((v * r[:, None]) * w[None, :], g * v), 1, _add2)  # keys first, then the dot
            if j <= N:
                m_new = tl.maximum(m, s)
                alpha = tl.exp(m - m_new)
                e = tl.exp(s - m_new)
                lsum = lsum * alpha + e
                u = u * alpha + e * dp
                m = m_new
            else:
                p = tl.exp(s - m) / lsum
                dsr = p * (dp - u / lsum) * r  # ds_n r_n, ds_n = p_n (dp_n - sum_m p_m dp_m)
                sr_d = s * r / D
                dv = p[:, None] * g + dsr[:, None] * (w[None, :] - sr_d[:, None] * v)
                rmask = rows < R
                tl.store(dx_ptr + n.to(tl.int64) * d_entry + rows[:, None] * d_row + cols[None, :],
                         dv.to(dx_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
                dw += tl.where(rmask, dsr, 0.0)[:, None] * v
    tl.store(part_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=cmask)
