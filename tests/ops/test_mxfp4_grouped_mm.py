"""Tests of the grouped matmul over MXFP4 expert weights (kimik3/ops/moe/mxfp4_grouped_mm.py): its registers kernel,
its dequantize route (kimik3/ops/moe/mxfp4_dequantize.py, then ``torch._grouped_mm``) and the torch path against
``dequantize`` + a per-expert fp32 matmul; the dequantize kernel bit for bit against ``dequantize``.

The kernel's products are exact (the activations come in bf16 or fp32, the decoded weights are exact in both), so
fp32 activations are compared to the fp32 reference within fp32 accumulation error, bf16 ones within that plus half
a bf16 step of the output. Cases: several experts with empty ones among them (first, middle, last), experts of
fewer rows than a tile and of several tiles, partial row, column and K tiles, one K block and several, more row
tiles than a swizzle group, the default blocks, rows past offsets[-1] (zeros), no rows; every E2M1 code under many
scale codes and one-hot rows (the decode bit for bit), scale codes 0 (an fp32 subnormal, CPU only) and 255 (NaN);
strided inputs; the backend choice, the block choice at K3's shapes and the input checks. On a GPU also K3's shapes
against ``torch._grouped_mm`` on the dequantised weights.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's (casts and dots: tests/kernel_testing.py; elementwise arithmetic and exact
bf16 -> fp32 casts: ``interpreter_bf16_arithmetic`` here) and every load and store bounds-checked
(tests/triton_bounds.py). The interpreter
runs one program at a time: the shapes are the smallest that reach each path.

Legend: R rows (sorted by expert), E experts, I in features, O out features.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3.ops.moe.grouped_mm import ExpertGroups
from kimik3.quant.kernel_order import to_kernel_order, to_ocp_order, to_order
from kimik3.quant.mx import MXTensor, dequantize, quantize
from kimik3.ops.moe.mxfp4_dequantize import mxfp4_dequantize
from kimik3.ops.moe.mxfp4_grouped_mm import (DEQUANTIZE_ROWS, MMA_ROWS, SYNC_ROWS, gemv_blocks, mma_available,
                                              mxfp4_backend, mxfp4_blocks, mxfp4_grouped_mm, mxfp4_mma_order,
                                              mxfp4_route, wgmma_available)
from tests.kernel_testing import DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)

FP32_EPS = 2.0 ** -24


@pytest.fixture(autouse=True, scope="module")
def interpreter_bf16_arithmetic(request):
    """Under the interpreter: bf16 elementwise arithmetic as on the GPU, through fp32 and rounded to nearest even,
    and bf16 -> fp32 casts exact. Triton 3.6's interpreter stores bf16 as uint16 and applies the numpy op to those
    integers (the kernel decodes the weights with bf16 multiplies), and its bf16 -> fp32 cast rounds subnormals
    to one significant bit. Restored after the module."""
    request.getfixturevalue("interpreter_setup")  # first: its bf16 fix is what the teardown restores
    if ON_GPU or not HAS_KERNELS:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    binary_op = builder.binary_op

    def to_fp32(data):
        return torch.from_numpy(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16).float().numpy()

    def bf16_binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar != tl.bfloat16:
            return binary_op(self, lhs, rhs, op)
        out = torch.from_numpy(np.asarray(op(to_fp32(lhs.data), to_fp32(rhs.data)), dtype=np.float32))
        return interp.TensorHandle(out.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return interp.TensorHandle(to_fp32(src.data), tl.float32)
        return cast(self, src, dst_type)

    cast = builder.cast_impl
    builder.binary_op, builder.cast_impl = bf16_binary_op, cast_impl
    try:
        yield
    finally:
        builder.binary_op, builder.cast_impl = binary_op, cast


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch):
    """``torch.empty`` hands out NaN-filled floating tensors here, so that an output element the kernel never
    writes cannot pass for a zero or a stale right value."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", filled)


