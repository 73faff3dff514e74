"""The Gluon emulator (tests/gluon_emulator.py) on small kernels written for it: what it computes, and that it
refuses what would fail or hang on the GPU -- a tile read before its TMA load or cp.async group was waited for,
an mbarrier whose expected bytes never arrive, a producer waiting on the wrong phase, a store outside its tensor.
The kernels are also compiled for sm_90 (``python -m tests.test_gluon_emulator``, in a process without the
interpreter), so what the emulator runs is Gluon that the GPU compiler accepts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from tests.gluon_emulator import GluonDeadlock, emulate, last_json_line, run_without_interpreter  # noqa: E402

TILE_BYTES = gl.constexpr(64 * 64 * 4)  # one fp32 tile (a constexpr: jit code reads it)


@gluon.constexpr_function
def _layout():
    return gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])


@gluon.jit
def _tile_offsets(row0, BL: gl.constexpr):
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    return gl.expand_dims(row0 + r, 1) * 64 + gl.expand_dims(c, 0)


@gluon.jit
def _double_kernel(x_d, y_ptr, WAIT: gl.constexpr, NBYTES: gl.constexpr, ROW_SHIFT: gl.constexpr):
    """y[tile] = 2 x[tile] for program i's 64-row tile, loaded by TMA (WAIT: after waiting for it)."""
    BL: gl.constexpr = _layout()
    s = gl.allocate_shared_memory(gl.float32, [64, 64], x_d.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.expect(bar.index(0), NBYTES)
    tma.async_copy_global_to_shared(x_d, [gl.program_id(0) * 64, 0], bar.index(0), s)
    if WAIT:
        mbarrier.wait(bar.index(0), 0)
    gl.store(y_ptr + _tile_offsets(gl.program_id(0) * 64 + ROW_SHIFT, BL), s.load(BL) * 2.0)
    mbarrier.invalidate(bar.index(0))


@gluon.jit
def _ring_producer(ready, empty, ring, x_d, n_items, NB: gl.constexpr, SKEW: gl.constexpr):
    for i in range(n_items):
        slot = i % NB
        mbarrier.wait(empty.index(slot), ((i // NB) & 1) ^ 1 ^ SKEW)  # a fresh slot's "previous" phase: parity 1
        mbarrier.expect(ready.index(slot), TILE_BYTES)
        tma.async_copy_global_to_shared(x_d, [i * 64, 0], ready.index(slot), ring.index(slot))


@gluon.jit
def _ring_consumer(ready, empty, ring, w_s, y_ptr, n_items, NB: gl.constexpr):
    BL: gl.constexpr = _layout()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    for i in range(n_items):
        slot = i % NB
        mbarrier.wait(ready.index(slot), (i // NB) & 1)
        a = gl.convert_layout(ring.index(slot).load(BL).to(gl.bfloat16),
                              gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
        acc = warpgroup_mma(a, w_s, gl.zeros([64, 64], gl.float32, layout=MMA), use_acc=False)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        gl.store(y_ptr + _tile_offsets(i * 64, BL), gl.convert_layout(acc, BL))


@gluon.jit
def _ring_kernel(x_d, w_d, y_ptr, n_items, NB: gl.constexpr, SKEW: gl.constexpr):
    """y[tile i] = bf16(x[tile i]) @ w for n_items tiles streamed through an NB-slot ring by a loader partition."""
    ring = gl.allocate_shared_memory(gl.float32, [NB, 64, 64], x_d.layout)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], w_d.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    wbar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NB):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(wbar.index(0), count=1)
    mbarrier.expect(wbar.index(0), 64 * 64 * 2)
    tma.async_copy_global_to_shared(w_d, [0, 0], wbar.index(0), w_s)
    mbarrier.wait(wbar.index(0), 0)
    gl.warp_specialize([(_ring_consumer, (ready, empty, ring, w_s, y_ptr, n_items, NB)),
                        (_ring_producer, (ready, empty, ring, x_d, n_items, NB, SKEW))], [1], [40])


def _desc(x: torch.Tensor, dtype) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [64, 64], layout)


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def test_tma_load_zero_fills_past_the_end_and_stores_land():
    """Two programs of 64 rows over a 100-row tensor: the second tile's last 28 rows come back as zeros."""
    x = _rows(100)
    y = torch.full((128, 64), float("nan"))
    emulate(_double_kernel, (2,), _desc(x, gl.float32), y, WAIT=True, NBYTES=TILE_BYTES, ROW_SHIFT=0)
    assert torch.equal(y[:100], 2 * x) and torch.equal(y[100:], torch.zeros(28, 64))


def test_a_tile_read_without_waiting_is_stale():
    """The TMA load lands only when a wait sees its phase complete: read without the wait, the tile is still the
    NaN that fresh shared memory holds."""
    y = torch.zeros(64, 64)
    emulate(_double_kernel, (1,), _desc(_rows(64), gl.float32), y, WAIT=False, NBYTES=TILE_BYTES, ROW_SHIFT=0)
    assert y.isnan().all()


def test_a_barrier_whose_bytes_never_arrive_is_a_deadlock():
    """expect() announces more bytes than the copy brings: the phase never completes, the GPU would hang."""
    with pytest.raises(GluonDeadlock, match="never completed"):
        emulate(_double_kernel, (1,), _desc(_rows(64), gl.float32), torch.zeros(64, 64), WAIT=True,
                NBYTES=TILE_BYTES + 4, ROW_SHIFT=0, timeout=0.5)


def test_a_store_outside_its_tensor_is_refused():
    """Shifted by one row, the last program's store runs one row past y: named, with the offset."""
    with pytest.raises(IndexError, match="outside y_ptr"):
        emulate(_double_kernel, (2,), _desc(_rows(128), gl.float32), torch.zeros(128, 64), WAIT=True,
                NBYTES=TILE_BYTES, ROW_SHIFT=1)


@pytest.mark.parametrize("NB", [1, 2, 3])
def test_warp_specialised_ring(NB):
    """A loader partition and a consumer partition hand seven tiles through an NB-slot ring (ready / empty
    barriers, the ring wrapping around); the consumer multiplies each by w on ``warpgroup_mma`` (bf16 operands,
    fp32 accumulation)."""
    x, w = _rows(7 * 64, seed=1), _rows(64, seed=2).bfloat16()
    y = torch.full((7 * 64, 64), float("nan"))
    emulate(_ring_kernel, (1,), _desc(x, gl.float32), _desc(w, gl.bfloat16), y, 7, NB=NB, SKEW=0)
    torch.testing.assert_close(y, x.bfloat16().float() @ w.float(), rtol=1e-6, atol=1e-6)


def test_a_launch_records_no_autograd():
    """Inputs that require grad (a launch from an autograd Function's forward) through a wrapping ring, in every
    partition's thread: the output is computed and, as on the GPU, does not come to require grad."""
    x, w = _rows(3 * 64, seed=1).requires_grad_(), _rows(64, seed=2).bfloat16().requires_grad_()
    y = torch.full((3 * 64, 64), float("nan"))
    emulate(_ring_kernel, (1,), _desc(x, gl.float32), _desc(w, gl.bfloat16), y, 3, NB=2, SKEW=0)
    assert not y.requires_grad
    torch.testing.assert_close(y, x.detach().bfloat16().float() @ w.detach().float(), rtol=1e-6, atol=1e-6)


def test_a_producer_waiting_on_the_wrong_phase_is_a_deadlock():
    """The loader waits for parity 0 of a fresh "empty" barrier, a phase nobody completes: the GPU would hang."""
    x, w = _rows(2 * 64), _rows(64).bfloat16()
    with pytest.raises(GluonDeadlock):
        emulate(_ring_kernel, (1,), _desc(x, gl.float32), _desc(w, gl.bfloat16), torch.zeros(2 * 64, 64), 2,
                NB=2, SKEW=1, timeout=0.5)


@gluon.jit
def _grid_kernel(y_ptr):
    """y[z, y, x] = (x, y, z) program ids and the grid's extent, one [1, 8] row per program."""
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0])
    i = gl.arange(0, 8, layout=gl.SliceLayout(0, BL))
    pid = (gl.program_id(2) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(0) + gl.program_id(0)
    v = gl.where(i == 0, gl.program_id(0), gl.where(i == 1, gl.program_id(1), gl.where(i == 2, gl.program_id(2), 0)))
    v = gl.where(i == 3, gl.num_programs(0), gl.where(i == 4, gl.num_programs(1), gl.where(i == 5, gl.num_programs(2),
                                                                                          v)))
    gl.store(y_ptr + gl.expand_dims(pid * 8 + i, 0), gl.expand_dims(v, 0))


@pytest.mark.parametrize("grid", [(5,), (3, 2), (2, 3, 2)])
def test_program_ids_cover_the_grid(grid):
    """One to three grid dimensions: every program runs once with its own ids, and num_programs is the grid."""
    full = tuple(grid) + (1,) * (3 - len(grid))
    y = torch.full((full[2], full[1], full[0], 8), -1, dtype=torch.int32)
    emulate(_grid_kernel, grid, y)
    ids = torch.stack(torch.meshgrid(*(torch.arange(n) for n in reversed(full)), indexing="ij")[::-1], -1)
    assert torch.equal(y[..., :3], ids.to(torch.int32))
    assert torch.equal(y[..., 3:6], torch.tensor(full, dtype=torch.int32).expand(*full[::-1], 3))


@gluon.jit
def _sum_and_max(a0, a1, b0, b1):
    return a0 + b0, gl.maximum(a1, b1)


@gluon.jit
def _two_reductions_kernel(x_ptr, y_ptr):
    """y[0] = x's row sums, y[1] = its row maxima: one two-operand ``gl.reduce`` over a [64, 64] tile."""
    BL: gl.constexpr = _layout()
    x = gl.load(x_ptr + _tile_offsets(0, BL))
    total, top = gl.reduce((x, x), 1, _sum_and_max)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    gl.store(y_ptr + r, total)
    gl.store(y_ptr + 64 + r, top)


def test_a_two_operand_reduction():
    """``gl.reduce`` over a tuple of tiles: each operand reduced by its own half of the combine function."""
    x = _rows(64)
    y = torch.zeros(2, 64)
    emulate(_two_reductions_kernel, (1,), x, y)
    torch.testing.assert_close(y[0], x.sum(1))
    assert torch.equal(y[1], x.amax(1))


@gluon.jit
def _pairs_kernel(a_ptr, b_ptr, y_ptr, s_ar, ASM: gl.constexpr):
    """y[r, :] = the int32 words of a's strided rows r, each times b's in bf16x2 (``ASM``), split into their halves
    (join, then reshape): y [4, 16] bf16 from a, b [4, 8] int32."""
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    r = gl.arange(0, 4, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 8, layout=gl.SliceLayout(0, BL))
    a = gl.load(a_ptr + gl.expand_dims(r * s_ar, 1) + gl.expand_dims(c, 0))
    b = gl.load(b_ptr + gl.expand_dims(r * 8, 1) + gl.expand_dims(c, 0))
    p = gl.inline_asm_elementwise(ASM, "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)
    halves = gl.join(p.to(gl.int16).to(gl.bfloat16, bitcast=True), (p >> 16).to(gl.int16).to(gl.bfloat16,
                                                                                          bitcast=True))
    y = gl.reshape(halves, [4, 16])
    YL: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0])
    gl.store(y_ptr + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, YL)) * 16, 1)
             + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, YL)), 0), gl.convert_layout(y, YL))


