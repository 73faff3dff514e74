"""Tests of the paged absorbed-MLA decode attention (kimik3/ops/mla/paged_decode.py): the Triton kernel and the torch
reference against a dense fp64 reference built independently (each row's latents copied out token by token, plain
softmax), the input checks, the backend choice and the split heuristic.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets before
anything imports triton), with every load and store bounds-checked (tests/triton_bounds.py), at the smallest shapes
that reach each code path: one and several tiles, tiles straddling blocks (P not a multiple of BLOCK_S), a table's
full capacity, padded head blocks (H = 3, 20), a length-0 padding row, shuffled block ids with out-of-range padding
past each row's length, bf16 / fp32 / mixed dtypes, strided inputs and int32 tables, and the split path with empty
splits. With CUDA the same cases run on the GPU, plus K3's widths and a CUDA-graph replay.

Legend: B rows, H heads, C latent width, R slice width, W = C + R, N pool blocks, P tokens per block, M table width.
"""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.ops.mla import (
    check_paged_mla_inputs,
    default_num_splits,
    launch_paged_mla_decode,
    paged_mla_backend,
    paged_mla_decode,
    paged_mla_decode_torch,
)
from tests.kernel_testing import (DEV, HAS_KERNELS, ON_GPU, interpreter_setup,  # noqa: F401 (interpreter_setup: autouse)
                                  needs_kernels)
from tests.numerics import rel_rms

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")

# rel_rms against the fp64 dense reference. bf16: the output's rounding alone is ~1.6e-3, and the kernel's
# probabilities enter the second dot in bf16 (as in GatedMLA._absorbed); the interpreter's cases measure ~1.8e-3.
TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-3, torch.float16: 2e-3}


def make_inputs(B, H, C, R, P, M, lengths, dtype=torch.float32, q_dtype=None, seed=0, device=DEV):
    """Random q_latent, q_slice, pool and a shuffled block table (distinct ids over a pool with spare blocks), with
    table entries past each row's length set out of range: they must never be read."""
    gen = torch.Generator().manual_seed(seed)
    N = B * M + 3
    pool_NPW = torch.randn(N, P, C + R, generator=gen).to(dtype)
    ids_BM = torch.randperm(N, generator=gen)[: B * M].view(B, M)
    lengths_B = torch.tensor(lengths, dtype=torch.int64)
    used_BM = torch.arange(M)[None, :] < (lengths_B[:, None] + P - 1) // P
    tables_BM = torch.where(used_BM, ids_BM, N + 1000)
    q_dtype = q_dtype or dtype
    ql_BHC = torch.randn(B, H, C, generator=gen).to(q_dtype)
    qs_BHR = torch.randn(B, H, R, generator=gen).to(q_dtype)
    return [x.to(device) for x in (ql_BHC, qs_BHR, pool_NPW, tables_BM, lengths_B)]