def weights(E, I, O, seed=0, order="kernel"):
    """An MXFP4 weight [E, I, O] (blocks along I), its codes in ``order``: N(0, 1) with a per-column spread of
    2^-3..2^3, so that the blocks take several scale codes."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(E, I, O, generator=gen) * torch.exp2(torch.randint(-3, 4, (E, 1, O), generator=gen).float())
    return to_order(quantize(w.to(DEV), "mxfp4", axis=-2), order)


def rows(R, I, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(R, I, generator=gen).to(DEV, dtype)


def reference(x_RI, mx, offsets):
    """Per expert in fp32: x[start:end] @ dequantize(W)[e]; rows past the last offset zero."""
    w = dequantize(mx)
    y = torch.zeros(x_RI.shape[0], w.shape[2], device=x_RI.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        y[start:end] = x_RI[start:end].float() @ w[e]
        start = end
    return y


def excess(y, x_RI, mx, offsets):
    """|y - ref| less its bound: fp32 accumulation error (2 I eps of |x| @ |w|), plus half a bf16 step of ref for
    bf16 output; <= 0 where y is close enough."""
    ref = reference(x_RI, mx, offsets)
    bound = reference(x_RI.float().abs(), _abs(mx), offsets) * (2 * x_RI.shape[1] * FP32_EPS)
    if y.dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0 ** -8
    assert y.dtype == x_RI.dtype and y.shape == ref.shape
    return (y.float() - ref).abs() - bound


def assert_close_to_reference(y, x_RI, mx, offsets):
    over = excess(y, x_RI, mx, offsets)
    assert bool((over <= 0).all()), f"max excess {over.max().item():.3g}"


def _abs(mx):
    """The MX weight of |W|: the sign bits (3 and 7 of each byte in the OCP order) cleared."""
    ocp = to_ocp_order(mx)
    return dataclasses.replace(ocp, codes=ocp.codes & 0x77)


def weight_of(codes, scales):
    """The MXFP4 weight [E, I, O] of kernel-order ``codes`` [E, O, I/2] and ``scales`` (any strides; malformed ones
    too: the shape is read off the codes where they have one)."""
    three_d = isinstance(codes, torch.Tensor) and codes.ndim == 3
    shape = (codes.shape[0], 2 * codes.shape[2], codes.shape[1]) if three_d else ()
    return MXTensor(codes, scales, "mxfp4", 32, 1, shape, order="kernel")


def offsets_of(counts):
    return torch.cumsum(torch.tensor(counts), 0).to(DEV, torch.int32)


# (E, I, O, rows an expert, block_m, block_n, block_k)
CASES = [
    (4, 96, 40, [3, 0, 17, 1], 16, 32, 64),      # empty middle expert; 2 row tiles; partial N and K (96 = 64 + 32)
    (3, 32, 16, [0, 5, 0], 16, 16, 32),          # empty first and last; one K block; O one tile
    (2, 128, 24, [40, 9], 32, 16, 32),           # 4 K blocks; an expert of 2 tiles at BLOCK_M = 32
    (10, 64, 40, [1, 2, 0, 1, 1, 17, 1, 1, 0, 1], 16, 32, 64),  # 9 real row tiles: two swizzle groups of 8
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E, I, O, counts, bm, bn, bk", CASES)
def test_kernel_matches_the_reference(E, I, O, counts, bm, bn, bk, dtype):
    mx = weights(E, I, O)
    offsets = offsets_of(counts)
    x = rows(sum(counts), I, dtype)
    with torch.no_grad():
        y = mxfp4_grouped_mm(x, mx, offsets, backend="triton", route="registers", block_m=bm,
                             block_n=bn, block_k=bk)
    assert_close_to_reference(y, x, mx, offsets)


@needs_kernels
@pytest.mark.parametrize("counts", [[2, 1], [300, 20]])  # 16-row tiles; 256-row tiles (160 rows an expert)
def test_default_blocks_and_expert_groups(counts):
    mx = weights(2, 64, 24)
    groups = ExpertGroups.of(torch.tensor(counts, device=DEV))
    x = rows(sum(counts), 64, torch.bfloat16)
    y = mxfp4_grouped_mm(x, mx, groups, backend="triton")
    assert_close_to_reference(y, x, mx, groups.offsets_E)


def check_offsets_out_of_range_stay_in_bounds(matmul):
    """``matmul(x, mx, offsets) -> y`` with offsets past R, negative or decreasing: a meaningless result but no
    access outside x, the weights or y (every load and store is bounds-checked, under the interpreter or the Gluon
    emulator)."""
    mx = weights(3, 64, 16)
    x = rows(4, 64, torch.bfloat16)
    for counts in ([9, -3, 2], [-5, 0, 1]):
        with torch.no_grad():
            y = matmul(x, mx, torch.tensor(counts, dtype=torch.int32, device=DEV))
        assert y.shape == (4, 16)


@needs_kernels
def test_gemv_route_with_offsets_out_of_range_stays_in_bounds():
    check_offsets_out_of_range_stay_in_bounds(
        lambda x, mx, offsets: mxfp4_grouped_mm(x, mx, offsets, backend="triton", route="gemv"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_matches_the_reference(dtype):
    mx = weights(4, 96, 40)
    offsets = offsets_of([3, 0, 17, 1])
    x = rows(21, 96, dtype)
    y = mxfp4_grouped_mm(x, mx, offsets, backend="torch")
    assert_close_to_reference(y, x, mx, offsets)
    assert torch.equal(mxfp4_grouped_mm(x, to_ocp_order(mx), offsets, backend="torch"), y)   # either code order
    if DEV == "cpu":
        assert torch.equal(mxfp4_grouped_mm(x, mx, offsets), y)  # auto: the torch path on CPU


@needs_kernels
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rows_past_the_last_offset_are_zero(backend):
    mx = weights(3, 32, 16)
    offsets = offsets_of([2, 0, 3])
    x = rows(9, 32, torch.float32)
    with torch.no_grad():
        y = mxfp4_grouped_mm(x, mx, offsets, backend=backend, block_m=16, block_n=16, block_k=32)
    assert_close_to_reference(y, x, mx, offsets)
    assert torch.equal(y[5:], torch.zeros_like(y[5:]))


@needs_kernels
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_rows(backend):
    mx = weights(3, 32, 16)
    x = rows(0, 32, torch.bfloat16)
    y = mxfp4_grouped_mm(x, mx, offsets_of([0, 0, 0]), backend=backend)
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


def every_code_weight(E, I, O, scale_codes):
    """codes [E, O, I/2] walking every byte value in the OCP order (so every E2M1 code in both nibbles), the given
    scale codes [E, O, I/32]; in kernel order."""
    codes = (torch.arange(E * O * (I // 2)) * 7 % 256).to(torch.uint8).reshape(E, O, I // 2)
    return to_kernel_order(MXTensor(codes.to(DEV), scale_codes.to(DEV, torch.uint8), "mxfp4", 32, 1, (E, I, O)))


@needs_kernels
@pytest.mark.parametrize("route", ["registers", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_decodes_exactly(dtype, route):
    """One-hot rows (x = I x I identity for each of 2 experts): y is W's rows, bit for bit, for every byte value and
    scale codes 100..163 (values 2^-27 .. 2^36 times the element)."""
    E, I, O = 2, 64, 16
    mx = every_code_weight(E, I, O, torch.arange(100, 100 + E * O * 2).reshape(E, O, 2))
    x = torch.eye(I, device=DEV, dtype=dtype).repeat(E, 1)
    offsets = offsets_of([I] * E)
    with torch.no_grad():
        blocks = dict(block_m=16, block_n=16, block_k=64) if route == "registers" else {}
        y = mxfp4_grouped_mm(x, mx, offsets, backend="triton", route=route, **blocks)
    w = dequantize(mx)
    assert torch.equal(y.float(), torch.cat(list(w.to(dtype).float())))


def assert_same_bf16(w_EOI, mx):
    """w_EOI [E, O, I] is ``dequantize(mx)`` in bf16 ([E, I, O]) transposed, bit for bit (NaN where it is NaN)."""
    ref = dequantize(mx, torch.bfloat16).transpose(1, 2)
    assert w_EOI.dtype == torch.bfloat16 and w_EOI.shape == ref.shape and w_EOI.is_contiguous()
    assert torch.equal(w_EOI.isnan(), ref.isnan())
    assert torch.equal(w_EOI.nan_to_num(0.0).view(torch.int16), ref.nan_to_num(0.0).view(torch.int16))


@needs_kernels
@pytest.mark.parametrize("E, I, O", [(3, 96, 40), (1, 32, 16), (2, 288, 72)])  # partial K and N tiles; one block;
def test_dequantize_kernel_is_bit_exact(E, I, O):                             # two K tiles, the second partial
    assert_same_bf16(mxfp4_dequantize(weights(E, I, O)), weights(E, I, O))


@needs_kernels
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # scale code 254: inf, as asked
def test_dequantize_kernel_every_code_and_scale():
    """Every byte value under scale codes 0 (2^-127: bf16 subnormal results), 1, 100..160, 254 (past bf16's range:
    inf, as ``dequantize`` gives) and 255 (NaN)."""
    E, I, O = 2, 64, 40
    scales = torch.arange(100, 100 + E * O * 2).reshape(E, O, 2) % 61 + 100
    scales[0, :4, 0] = torch.tensor([0, 1, 254, 255])
    mx = every_code_weight(E, I, O, scales)
    w = mxfp4_dequantize(mx)
    assert_same_bf16(w, mx)
    assert bool(w.isinf().any()) and bool(w.isnan().any()) and bool(((w != 0) & (w.abs() < 2.0 ** -126)).any())


@needs_kernels
def test_dequantize_kernel_strided_codes_and_bad_inputs():
    mx = weights(2, 64, 24)
    codes = torch.zeros(2, 24, 64, dtype=torch.uint8, device=DEV)
    codes[:, :, ::2] = mx.codes
    strided = weight_of(codes[:, :, ::2], mx.scales.transpose(1, 2).contiguous().transpose(1, 2))
    assert_same_bf16(mxfp4_dequantize(strided), mx)
    shifted = torch.zeros(mx.codes.numel() + 1, dtype=torch.uint8, device=DEV)
    shifted[1:] = mx.codes.flatten()                      # the bytes not 4-aligned: read as words after a copy
    assert_same_bf16(mxfp4_dequantize(weight_of(shifted[1:].view(mx.codes.shape), mx.scales)), mx)
    for w, match in ((mx.codes, "must be an MXTensor"),
                     (to_ocp_order(mx), "in 'ocp' order; the GPU kernels read them in kernel order"),
                     (weight_of(mx.codes[0], mx.scales), "codes must be a 3-D uint8"),
                     (weight_of(mx.codes, mx.scales.float()), "scales must be a 3-D uint8"),
                     (weight_of(mx.codes[:, :, :8], mx.scales), "multiple of 32"),
                     (weight_of(mx.codes, mx.scales[:, :, :1]), r"scales must be \[E, O, I/32\]"),
                     (weight_of(mx.codes, mx.scales.to("meta")), "scales are on meta")):
        with pytest.raises(ValueError, match=match):
            mxfp4_dequantize(w)


@needs_kernels
def test_dequantize_kernel_writes_into_a_transposed_out():
    """``out=`` the [E, O, I] transpose of a row-major [E, I, O] buffer (what the dequantize route decodes into):
    the same bits, nothing written outside it; a wrong ``out`` is named."""
    E, I, O = 3, 96, 40
    mx = weights(E, I, O)
    buf = torch.full((E + 1, I, O), 7.0, dtype=torch.bfloat16, device=DEV)
    w = mxfp4_dequantize(mx, out=buf[:E].transpose(1, 2))
    assert w.data_ptr() == buf.data_ptr()
    assert_same_bf16(buf[:E].transpose(1, 2).contiguous(), mx)
    assert torch.equal(buf[E], torch.full_like(buf[E], 7.0))
    with pytest.raises(ValueError, match=r"out must be a bf16 tensor \[E, O, I\]"):
        mxfp4_dequantize(mx, out=buf[:E])


# (E, I, O, rows an expert, rows past the last offset), with empty experts. The dequantize route (bf16 only):
DEQUANTIZE_CASES = [(4, 96, 40, [3, 0, 17, 1], 2), (3, 64, 16, [0, 5, 0], 0), (2, 32, 8, [40, 9], 7)]
# the gemv route (fp32 and bf16): partial N and K tiles (96 of 128); two K tiles, the second partial (288 = 256 +
# 32); one K block and O over two column tiles
GEMV_CASES = [(4, 96, 40, [3, 0, 17, 1], 2), (3, 288, 16, [0, 2, 0], 0), (2, 32, 24, [1, 1], 1)]


@needs_kernels
@pytest.mark.parametrize("route, dtype, E, I, O, counts, extra",
                         [("dequantize", torch.bfloat16, *case) for case in DEQUANTIZE_CASES]
                         + [("gemv", dtype, *case) for case in GEMV_CASES for dtype in (torch.float32, torch.bfloat16)])
def test_route_matches_the_reference(route, dtype, E, I, O, counts, extra):
    mx = weights(E, I, O)
    offsets = offsets_of(counts)
    x = rows(sum(counts) + extra, I, dtype)
    with torch.no_grad():
        y = mxfp4_grouped_mm(x, mx, offsets, backend="triton", route=route)
    assert_close_to_reference(y, x, mx, offsets)
    assert torch.equal(y[sum(counts):], torch.zeros_like(y[sum(counts):]))


@needs_kernels
def test_auto_route_at_the_threshold():
    """From DEQUANTIZE_ROWS rows an expert on average, "auto" takes the dequantize route, and the two routes agree
    within a bf16 step of the output."""
    E, I, O = 2, 32, 16
    R = DEQUANTIZE_ROWS * E
    assert mxfp4_route(R - 1, E, O, torch.bfloat16) == "registers"
    assert mxfp4_route(R, E, O, torch.bfloat16) == "dequantize"
    mx = weights(E, I, O)
    offsets = offsets_of([R // 2 - 5, R // 2 + 5])
    x = rows(R, I, torch.bfloat16)
    with torch.no_grad():
        auto = mxfp4_grouped_mm(x, mx, offsets, backend="triton")
        registers = mxfp4_grouped_mm(x, mx, offsets, backend="triton", route="registers")
    assert_close_to_reference(auto, x, mx, offsets)
    assert_close_to_reference(registers, x, mx, offsets)


def test_route_choice():
    for dtype in (torch.bfloat16, torch.float32):
        assert mxfp4_route(8, 8, 3072, dtype) == "gemv"                 # at most one row an expert: gemv
        assert mxfp4_route(9, 8, 3072, dtype) == "registers"
    assert mxfp4_route(1000, 8, 3072, torch.bfloat16, "gemv") == "gemv"
    big = DEQUANTIZE_ROWS * 8
    assert mxfp4_route(big, 8, 3072, torch.bfloat16) == "dequantize"
    assert mxfp4_route(big, 8, 3072, torch.float32) == "registers"      # fp32 activations: registers only
    assert mxfp4_route(big, 8, 3068, torch.bfloat16) == "registers"     # O not a multiple of 8
    assert mxfp4_route(8, 8, 3072, torch.bfloat16, "dequantize") == "dequantize"
    assert mxfp4_route(big, 8, 3072, torch.bfloat16, "registers") == "registers"
    with pytest.raises(ValueError, match="route must be one of"):
        mxfp4_route(8, 8, 3072, torch.bfloat16, "fast")
    for dtype, O in ((torch.float32, 3072), (torch.bfloat16, 3068)):
        with pytest.raises(ValueError, match="route 'dequantize' runs torch._grouped_mm"):
            mxfp4_route(8, 8, O, dtype, "dequantize")
    # where the mma kernel runs: bf16 up to MMA_ROWS rows an expert with its wgmma form (Hopper), SYNC_ROWS without,
    # whatever O
    assert mxfp4_route(8, 8, 3072, torch.bfloat16, mma=True) == "mma"
    assert mxfp4_route(MMA_ROWS * 8, 8, 3068, torch.bfloat16, mma=True, wgmma=True) == "mma"
    assert mxfp4_route(MMA_ROWS * 8 + 1, 8, 3072, torch.bfloat16, mma=True, wgmma=True) == "registers"
    assert mxfp4_route(SYNC_ROWS * 8, 8, 3072, torch.bfloat16, mma=True) == "mma"
    assert mxfp4_route(SYNC_ROWS * 8 + 1, 8, 3072, torch.bfloat16, mma=True) == "registers"
    assert mxfp4_route(8, 8, 3072, torch.float32, mma=True) == "gemv"
    assert mxfp4_route(big, 8, 3072, torch.bfloat16, "mma", mma=True) == "mma"
    for dtype, mma in ((torch.float32, True), (torch.bfloat16, False)):
        with pytest.raises(ValueError, match="route 'mma' multiplies bf16 activations"):
            mxfp4_route(8, 8, 3072, dtype, "mma", mma=mma)


@needs_kernels
def test_mma_available_asks_for_sm90_and_gluon_wgmma_for_hopper(monkeypatch):
    import importlib

    from kimik3.ops.kda import dispatch

    module = importlib.import_module("kimik3.ops.moe.mxfp4_grouped_mm")  # (the package exports the function)

    assert not mma_available(torch.device("cpu")) and not wgmma_available(torch.device("cpu"))
    for capability, gluon, expected, wgmma in (((9, 0), True, True, True), ((10, 0), True, True, False),
                                               ((8, 0), True, False, False), ((9, 0), False, False, False)):
        module._mma_available.cache_clear()
        module._wgmma_available.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        monkeypatch.setattr(dispatch, "gluon_available", lambda g=gluon: g)
        assert mma_available(torch.device("cuda", 0)) is expected, (capability, gluon)
        assert wgmma_available(torch.device("cuda", 0)) is wgmma, (capability, gluon)
    module._mma_available.cache_clear()
    module._wgmma_available.cache_clear()


@needs_kernels
def test_mma_route_refused_where_it_cannot_run():
    mx = weights(2, 32, 16)
    if not ON_GPU:
        with pytest.raises(ValueError, match="route 'mma'"):
            mxfp4_grouped_mm(rows(3, 32, torch.bfloat16), mx, offsets_of([1, 2]), backend="triton", route="mma")
    with pytest.raises(ValueError, match="route 'mma'"):
        mxfp4_grouped_mm(rows(3, 32, torch.float32), mx, offsets_of([1, 2]), backend="triton", route="mma")


@needs_kernels
def test_mma_order_refused_where_the_wgmma_kernel_does_not_run():
    """x in the MMA's order is the wgmma kernel's alone: elsewhere (the CPU, fp32, the registers route, too many rows
    an expert) the call says so; a width other than whole 128-element steps, or a strided x, is named too."""
    from kimik3.ops.moe.mxfp8_rows import mma_k_order_reference

    mx = weights(2, 96, 16)
    x = mma_k_order_reference(rows(3, 96, torch.bfloat16)).contiguous()
    refused = [dict(route="registers"), dict(backend="torch")]
    if not wgmma_available(x.device):
        refused.append({})
    for kwargs in refused:
        with pytest.raises(ValueError, match="read by the wgmma kernel only"):
            mxfp4_grouped_mm(x, mx, offsets_of([1, 2]), mma_order=True, **kwargs)
    with pytest.raises(ValueError, match="read by the wgmma kernel only"):
        mxfp4_grouped_mm(x.float(), mx, offsets_of([1, 2]), mma_order=True)
    many = mma_k_order_reference(rows(300, 96, torch.bfloat16)).contiguous()
    with pytest.raises(ValueError, match="read by the wgmma kernel only"):
        mxfp4_grouped_mm(many, mx, offsets_of([150, 300]), mma_order=True)
    with pytest.raises(ValueError, match="width 128"):
        mxfp4_grouped_mm(x[:, :96], mx, offsets_of([1, 2]), mma_order=True)
    with pytest.raises(ValueError, match="contiguous"):
        mxfp4_grouped_mm(torch.cat([x, x], 1)[:, :128], mx, offsets_of([1, 2]), mma_order=True)
    assert not mxfp4_mma_order(3, 2, torch.bfloat16, torch.device("cpu"))


@needs_kernels
def test_block_sizes_refused_on_the_other_routes():
    mx = weights(2, 32, 16)
    x = rows(3, 32, torch.bfloat16)
    for route in ("dequantize", "gemv"):
        with pytest.raises(ValueError, match=f"tune the registers route; this call takes the {route} route"):
            mxfp4_grouped_mm(x, mx, offsets_of([1, 2]), backend="triton", route=route, block_m=16)


@needs_kernels
@pytest.mark.skipif(ON_GPU, reason="a GPU dot may flush fp32 subnormals")
@pytest.mark.parametrize("route", ["registers", "gemv"])
def test_scale_code_zero_is_two_to_the_minus_127(route):
    E, I, O = 1, 32, 16
    mx = every_code_weight(E, I, O, torch.zeros(E, O, 1))
    x = torch.eye(I, device=DEV)
    y = mxfp4_grouped_mm(x, mx, offsets_of([I]), backend="triton", route=route)
    assert torch.equal(y, dequantize(mx)[0]) and bool((y != 0).any())


def check_every_code_decodes_exactly(matmul, O=16, scale_codes=None):
    """``matmul(x, codes, scales, offsets) -> y`` (bf16; codes in kernel order) on one-hot rows, 128 an expert: y is
    W's rows bit for bit, for every byte value and the scale codes ``scale_codes`` [2 O 4] (default 100..163)."""
    E, I = 2, 128
    if scale_codes is None:
        scale_codes = torch.arange(100, 100 + E * O * 4) % 64 + 100
    mx = every_code_weight(E, I, O, scale_codes.reshape(E, O, 4))
    x = torch.eye(I, device=DEV, dtype=torch.bfloat16).repeat(E, 1)
    y = matmul(x, mx.codes, mx.scales, offsets_of([I] * E))
    assert torch.equal(y.float(), torch.cat(list(dequantize(mx).to(torch.bfloat16).float())))