def _bf16_words(t: torch.Tensor) -> torch.Tensor:
    """A bf16 [..., 2n] tensor's bits as int32 words [..., n] (element 2i in the low half)."""
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("asm, scale", [("mul.rn.bf16x2 $0, $1, $2;", 1.0), (
    "{ .reg .b32 c, t; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 t, $1, c; mul.rn.bf16x2 $0, t, $2; }", 2.0 ** 126)])
def test_bf16x2_multiplies_round_each_half(asm, scale):
    """The bf16x2 multiply snippets: each half rounded to bf16 (nearest even), after the 2^126 step where there
    is one; a strided pointer reads the rows it spans; join puts the low half first."""
    gen = torch.Generator().manual_seed(0)
    a_wide = torch.randn(4, 24, generator=gen).to(torch.bfloat16)                # rows of 24: stride 12 words
    a = a_wide[:, :16]
    if scale != 1.0:
        a = (a.float() * 2.0 ** -126).to(torch.bfloat16)                        # exact: subnormals kept
        a_wide[:, :16] = a
    b = (1 + torch.rand(4, 16, generator=gen)).to(torch.bfloat16)
    y = torch.zeros(4, 16, dtype=torch.bfloat16)
    words = a_wide.view(torch.int32)                                            # [4, 12], rows' first 8 words used
    emulate(_pairs_kernel, (1,), words[:, :8], _bf16_words(b), y, words.stride(0), ASM=asm)
    ref = ((a.float() * scale).to(torch.bfloat16).float() * b.float()).to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16))
    truncated = ((a.float() * scale).to(torch.bfloat16).float() * b.float()).view(torch.int32) >> 16
    assert not torch.equal(ref.view(torch.int16).to(torch.int32), truncated)   # the rounding is what is checked