def dense_reference(ql_BHC, qs_BHR, pool_NPW, tables_BM, lengths_B, scale):
    """fp64: row b's tokens copied out one by one into contiguous latents, then a plain softmax."""
    B, H, C = ql_BHC.shape
    P = pool_NPW.shape[1]
    out = torch.zeros(B, H, C, dtype=torch.float64)
    pool, tables = pool_NPW.cpu().double(), tables_BM.cpu().tolist()
    for b, length in enumerate(lengths_B.cpu().tolist()):
        if length == 0:
            continue
        kv_SW = torch.stack([pool[tables[b][p // P], p % P] for p in range(length)])
        scores_HS = (ql_BHC[b].cpu().double() @ kv_SW[:, :C].T + qs_BHR[b].cpu().double() @ kv_SW[:, C:].T) * scale
        out[b] = torch.softmax(scores_HS, dim=-1) @ kv_SW[:, :C]
    return out


def check_against_references(out, args, scale, tol):
    ref_dense = dense_reference(*args, scale)
    ref_torch = paged_mla_decode_torch(*args, scale)
    assert out.shape == ref_torch.shape and out.dtype == args[0].dtype and out.device == args[0].device
    assert torch.isfinite(out).all()
    assert rel_rms(ref_dense, out.cpu()) < tol
    assert rel_rms(ref_dense, ref_torch.cpu()) < tol
    padding = args[4] == 0
    assert (out[padding] == 0).all(), "a length-0 row must give zeros"


# (B, H, C, R, P, M, lengths, pool dtype, q dtype, num_splits, block_s): the interpreter's cases, each reaching
# paths the others do not.
KERNEL_CASES = {
    # one tile per row (BLOCK_S 64 > 24): lengths 1, P - 1, P, P + 1 and a padding row; 3 heads in a 16-head block
    "fp32_one_tile": (5, 3, 32, 16, 8, 3, [1, 7, 8, 9, 0], torch.float32, None, 1, None),
    # 16-token tiles over 12-token blocks (tiles straddle blocks), a full table (48), two head blocks (20 heads)
    "bf16_tiles_straddle_blocks": (4, 20, 32, 16, 12, 4, [48, 13, 0, 30], torch.bfloat16, None, 1, 16),
    # 3 splits: full splits, a split ending mid-tile, empty splits (length 1: two of three), an all-empty row
    "fp32_splits": (5, 3, 32, 16, 8, 6, [0, 1, 17, 48, 33], torch.float32, None, 3, 16),
    # the combine writing bf16, 20 heads, a row shorter than one tile per split
    "bf16_splits": (3, 20, 32, 16, 8, 4, [25, 0, 3], torch.bfloat16, None, 2, 16),
    # fp32 queries over a bf16 pool: exact fp32 dots, fp32 output; wider C and R
    "mixed_q_fp32_pool_bf16": (2, 5, 64, 32, 8, 3, [17, 24], torch.bfloat16, torch.float32, 1, 16),
}


@needs_kernels
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_references(case):
    B, H, C, R, P, M, lengths, dtype, q_dtype, splits, block_s = KERNEL_CASES[case]
    args = make_inputs(B, H, C, R, P, M, lengths, dtype, q_dtype)
    scale = (C + R) ** -0.5 * 2.0  # sharper than uniform
    if block_s is None:
        out = paged_mla_decode(*args, scale, backend="triton", num_splits=splits)
    else:
        out = launch_paged_mla_decode(*args, scale, num_splits=splits, block_s=block_s)
    check_against_references(out, args, scale, TOL[q_dtype or dtype])


@needs_kernels
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("splits", [1, 2])
def test_several_tokens_a_row_equal_their_rows_repeated(backend, splits):
    # A verification's T = 3 queries of each row through one table row and one length (token t attends to
    # lengths[b] + t tokens), against the same queries with the tables repeated and the lengths counted on.
    B, T, H, C, R, P, M = 3, 3, 4, 32, 16, 8, 4
    ql, qs, pool, tables, _ = make_inputs(B * T, H, C, R, P, M, [0] * (B * T), torch.bfloat16, seed=4)
    tables = tables[:B].clone()
    ids = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(1))[:B * M].view(B, M)
    tables.copy_(ids.to(tables.device))
    first = torch.tensor([1, 9, 20], device=pool.device)   # the first token's count; the last attends 22 of 32
    scale = (C + R) ** -0.5
    kw = {"num_splits": splits} if backend == "triton" else {}
    got = paged_mla_decode(ql, qs, pool, tables, first, scale, tokens_per_row=T, backend=backend, **kw)
    rows_tables = tables.repeat_interleave(T, dim=0)
    rows_lengths = (first[:, None] + torch.arange(T, device=first.device)).flatten()
    want = dense_reference(ql, qs, pool, rows_tables, rows_lengths, scale)
    assert got.shape == (B * T, H, C)
    assert rel_rms(want, got.cpu()) < TOL[torch.bfloat16]
    if backend == "triton":
        one_by_one = paged_mla_decode(ql, qs, pool, rows_tables, rows_lengths, scale, backend="triton", **kw)
        assert torch.equal(got, one_by_one)
    with pytest.raises(ValueError, match="whole number of rows of 2 tokens"):
        paged_mla_decode(ql, qs, pool, tables, first, scale, tokens_per_row=2, backend=backend)
    with pytest.raises(ValueError, match="tables_BM must be a 2-D tensor"):
        paged_mla_decode(ql, qs, pool, rows_tables, first, scale, tokens_per_row=T, backend=backend)


@needs_kernels
def test_kernel_strided_inputs_and_int32_indices():
    """Any strides: q as transposed views, the pool a slice of wider storage, int32 table and lengths taken as
    strided views; one launch with splits (and the same without)."""
    B, H, C, R, P, M = 3, 4, 32, 16, 8, 3
    ql, qs, pool, tables, lengths = make_inputs(B, H, C, R, P, M, [20, 5, 0])
    ql_strided = ql.transpose(1, 2).contiguous().transpose(1, 2)
    qs_strided = qs.transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.zeros(pool.shape[0], P, C + R + 8, device=DEV)
    wide[..., 4:4 + C + R] = pool
    pool_strided = wide[..., 4:4 + C + R]
    tables_strided = torch.stack([tables, tables], dim=-1).to(torch.int32)[..., 0]
    lengths_strided = torch.stack([lengths, lengths], dim=-1).to(torch.int32)[:, 1]
    assert not any(x.is_contiguous() for x in (ql_strided, qs_strided, pool_strided, tables_strided, lengths_strided))
    args = [ql_strided, qs_strided, pool_strided, tables_strided, lengths_strided]
    for splits in (1, 2):
        out = launch_paged_mla_decode(*args, 0.2, num_splits=splits, block_s=16)
        check_against_references(out, [ql, qs, pool, tables, lengths], 0.2, TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("C,R,P,M,lengths", [
    (32, 16, 8, 3, [1, 7, 8, 9, 0, 24]),
    (48, 8, 5, 4, [20, 3, 0, 11]),  # widths the kernel refuses: the torch path takes any
])
def test_torch_reference_matches_dense(dtype, C, R, P, M, lengths):
    args = make_inputs(len(lengths), 3, C, R, P, M, lengths, dtype, device="cpu")
    out = paged_mla_decode(*args, 0.3)  # "auto" on CPU tensors: the torch path
    assert torch.equal(out, paged_mla_decode_torch(*args, 0.3))
    check_against_references(out, args, 0.3, TOL[dtype])


def test_backend_choice():
    x = torch.zeros(1, 1, 16)
    assert paged_mla_backend(x) == "torch"  # CPU: torch, even under the interpreter
    assert paged_mla_backend(x, "torch") == "torch"
    with pytest.raises(ValueError, match="backend must be"):
        paged_mla_backend(x, "cuda")
    if HAS_KERNELS:
        assert paged_mla_backend(x.to(DEV), "TRITON") == "triton"
    if ON_GPU:
        assert paged_mla_backend(x.cuda()) == "triton"


def test_default_num_splits_from_static_shapes():
    assert default_num_splits(4, 6, 1 << 20, None) == 1  # no GPU
    assert default_num_splits(32, 6, 1 << 20, 132) == 1  # 192 programs fill 132 SMs
    assert default_num_splits(1, 6, 32768, 132) == 22  # ceil(132 / 6)
    assert default_num_splits(1, 1, 1 << 20, 132) == 64  # MAX_SPLITS
    assert default_num_splits(1, 6, 600, 132) == 3  # a split per 256 tokens of capacity at most
    assert default_num_splits(2, 1, 0, 132) == 1


def _good_args(device="cpu"):
    return make_inputs(2, 3, 32, 16, 8, 2, [5, 9], device=device)


BAD_INPUTS = [
    (0, lambda a: a[0][0], "q_latent_BHC must be a 3-D tensor"),
    (1, lambda a: a[1][:1], "q_slice_BHR must be a 3-D tensor"),
    (1, lambda a: a[1].double(), "q_slice_BHR must have q_latent_BHC's dtype"),
    (0, lambda a: a[0].long(), "q_latent_BHC must be float32, bfloat16 or float16"),
    (2, lambda a: a[2][..., :40], r"pool_NPW must be a 3-D tensor \[N, P, C \+ R = 48\]"),
    (2, lambda a: a[2].long(), "pool_NPW must be float32"),
    (2, lambda a: a[2][:, :0], "pool_NPW must hold at least one token"),
    (3, lambda a: a[3][:1], "tables_BM must be a 2-D tensor"),
    (3, lambda a: a[3].float(), "tables_BM must be int64 or int32"),
    (4, lambda a: a[4][None], "lengths_B must be a 1-D tensor"),
    (4, lambda a: a[4].float(), "lengths_B must be int64 or int32"),
    (4, lambda a: a[4].to("meta"), "lengths_B is on meta but pool_NPW on (cpu|cuda)"),
    (5, lambda a: torch.tensor(0.1), "scale must be a finite Python number"),
    (5, lambda a: float("nan"), "scale must be a finite Python number"),
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
@pytest.mark.parametrize("index,bad,match", BAD_INPUTS, ids=[m.split(" ")[0] + str(i) for i, (_, _, m) in
                                                             enumerate(BAD_INPUTS)])
def test_malformed_inputs_raise(backend, index, bad, match):
    args = [*_good_args(DEV if backend == "triton" else "cpu"), 0.1]   # the kernel runs on CUDA tensors there
    args[index] = bad(args)
    with pytest.raises(ValueError, match=match):
        paged_mla_decode(*args, backend=backend)


@needs_kernels
def test_kernel_refuses_what_it_cannot_run():
    ql, qs, pool, tables, lengths = make_inputs(1, 2, 48, 16, 4, 2, [3], device=DEV)
    with pytest.raises(ValueError, match=r"C \(q_latent_BHC's last dim\) to be a power of two >= 16, got 48"):
        paged_mla_decode(ql, qs, pool, tables, lengths, 0.1, backend="triton")
    with pytest.raises(ValueError, match=r"R \(q_slice_BHR's last dim\) to be a power of two >= 16, got 8"):
        paged_mla_decode(ql[..., :32], qs[..., :8], pool[..., :40], tables, lengths, 0.1, backend="triton")
    args = make_inputs(1, 2, 32, 16, 4, 2, [3], device=DEV)
    with pytest.raises(ValueError, match="block_s must be a power of two >= 16"):
        launch_paged_mla_decode(*args, 0.1, block_s=24)
    with pytest.raises(ValueError, match="num_splits must be an int"):
        launch_paged_mla_decode(*args, 0.1, num_splits=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_no_host_reads_of_tensor_values(backend, monkeypatch):
    """Nothing on either path turns a tensor's value into a Python one (a host sync on CUDA; capturable code has
    none): .item(), .tolist(), int(), float(), bool() and index() on tensors all raise during the call."""
    args = make_inputs(2, 3, 32, 16, 8, 3, [11, 0])
    expected = paged_mla_decode_torch(*args, 0.2)

    def refuse(self, *a, **k):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = paged_mla_decode(*args, 0.2, backend=backend, num_splits=2 if backend == "triton" else None)
    monkeypatch.undo()
    assert rel_rms(expected, out) < TOL[torch.float32]


def test_check_is_shape_only():
    check_paged_mla_inputs(*_good_args(), 0.1)
    check_paged_mla_inputs(*[x.to("meta") for x in _good_args()], 1)  # no values needed


def test_empty_batch():
    args = make_inputs(0, 3, 32, 16, 8, 2, [], device=DEV)
    for backend in ["torch"] + (["triton"] if HAS_KERNELS else []):
        assert paged_mla_decode(*args, 0.1, backend=backend).shape == (0, 3, 32)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("C,R,H", [(512, 64, 96), (256, 32, 16)])
def test_gpu_model_widths(dtype, C, R, H):
    """K3's and the debug preset's widths, long rows of different lengths, every split count the heuristic picks
    for B = 1 and 3 and one forced (the heuristic's cases on this GPU)."""
    P, M = 64, 40
    lengths = [2560, 1, 777, 0][:3]
    args = make_inputs(3, H, C, R, P, M, lengths, dtype)
    scale = (128 + R) ** -0.5
    ref = dense_reference(*args, scale)
    for splits in (None, 1, 7):
        out = paged_mla_decode(*args, scale, num_splits=splits)
        assert rel_rms(ref, out.cpu()) < TOL[dtype], splits
    one = [x[:1] for x in args[:2]] + [args[2]] + [x[:1] for x in args[3:]]
    assert rel_rms(ref[:1], paged_mla_decode(*one, scale).cpu()) < TOL[dtype]


@gpu_only
def test_gpu_cuda_graph_replay_follows_lengths_and_tables():
    """Captured once, replayed after the lengths and tables change in place (as a serving step's graph is): the
    output follows them, with no host sync in the captured call (it would fail the capture)."""
    B, H, C, R, P, M = 4, 20, 256, 32, 16, 16
    ql, qs, pool, _, lengths = make_inputs(B, H, C, R, P, M, [200, 1, 0, 256], torch.bfloat16)
    ids_BM = torch.randperm(pool.shape[0])[: B * M].view(B, M).to(DEV)
    tables = ids_BM.clone()  # every entry valid: the replays move the rows' blocks around
    scale = 0.1
    for splits in (1, 4):
        paged_mla_decode(ql, qs, pool, tables, lengths, scale, num_splits=splits)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = paged_mla_decode(ql, qs, pool, tables, lengths, scale, num_splits=splits)
        for step, new_lengths in enumerate(([200, 1, 0, 256], [17, 0, 100, 3])):
            lengths.copy_(torch.tensor(new_lengths))
            tables.copy_(ids_BM.roll(step, dims=0))
            graph.replay()
            torch.cuda.synchronize()
            ref = dense_reference(ql, qs, pool, tables, lengths, scale)
            assert rel_rms(ref, out.cpu()) < TOL[torch.bfloat16]
            assert math.isfinite(float(out.float().abs().sum()))


def test_the_engine_refuses_widths_the_cuda_kernel_cannot_take_naming_the_field():
    from kimik3.ops.mla.paged_decode import check_paged_mla_widths

    check_paged_mla_widths(16, 64)
    with pytest.raises(ValueError, match="mla.qk_rope_head_dim to be a power of two >= 16, got 8"):
        check_paged_mla_widths(16, 8)
    with pytest.raises(ValueError, match="mla.kv_lora_rank .* got 48"):
        check_paged_mla_widths(48, 16)