def check_strided_inputs(matmul):
    """``matmul(x, codes, scales, offsets) -> y`` (bf16; codes in kernel order) with x strided by rows and
    column-major, codes strided along the bytes, scales transposed in memory."""
    E, I, O = 2, 64, 24
    mx = weights(E, I, O)
    offsets = offsets_of([3, 2])
    x = rows(5, I + 32, torch.bfloat16)[:, 16:16 + I]
    x_col = rows(5, I, torch.bfloat16).t().contiguous().t()
    codes = torch.zeros(E, O, I, dtype=torch.uint8, device=DEV)
    codes[:, :, ::2] = mx.codes
    scales = mx.scales.transpose(1, 2).contiguous().transpose(1, 2)
    for xi in (x, x_col):
        assert_close_to_reference(matmul(xi, codes[:, :, ::2], scales, offsets), xi, mx, offsets)


def check_nan_scale_poisons_its_column_of_its_expert(matmul):
    """``matmul(x, mx, offsets) -> y`` with scale code 255 (NaN) in one block of expert 1's column 3: NaN exactly
    in that column of that expert's rows, every other element close to the reference."""
    E, I, O = 2, 64, 16
    mx = weights(E, I, O, order="ocp")
    mx.scales[1, 3, 1] = 255
    mx.codes[1, 3, 16:] = 0x22  # elements 1.0: an infinite scale would give +inf here, not NaN
    mx = to_kernel_order(mx)
    offsets = offsets_of([2, 3])
    x = rows(5, I, torch.bfloat16).abs() + 0.125
    with torch.no_grad():
        y = matmul(x, mx, offsets)
    nan = torch.zeros(5, O, dtype=torch.bool, device=DEV)
    nan[2:, 3] = True
    assert torch.equal(y.isnan(), nan)
    assert bool((excess(y, x, mx, offsets)[~nan] <= 0).all())