def test_an_unknown_asm_or_a_bitcast_across_widths_is_refused():
    w = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="inline asm"):
        emulate(_pairs_kernel, (1,), w, w, torch.zeros(4, 16, dtype=torch.bfloat16), 8, ASM="add.s32 $0, $1, $2;")


@gluon.jit
def _mma_v2_kernel(a_ptr, b_ptr, y_ptr):
    """y [16, 8] fp32 = a [16, 32] @ b [32, 8] (bf16) on ``mma_v2``, accumulated onto 1."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])
    ra = gl.arange(0, 16, layout=gl.SliceLayout(1, BL))
    ka = gl.arange(0, 32, layout=gl.SliceLayout(0, BL))
    a = gl.load(a_ptr + gl.expand_dims(ra * 32, 1) + gl.expand_dims(ka, 0))
    kb = gl.arange(0, 32, layout=gl.SliceLayout(1, BL))
    cb = gl.arange(0, 8, layout=gl.SliceLayout(0, BL))
    b = gl.load(b_ptr + gl.expand_dims(kb * 8, 1) + gl.expand_dims(cb, 0))
    acc = gl.full([16, 8], 1.0, gl.float32, layout=MMA)
    acc = mma_v2(gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)),
                 gl.convert_layout(b, gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)), acc)
    gl.store(y_ptr + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, MMA)) * 8, 1)
             + gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, MMA)), 0), acc)


def test_mma_v2_multiplies_in_fp32():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(32, 8, generator=gen).to(torch.bfloat16)
    y = torch.zeros(16, 8)
    emulate(_mma_v2_kernel, (1,), a, b, y)
    torch.testing.assert_close(y, a.float() @ b.float() + 1, rtol=1e-6, atol=1e-6)


@gluon.jit
def _cp_async_ring_kernel(x_ptr, y_ptr, n, S: gl.constexpr, WAIT: gl.constexpr):
    """y[i] = x[i] * 2 for the rows i < n of x [rows, 32] (int32), each row staged through an S-slot ring of shared
    memory by cp.async, S - 1 rows in flight; ``WAIT`` groups left in flight at each read (S - 1 is right)."""
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 1], [1, 0])
    SM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    ring = gl.allocate_shared_memory(gl.int32, [S, 4, 8], SM)
    r = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, BL)), 1)
    c = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, BL)), 0)
    for s in gl.static_range(S - 1):
        async_copy.async_copy_global_to_shared(ring.index(s), x_ptr + s * 32 + r * 8 + c, mask=s < n)
        async_copy.commit_group()
    for i in range(n):
        nxt = i + S - 1
        async_copy.async_copy_global_to_shared(ring.index(nxt % S), x_ptr + nxt * 32 + r * 8 + c, mask=nxt < n)
        async_copy.commit_group()
        async_copy.wait_group(WAIT)
        gl.store(y_ptr + i * 32 + r * 8 + c, ring.index(i % S).load(BL) * 2)
    async_copy.wait_group(0)


@pytest.mark.parametrize("S", [2, 3])
def test_cp_async_lands_at_its_wait_group(S):
    x = torch.arange(5 * 32, dtype=torch.int32).reshape(5, 32) - 70
    y = torch.zeros_like(x)
    emulate(_cp_async_ring_kernel, (1,), x, y, 5, S=S, WAIT=S - 1)
    assert torch.equal(y, x * 2)
    y.zero_()   # one more group left in flight at each read: the row read is not there yet
    emulate(_cp_async_ring_kernel, (1,), x, y, 5, S=S, WAIT=S)
    assert not torch.equal(y, x * 2)


@gluon.jit
def _split_reshape_kernel(x_ptr, lo_ptr, hi_ptr):
    """x [4, 8] through shared memory, read back as [4, 4, 2] (a reshaped view), split into its even and odd
    columns."""
    BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 2], [4, 4, 2], [1, 1, 1], [2, 1, 0])
    r = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, BL)), 1)
    c = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, BL)), 0)
    smem = gl.allocate_shared_memory(gl.int32, [4, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    smem.store(gl.load(x_ptr + r * 8 + c))
    lo, hi = gl.split(smem.reshape([4, 4, 2]).load(L3))
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    r2 = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, L2)), 1)
    c2 = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L2)), 0)
    gl.store(lo_ptr + r2 * 4 + c2, lo)
    gl.store(hi_ptr + r2 * 4 + c2, hi)


def test_shared_reshape_and_split():
    x = torch.arange(32, dtype=torch.int32).reshape(4, 8) * 3 - 7
    lo, hi = torch.zeros(4, 4, dtype=torch.int32), torch.zeros(4, 4, dtype=torch.int32)
    emulate(_split_reshape_kernel, (1,), x, lo, hi)
    assert torch.equal(lo, x[:, 0::2]) and torch.equal(hi, x[:, 1::2])


def _compile_for_sm90() -> list:
    """Compile the kernels for sm_90 (``benchmarks/kda_sm90_report.Sm90Compiler``): ptxas's rows."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    x, w = _rows(128), _rows(64).bfloat16()
    compiler(_double_kernel, [_desc(x, gl.float32), torch.zeros(128, 64)],
             dict(WAIT=True, NBYTES=TILE_BYTES, ROW_SHIFT=0), (2,))
    compiler(_ring_kernel, [_desc(x, gl.float32), _desc(w, gl.bfloat16), torch.zeros(128, 64), 2],
             dict(NB=2, SKEW=0, num_warps=4), (1,))
    compiler(_grid_kernel, [torch.zeros(3, 2, 8, dtype=torch.int32)], dict(num_warps=1), (2, 3))
    compiler(_two_reductions_kernel, [x, torch.zeros(2, 64)], dict(num_warps=4), (1,))
    words = torch.zeros(4, 8, dtype=torch.int32)
    compiler(_pairs_kernel, [words, words, torch.zeros(4, 16, dtype=torch.bfloat16), 8],
             dict(ASM="mul.rn.bf16x2 $0, $1, $2;", num_warps=1), (1,))
    compiler(_mma_v2_kernel, [_rows(16).bfloat16()[:, :32].contiguous(), torch.zeros(32, 8, dtype=torch.bfloat16),
                              torch.zeros(16, 8)], dict(num_warps=1), (1,))
    compiler(_cp_async_ring_kernel, [torch.zeros(5, 32, dtype=torch.int32), torch.zeros(5, 32, dtype=torch.int32), 5],
             dict(S=3, WAIT=2, num_warps=1), (1,))
    compiler(_split_reshape_kernel, [torch.zeros(4, 8, dtype=torch.int32)] + [torch.zeros(4, 4, dtype=torch.int32)] * 2,
             dict(num_warps=1), (1,))
    return compiler.rows


def test_the_kernels_compile_for_sm90(tmp_path):
    """In a process of its own, without the interpreter the test session switches on and with an empty Triton
    cache: the kernels compile, without spilling."""
    rows = last_json_line(run_without_interpreter(["-m", "tests.test_gluon_emulator"], tmp_path))
    assert len(rows) == 8 and all(r["spill_store_bytes"] == 0 for r in rows), rows


if __name__ == "__main__":
    print(json.dumps([{k: r[k] for k in ("registers", "shared_bytes", "spill_store_bytes")}
                      for r in _compile_for_sm90()]))