@needs_kernels
@pytest.mark.parametrize("route", ["registers", "gemv"])
def test_nan_scale_poisons_its_column_of_its_expert(route):
    check_nan_scale_poisons_its_column_of_its_expert(
        lambda x, mx, offsets: mxfp4_grouped_mm(x, mx, offsets, backend="triton", route=route))


@needs_kernels
@pytest.mark.parametrize("backend, route", [("triton", "registers"), ("triton", "gemv"), ("torch", "auto")])
def test_strided_inputs(backend, route):
    E, I, O = 2, 64, 24
    mx = weights(E, I, O)
    offsets = offsets_of([3, 2])
    wide = rows(5, I + 32, torch.float32)
    x = wide[:, 16:16 + I]                               # row stride I + 32
    x_col = rows(5, I, torch.float32).t().contiguous().t()  # column-major
    codes = torch.zeros(E, O, I, dtype=torch.uint8, device=DEV)
    codes[:, :, ::2] = mx.codes                           # stride 2 along the code bytes
    scales = mx.scales.transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad():
        for xi in (x, x_col):
            blocks = dict(block_m=16, block_n=32, block_k=32) if route == "registers" else {}
            y = mxfp4_grouped_mm(xi, weight_of(codes[:, :, ::2], scales), offsets, backend=backend, route=route,
                                 **blocks)
            assert_close_to_reference(y, xi, mx, offsets)


@needs_kernels
def test_backend_choice():
    x = rows(2, 32, torch.bfloat16)
    assert mxfp4_backend(x) == ("triton" if ON_GPU else "torch")
    assert mxfp4_backend(x, "torch") == "torch" and mxfp4_backend(x, "triton") == "triton"
    with pytest.raises(ValueError, match="backend must be"):
        mxfp4_backend(x, "cuda")


@needs_kernels
def test_blocks_at_k3_shapes():
    """K3's expert matmuls: one row tile an expert up to 64 rows (64 weight columns a tile over 8 local experts, 128
    over 112), 128 x 128 x 64 from 65 rows; the gemv route's 16 x 256 tiles."""
    for O, I in ((3072, 3584), (3584, 3072)):
        assert mxfp4_blocks(8, 8, O, I) == (16, 64, 64, 4, 1)
        assert gemv_blocks(O, I) == (16, 256, 4)
        assert mxfp4_blocks(32 * 8, 8, O, I) == (32, 64, 64, 4, 1)
        assert mxfp4_blocks(64 * 8, 8, O, I) == (64, 64, 64, 4, 1)
        assert mxfp4_blocks(32 * 112, 112, O, I) == (32, 128, 64, 4, 1)    # K3 on 8 GPUs: a wide grid
        assert mxfp4_blocks(128 * 8, 8, O, I) == (128, 128, 64, 4, 1)
        assert mxfp4_blocks(2048 * 8, 8, O, I) == (128, 128, 64, 4, 1)
    assert mxfp4_blocks(3, 2, 24, 32)[:3] == (16, 32, 32)  # clipped to small O and I
    assert mxfp4_blocks(2048 * 8, 8, 3072, 3584, torch.float32) == (32, 64, 32, 4, 1)
    assert gemv_blocks(8, 64) == (16, 64, 4)


@needs_kernels
def test_bad_inputs_are_named():
    E, I, O = 2, 64, 16
    mx = weights(E, I, O)
    x = rows(3, I, torch.bfloat16)
    off = offsets_of([1, 2])
    c, s = mx.codes, mx.scales
    bad = [
        ((x[0], mx, off), "x_RI must be 2-D"),
        ((x.half(), mx, off), "x_RI must be bf16 or fp32"),
        ((x, c, off), "the weight must be an MXTensor"),
        ((x, dataclasses.replace(mx, fmt="mxfp8_e4m3"), off), "the weight must be MXFP4"),
        ((x, dataclasses.replace(mx, order="ocp_le"), off), "code order must be one of"),
        ((x, weight_of(c.to(torch.int8), s), off), "codes must be a 3-D uint8"),
        ((x, weight_of(c[0], s), off), "codes must be a 3-D uint8"),
        ((x, weight_of(c, s.float()), off), "scales must be a 3-D uint8"),
        ((x[:, :48], weight_of(c[:, :, :24], s), off), "multiple of 32"),
        ((x, weight_of(c[:, :, :16], s), off), "bytes a row"),
        ((x, dataclasses.replace(mx, axis=2), off), "blocked along I"),
        ((x, weight_of(c, s[:, :, :1]), off), r"scales must be \[E, O, I/32\]"),
        ((x, weight_of(c, s[:, :8]), off), r"scales must be \[E, O, I/32\]"),
        ((x, mx, off.long()), "must be int32"),
        ((x, mx, off[:1]), r"must be 1-D \[E=2\]"),
        ((x, mx, [1, 3]), "groups must be ExpertGroups"),
        ((x, weight_of("codes", s), off), "codes must be a tensor"),
        ((x, weight_of(c, s.to("meta")), off), "scales are on meta"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            mxfp4_grouped_mm(*args)
    for kw, match in (({"block_m": 24}, "block_m must be a power of two"), ({"block_k": 16}, "block_k"),
                      ({"block_n": 8}, "block_n"), ({"num_warps": 3}, "num_warps"), ({"num_stages": 0}, "num_stages")):
        with pytest.raises(ValueError, match=match):
            mxfp4_grouped_mm(x, mx, off, backend="triton", route="registers", **kw)
    with pytest.raises(ValueError, match="the GPU kernels read them in kernel order"):
        mxfp4_grouped_mm(x, to_ocp_order(mx), off, backend="triton")
    with pytest.raises(ValueError, match="non-decreasing"):
        mxfp4_grouped_mm(x, mx, offsets_of([2, -1]), backend="torch")
    with pytest.raises(ValueError, match="non-decreasing"):
        mxfp4_grouped_mm(x, mx, offsets_of([2, 2]) + 2, backend="torch")
    with pytest.raises(RuntimeError, match="forward only"):
        mxfp4_grouped_mm(x.clone().requires_grad_(), mx, off, backend="triton")


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
# mma where it runs (mma.sync to 8 rows an expert, wgmma at 16, 32, 64 rows a pass); registers; dequantize
@pytest.mark.parametrize("per_expert", [1, 4, 16, 32, 64, 256, DEQUANTIZE_ROWS + 1])
@pytest.mark.parametrize("O, I", [(3072, 3584), (3584, 3072)])
def test_k3_shapes_against_grouped_mm_on_gpu(O, I, per_expert):
    """K3's expert matmuls (8 local experts, one of them empty) against torch._grouped_mm on the dequantised bf16
    weights (same products, another summation order: a bf16 step of the output)."""
    E = 8
    mx = weights(E, I, O)
    counts = torch.full((E,), per_expert)
    counts[3] = 0
    groups = ExpertGroups.of(counts.to(DEV))
    x = rows(int(counts.sum()), I, torch.bfloat16)
    w = dequantize(mx, torch.bfloat16)
    y = mxfp4_grouped_mm(x, mx, groups)
    ref = torch._grouped_mm(x, w, offs=groups.offsets_E).float()
    assert ((y.float() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-3 * ref.abs().max()).all()


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("route", ["mma", "registers", "dequantize"])
def test_cuda_graph_capture_and_replay(route):
    """Captured once, replayed with new rows and new offsets (another split of the same R rows, an expert emptied):
    both routes read the offsets on the device, so the replay follows them."""
    E, I, O = 4, 96, 40
    mx = weights(E, I, O)
    offsets = offsets_of([3, 0, 17, 1])
    x = rows(21, I, torch.bfloat16)
    with torch.no_grad():
        mxfp4_grouped_mm(x, mx, offsets, route=route)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = mxfp4_grouped_mm(x, mx, offsets, route=route)
        x.copy_(rows(21, I, torch.bfloat16, seed=2))
        offsets.copy_(offsets_of([10, 5, 0, 6]))
        graph.replay()
    assert_close_to_reference(y.clone(), x, mx, offsets)
