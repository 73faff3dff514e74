"""Tests of the Triton KDA kernels (kimik3/ops/kda/triton_*.py) against the fp32 token loop.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set
below before anything imports the kernels) at tiny shapes; with CUDA they run on the GPU at larger
shapes (H up to 96, D 128, T up to 1000). Skipped cleanly when triton is not installed.

Error measure: rel_rms(ref, out) = rms(ref - out) / rms(ref), computed in float64 -- the same
normalised error as fla's ``assert_close`` ratio (get_err_ratio). Tolerances (fla's): o and
state 5e-3, dq/dk/dv 8e-3, dg/dbeta 2e-2 (initial-state gradient 5e-3).

Backward: by default the Triton backward kernels (triton_backward.py, then triton_preact.py for the
fused pre-activations' chain rule), so every gradient test below checks those kernels against the
token loop; KIMIK3_KDA_TRITON_BWD=torch selects the v1 HYBRID backward (torch chunk path recomputed
under autograd), checked against the Triton one in test_backward_modes_agree.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, P state-pool slots.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_bounds import require_triton_kernels

ON_GPU = torch.cuda.is_available()
triton = require_triton_kernels()  # (the interpreter on CPU: tests/conftest.py, before the kernels are imported)

from tests.numerics import cu_seqlens, kda_inputs, rel_rms
from kimik3.ops.kda import (  # noqa: E402
    _torch_preactivations,
    chunk_kda,
    kda_backend,
    naive_recurrent_kda,
    recurrent_kda_step,
)
from kimik3.ops.kda.triton_decode import kda_decode  # noqa: E402  (the kernel, on CPU under the interpreter)

DEV = "cuda" if ON_GPU else "cpu"
G_MIN = -5.0
TOL = {"o": 5e-3, "state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 5e-3}
GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
# bf16 inputs, output vs the fp32 token loop: bf16 output rounding alone is ~2e-3. The default variant 'h'
# takes every product on 16-bit operands (fla's precision class: with K3's contract at T2048 H32 D128 on the
# H200 its errors are 0.77-1.03x fla 0.6.0's on the same inputs, benchmarks/kda_precision.py); on the
# interpreter's K = V = 16 case below its o error is 1.15e-2 ('ach', tf32 intra-chunk products: 3.4e-3, held
# to 1e-2 by test_bf16_hilo_scan_variant).
BF16_O_TOL = 1.5e-2


@pytest.fixture(autouse=True, scope="module")
def _interpreter_setup():
    import contextlib

    from tests.triton_bounds import bounds_checked

    checked = contextlib.nullcontext()
    if not ON_GPU:
        from kimik3.ops.kda.triton_autograd import interpreter_bf16_fix

        interpreter_bf16_fix()  # the interpreter's bf16 dots and casts are not the GPU's (Triton 3.6)
        checked = bounds_checked()  # every kernel launch in this file: no lane outside its tensors
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    with checked:
        yield
    torch.set_num_threads(saved)


@pytest.mark.skipif(ON_GPU, reason="checks the interpreter's bf16 patch (CPU only)")
def test_interpreter_rounds_to_bf16_as_the_gpu_does():
    """``interpreter_bf16_fix`` (on for every test here): fp32 -> bf16 in a kernel rounds to nearest even, as the
    GPU and torch do (Triton 3.6's interpreter alone truncates: 1 + 3 * 2^-9 became 1), ties and negatives too."""
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(y_ptr + r, tl.load(x_ptr + r).to(tl.bfloat16))

    x = torch.tensor([1 + 3 * 2**-9, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 3 * 2**-9), 1 + 2**-9 + 2**-20, 3.0e38,
                      1e-40, float("inf")], dtype=torch.float32)
    y = torch.empty(8, dtype=torch.bfloat16)
    cast[(1,)](x, y, N=8)
    assert torch.equal(y.view(torch.int16), x.bfloat16().view(torch.int16)), (y, x.bfloat16())


@pytest.mark.skipif(ON_GPU, reason="checks the interpreter's bounds checker (CPU only)")
def test_bounds_checker_catches_a_stray_lane():
    """The checker every interpreted test here runs under: a masked-off lane past the end is allowed
    (the hardware does not touch it), a masked-in one fails the launch, naming the kernel."""
    import triton.language as tl
    from triton.runtime.errors import InterpreterError

    @triton.jit
    def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = (i < n) if MASKED else (i < BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m, other=0.0), mask=m)

    x = torch.arange(10, dtype=torch.float32)
    y = torch.zeros(10)
    copy_kernel[(1,)](x, y, 10, BLOCK=16, MASKED=True)
    assert torch.equal(x, y)
    with pytest.raises(InterpreterError, match=r"load outside every tensor argument in copy_kernel \(6 lanes"):
        copy_kernel[(1,)](x, y, 10, BLOCK=16, MASKED=False)


def make_inputs(B, T, H, K, V, dtype=torch.float32, seed=0, gate_spread=1.5):
    """``tests.numerics.kda_inputs`` on DEV, the gate and beta kept in fp32 (as the K3 layer passes them)."""
    return kda_inputs(B, T, H, K, V, dtype=dtype, seed=seed, gate_spread=gate_spread, device=DEV,
                      gate_dtype=torch.float32)


def make_state(N, H, K, V, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(N, H, K, V, generator=gen)).to(DEV).requires_grad_()


def run_with_grads(fn, inputs, h0, seed=7, **kw):
    o, s = fn(*inputs, initial_state=h0, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(DEV)
    ds = torch.randn(s.shape, generator=gen).to(DEV)
    leaves = list(inputs) + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), leaves)
    return o, s, list(grads)


def fresh(xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def check_against_naive(inputs, h0, cu=None, tol_scale=1.0, grads=True):
    kw = dict(cu_seqlens=cu) if cu is not None else {}
    if grads:
        h0_ref = None if h0 is None else fresh([h0])[0]
        o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, fresh(inputs), h0_ref, **kw)
        o, s, g = run_with_grads(chunk_kda, inputs, h0, backend="triton", **kw)
    else:
        with torch.no_grad():
            o_ref, s_ref = naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True, **kw)
            o, s = chunk_kda(*inputs, initial_state=h0, output_final_state=True, backend="triton", **kw)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and s.dtype == torch.float32
    assert rel_rms(o_ref, o) < TOL["o"] * tol_scale, rel_rms(o_ref, o)
    assert rel_rms(s_ref, s) < TOL["state"] * tol_scale, rel_rms(s_ref, s)
    if grads:
        for name, a, b in zip(GRAD_NAMES, g_ref, g):
            assert rel_rms(a, b) < TOL[name] * tol_scale, (name, rel_rms(a, b))


# --------------------------------------------------------------------------
# chunk forward (+ gradients) vs naive, fp32
# --------------------------------------------------------------------------

SMALL = (2, 2, 16, 16) if not ON_GPU else (2, 4, 64, 64)  # B, H, K, V


@pytest.mark.parametrize("T", [1, 63, 64, 65])
def test_fp32_vs_naive(T):
    B, H, K, V = SMALL
    inputs = make_inputs(B, T, H, K, V, seed=T)
    check_against_naive(inputs, make_state(B, H, K, V))


def test_fp32_no_initial_state_no_final():
    B, H, K, V = SMALL
    q, k, v, g, beta = make_inputs(B, 70, H, K, V, seed=2)
    with torch.no_grad():
        o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
        o, s = chunk_kda(q, k, v, g, beta, scale=0.3, backend="triton")
    assert s is None
    assert rel_rms(o_ref, o) < TOL["o"]


@pytest.mark.parametrize("K,V", [(24, 40), (40, 24), (16, 16), (16, 32)])
def test_odd_head_dims(K, V):
    """Small and odd head sizes (K = 16 gave wrong gradients on the H200 before the backward scans held
    >= 32 state rows)."""
    inputs = make_inputs(1, 65, 2, K, V, seed=K)
    check_against_naive(inputs, make_state(1, 2, K, V))


@pytest.mark.parametrize("lengths", [[1, 1, 3, 64, 65, 2], [1] * 5, [5, 0, 70]], ids=["mixed", "ones", "empty"])
def test_varlen(lengths):
    H, K, V = SMALL[1:]
    T, N = sum(lengths), len(lengths)
    cu = cu_seqlens(lengths, DEV)
    inputs = make_inputs(1, T, H, K, V, seed=N)
    check_against_naive(inputs, make_state(N, H, K, V), cu=cu)


@pytest.mark.parametrize("case", ["T1", "T65", "T130-no-state", "varlen", "bf16"])
def test_split_forward(monkeypatch, case):
    """KIMIK3_KDA_FWD=split (states-only scan storing h, parallel output kernel; the backward reuses h)
    vs naive -- values, final state, all gradients -- and against the fused forward on the same inputs."""
    import kimik3.ops.kda.triton_forward as tf

    H, K, V = SMALL[1:]
    cu, dtype = None, torch.float32
    if case == "varlen":
        lengths = [1, 1, 3, 0, 64, 65, 2]  # an empty segment: its final state is its initial state
        cu = cu_seqlens(lengths, DEV)
        B, T, N = 1, sum(lengths), len(lengths)
    else:
        B, T, N = 2, {"T1": 1, "T65": 65}.get(case, 130), 2
        dtype = torch.bfloat16 if case == "bf16" else torch.float32
    inputs = make_inputs(B, T, H, K, V, dtype=dtype, seed=T)
    h0 = None if case == "T130-no-state" else make_state(N, H, K, V)
    kw = dict(cu_seqlens=cu) if cu is not None else {}
    monkeypatch.setattr(tf, "FWD_MODE", "fused")
    o_f, s_f, g_f = run_with_grads(chunk_kda, fresh(inputs), None if h0 is None else fresh([h0])[0],
                                   backend="triton", **kw)
    monkeypatch.setattr(tf, "FWD_MODE", "split")
    if dtype == torch.float32:
        check_against_naive(inputs, h0, cu=cu)
    o, s, g = run_with_grads(chunk_kda, fresh(inputs), None if h0 is None else fresh([h0])[0], backend="triton", **kw)
    tol = 1e-5 if dtype == torch.float32 else 5e-3  # same math, different summation order
    assert rel_rms(o_f, o) < tol and rel_rms(s_f, s) < tol
    for name, a, b in zip(GRAD_NAMES, g_f, g):
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))
    if case == "T65":  # the scan over 16-column V blocks at 1 stage (SPLIT_CONFIG) and the output kernel over
        # 16-column V blocks at 2 warps (OUTPUT_CONFIG): the same results
        monkeypatch.setattr(tf, "SPLIT_CONFIG", (16, 4, 1))
        monkeypatch.setattr(tf, "OUTPUT_CONFIG", (16, 2))
        o2, s2, g2 = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
        assert rel_rms(o, o2) < 1e-6 and rel_rms(s, s2) < 1e-6
        assert all(rel_rms(a, b) < 1e-6 for a, b in zip(g, g2))
    monkeypatch.setattr(tf, "FWD_MODE", "nonsense")
    with pytest.raises(ValueError, match="KIMIK3_KDA_FWD"):
        chunk_kda(*inputs, backend="triton", **kw)


@pytest.mark.parametrize("mode,case", [("split", c) for c in ["T65", "varlen", "bf16", "solve0", "solve3",
                                                               "bf16-solve0", "K100-both-splits", "varlen-blocks",
                                                               "bf16-blocks", "K100-both-splits-blocks"]]
                         + [("tiles16", c) for c in ["T65", "varlen", "bf16", "K100-both-splits"]]
                         + [("tiles16-3k", c) for c in ["varlen", "K100-both-splits"]])
def test_split_intra(monkeypatch, mode, case):
    """The intra-chunk kernels vs naive and vs the fused one on the same inputs, gradients included:
    KIMIK3_KDA_INTRA=split (the default: phase A per column tile, B per chunk, C per K / V block; also
    with SOLVE 0, forward substitution through the buffer, and 3, the 16 x 16 blocks in registers with
    Neumann diagonal inverses, against the default SOLVE 4) and tiles16 (one program holding [16, 16]
    blocks; "3k": the diagonal blocks, the off-diagonal blocks with the solve, and phase C as three
    kernels), each also together with the split scan at K = 100 (several K blocks in phase C). "blocks": the
    split kernels with phase A over 16-column K blocks (``A_BK``) and phase C over 32-column K and 16-column V
    blocks (``WY_BLOCKS``; at K = 100, four K blocks, the last partial)."""
    import kimik3.ops.kda.triton_forward as tf

    if case.endswith("-blocks"):
        monkeypatch.setattr(tf, "A_BK", 16)
        monkeypatch.setattr(tf, "WY_BLOCKS", (32, 16))
        case = case.removesuffix("-blocks")
    H, K, V = SMALL[1:]
    cu, dtype, B, T, N = None, torch.float32, 2, 65, 2
    if case == "varlen":
        lengths = [1, 1, 3, 64, 65, 2]
        cu = cu_seqlens(lengths, DEV)
        B, T, N = 1, sum(lengths), len(lengths)
    elif case == "bf16":
        dtype, T = torch.bfloat16, 130
    elif case.endswith(("solve0", "solve3")) and case.startswith("bf16"):
        dtype, T = torch.bfloat16, 130
    elif case == "K100-both-splits":
        H, K, V, B, N = 1, 100, 16, 1, 1
        monkeypatch.setattr(tf, "FWD_MODE", "split")
    inputs = make_inputs(B, T, H, K, V, dtype=dtype, seed=T)
    h0 = make_state(N, H, K, V)
    kw = dict(cu_seqlens=cu) if cu is not None else {}
    monkeypatch.setattr(tf, "INTRA_MODE", "fused")
    o_f, s_f, g_f = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
    monkeypatch.setattr(tf, "INTRA_MODE", mode.split("-")[0])
    if case.endswith(("solve0", "solve3")):  # the reference above: the fused kernel with the default solve
        monkeypatch.setattr(tf, "SOLVE", int(case[-1]))
    if mode == "tiles16-3k":
        monkeypatch.setattr(tf, "INTRA16_CONFIG", (32, 2, 1, 1))
    if dtype == torch.float32:
        check_against_naive(inputs, h0, cu=cu)
    o, s, g = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel_rms(o_f, o) < tol and rel_rms(s_f, s) < tol
    for name, a, b in zip(GRAD_NAMES, g_f, g):
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))
    for attr, bad in (("INTRA_MODE", "nonsense"), ("SOLVE", 1)):
        with monkeypatch.context() as m:
            m.setattr(tf, attr, bad)
            with pytest.raises(ValueError, match="KIMIK3_KDA_"):
                chunk_kda(*inputs, backend="triton", **kw)


@pytest.mark.parametrize("mode", ["split", "fused", "tiles16"])
def test_intra_matrices_are_written_in_full(monkeypatch, mode):
    """Aqk and T (the forward's aux, read by the solve, the output and the backward) come out whole: lower
    triangular, zeros above the diagonal written rather than assumed, every chunk of a varlen batch with partial
    chunks covered. Under the interpreter the buffers start as NaN (``triton_forward._scratch``), so an entry a
    kernel leaves unwritten shows here."""
    import kimik3.ops.kda.triton_forward as tf

    monkeypatch.setattr(tf, "INTRA_MODE", mode)
    lengths, H, K, V = [1, 3, 64, 65, 47], 2, 16, 16
    cu = cu_seqlens(lengths, DEV)
    q, k, v, g, beta = make_inputs(1, sum(lengths), H, K, V, seed=5)
    plan = tf.make_plan(1, sum(lengths), cu, q.device)
    aux = tf.kda_fwd_triton(q, k, v, g, beta, K**-0.5, None, False, plan, return_aux=True)[2]
    for name in ("aqk", "tinv"):
        m = aux[name]
        assert m.shape == (plan.NT, H, 64, 64) and not m.isnan().any(), name
        assert torch.equal(m.triu(1), torch.zeros_like(m)), name


@pytest.mark.parametrize("K,blocks", [(100, None), (130, None), (100, (32, 32))])
def test_wy_split_over_k(monkeypatch, K, blocks):
    """KIMIK3_KDA_WY_SPLIT=1: the WY backward as one program per 64-column K block (2 and 3 partial dA /
    dbeta summed by the intra kernel; 4 with 32-column key blocks, also at 32-column V blocks) gives the
    unsplit gradients, and both match naive."""
    import kimik3.ops.kda.triton_backward as tb

    monkeypatch.setattr(tb, "WY_BLOCKS", blocks)

    inputs = make_inputs(1, 70, 1, K, 16, seed=K)
    h0 = make_state(1, 1, K, 16)
    monkeypatch.setattr(tb, "WY_SPLIT_K", False)
    _, _, g_ref = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton")
    monkeypatch.setattr(tb, "WY_SPLIT_K", True)
    check_against_naive(inputs, h0)
    _, _, g = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton")
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < 1e-5, (name, rel_rms(a, b))


@pytest.mark.parametrize("case", ["K100-BK32", "K130-BK64", "varlen-BK32", "bf16-scan32x2", "K100-tiles",
                                  "varlen-tiles", "bf16-tiles", "bf16-nodrv", "K100-nodrv", "bf16-w32",
                                  "bf16-nodhacc", "bf16-wyunroll", "K100-wyunroll",
                                  "bf16-wystages3", "bf16-wystages2", "bf16-wystages1",
                                  "bf16-wyvunroll-wystages3", "bf16-rowstages1"])
def test_backward_launch_sweeps(monkeypatch, case):
    """The backward's alternatives give the default's gradients, and both match naive: the intra kernel
    split over key blocks (4 and 3 blocks, so partial dbeta sums with the WY kernel's partials; varlen with
    tiny segments, 2 blocks), the intra kernel over whole chunks with the suffix sum carried ("tiles";
    the default runs it per row tile with a separate suffix-sum pass), the backward scans at 32-column
    V blocks, two pipeline stages (the default: 64), and the WY kernel computing dRv = T^T dv_new itself with
    dO S^T in tf32 ("nodrv"; the default has a separate dRv pass and takes dO S^T on 16-bit operands), and W stored fp32
    ("w32"; the default stores it in the 16-bit input dtype), and the state-gradient scan at 8 warps with its
    16-bit products summed after the dots ("nodhacc"; the default accumulates them in place), and the WY
    kernel's key-block side unrolled ("wyunroll"; the default keeps its V loop), at 32-column V blocks, and that
    loop pipelined over 1 to 3 stages ("wystagesN"; the default: 3 at 64-column V blocks), with the
    K-independent part's V loop unrolled ("wyvunroll"; the default keeps and pipelines it too), and the "rows"
    kernel launched at one pipeline stage ("rowstages1"; the default: Triton's 3)."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_bwd_intra as tbi
    import kimik3.ops.kda.triton_forward as tf

    B, T, H, K, V, cu, dtype = 1, 70, 1, 16, 16, None, torch.float32
    knobs = {}
    if "BK" in case:
        knobs[(tbi, "BWD_INTRA_BK")] = int(case.split("BK")[1].split("-")[0])
    if "tiles" in case:
        knobs[(tbi, "BWD_INTRA_MODE")] = "tiles"
    if "nodrv" in case:
        knobs[(tb, "DRV_PASS")], knobs[(tb, "WY_DQ16")] = False, False
    if "w32" in case:
        knobs[(tf, "W_16BIT")] = False
    if "nodhacc" in case:
        knobs[(tb, "DH_ACC_DOTS")] = False
    if "wyunroll" in case:  # 32-column V blocks: two steps at V = 64
        knobs[(tb, "WY_DYN_LOOP")], knobs[(tb, "WY_BLOCKS")] = False, (32, 32)
    if "wystages" in case:
        knobs[(tb, "WY_LOOP_STAGES")], knobs[(tb, "WY_BLOCKS")] = int(case[-1]), (32, 32)
    if "wyvunroll" in case:
        knobs[(tb, "WY_V_LOOP")] = False
    if "rowstages" in case:
        knobs[(tbi, "ROWS_STAGES")] = int(case[-1])
    if "scan32" in case:
        knobs[(tb, "SCAN_BV")], knobs[(tb, "SCAN_STAGES")] = 32, 2
    if case.startswith("K"):
        K = int(case[1:4])
    elif case.startswith("varlen"):
        lengths, H, K, V = [1, 1, 3, 64, 65, 2], 2, 64, 32
        cu = cu_seqlens(lengths, DEV)
        T = sum(lengths)
    else:
        dtype, T, H, V = torch.bfloat16, 130, 2, 64
    inputs = make_inputs(B, T, H, K, V, dtype=dtype, seed=K)
    with torch.no_grad():
        inputs[3][:, 20:40] = G_MIN
    h0 = make_state(B if cu is None else len(cu) - 1, H, K, V)
    kw = dict(cu_seqlens=cu) if cu is not None else {}
    _, _, g_ref = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
    for (module, attr), value in knobs.items():
        monkeypatch.setattr(module, attr, value)
    if dtype == torch.float32:
        check_against_naive(inputs, h0, cu=cu)
    _, _, g = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
    tol = 1e-5 if dtype == torch.float32 else 1e-3  # same math, different summation order
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))
    if "tiles" in case:
        monkeypatch.setattr(tbi, "BWD_INTRA_MODE", "nonsense")
        with pytest.raises(ValueError, match="KIMIK3_KDA_BWD_INTRA"):
            run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
    if "wystages" in case:
        monkeypatch.setattr(tb, "WY_LOOP_STAGES", 0)
        with pytest.raises(ValueError, match="KIMIK3_KDA_WY_STAGES"):
            run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)


@pytest.mark.parametrize("scale", [None, 0.3, 0.0])
def test_in_place_state_gradient_scan_keeps_dO_exact(monkeypatch, scale):
    """bf16: the state-gradient scan with its products accumulated in place (``DH_ACC_DOTS``, the default)
    gives the gradients of the form with separate products, at scales that are not powers of two (K = 32:
    1 / sqrt(32); 0.3) and at zero. Rounding dO * scale to 16 bits before its product (the first in-place
    form) moved dh0 by 2e-3 to 3e-3 here; the fixed form stays within about 1e-4 of it (dh0 about 5e-5)."""
    import kimik3.ops.kda.triton_backward as tb

    inputs = make_inputs(1, 130, 2, 32, 32, dtype=torch.bfloat16, seed=4)
    h0 = make_state(1, 2, 32, 32)
    grads = {}
    for acc in (True, False):
        monkeypatch.setattr(tb, "DH_ACC_DOTS", acc)
        _, _, grads[acc] = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", scale=scale)
    for name, a, b in zip(GRAD_NAMES, grads[True], grads[False]):
        assert torch.isfinite(a).all(), name
        assert rel_rms(b, a) < 3e-4, (name, rel_rms(b, a))


def _dh_dtypes_seen(monkeypatch) -> list:
    """Record the dtype of dh as each launch of the WY kernel receives it (the kernel then launched as usual): what
    ``DH_16BIT`` must change, so that a test of it fails if the knob silently does nothing."""
    import kimik3.ops.kda.triton_backward as tb

    kernel, seen = tb._bwd_wy_kernel, []
    at = kernel.arg_names.index("dh_ptr")

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(args[at].dtype)
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tb, "_bwd_wy_kernel", Recorded())
    return seen


@pytest.mark.parametrize("case", ["dh16-bf16", "dh16-varlen", "dh16-nodhacc", "dh16-fp32", "dh16-fp32scan"])
def test_dh16_state_gradients_stored_16bit(monkeypatch, case):
    """``DH_16BIT`` (KIMIK3_KDA_DH16, off by default): with bf16 inputs and 16-bit scans the state gradients dh reach
    the WY kernel in bf16; every gradient stays within the bf16 tests' bounds of the fp32 token loop, dk and dg (the
    two that read dh) move from the fp32-dh run by under 1e-2 (relative RMS) but do move, and the rest (dq, dv, dbeta,
    dh0: the scan's fp32 chain, not its stored copy) do not. Over a partial last chunk (T = 130), varlen sequences
    (one-token ones, partial chunks) and the scan with its products summed after the dots (``DH_ACC_DOTS`` off).
    fp32 inputs, and bf16 inputs with fp32 scans (variant 's'), keep an fp32 dh and the same gradients bit for bit."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_forward as tf

    B, H, K, V = SMALL
    T, cu, dtype = 130, None, torch.float32 if case == "dh16-fp32" else torch.bfloat16
    if case == "dh16-varlen":
        lengths = [1, 63, 65, 3, 64]
        cu = cu_seqlens(lengths, DEV)
        B, T = 1, sum(lengths)
    if case == "dh16-nodhacc":
        monkeypatch.setattr(tb, "DH_ACC_DOTS", False)
    if case == "dh16-fp32scan":
        monkeypatch.setattr(tf, "DEFAULT_VARIANT", "s")
    inputs = make_inputs(B, T, H, K, V, dtype=dtype, seed=11)
    h0 = make_state(B if cu is None else len(cu) - 1, H, K, V)
    kw = dict(cu_seqlens=cu) if cu is not None else {}
    seen = _dh_dtypes_seen(monkeypatch)
    grads, dh_dtypes = {}, {}
    for on in (False, True):
        monkeypatch.setattr(tb, "DH_16BIT", on)
        seen.clear()
        _, _, grads[on] = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton", **kw)
        dh_dtypes[on] = set(seen)
    stored16 = dtype == torch.bfloat16 and case != "dh16-fp32scan"
    assert dh_dtypes == {False: {torch.float32}, True: {torch.bfloat16 if stored16 else torch.float32}}, dh_dtypes
    moved = {name: rel_rms(a, b) for name, a, b in zip(GRAD_NAMES, grads[False], grads[True])}
    if not stored16:
        assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])), moved
        return
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    _, _, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, fresh([h0])[0], **kw)
    for name, a, b in zip(GRAD_NAMES, g_ref, grads[True]):
        assert rel_rms(a, b) < TOL[name], (name, rel_rms(a, b))
    same = 0.0 if not ON_GPU else 1e-6  # (the interpreter: the same operations bit for bit)
    assert all(moved[name] <= same for name in ("dq", "dv", "dbeta", "dh0")), moved
    assert all(0 < moved[name] < 1e-2 for name in ("dk", "dg")), moved


@pytest.mark.parametrize("acc", [True, False])
def test_dh16_scan_rounds_only_the_stored_copy(acc):
    """The Triton state-gradient scan with a bf16 dh (``DH_16BIT``): each stored dS' is the fp32 run's rounded once to
    bf16 (exactly on the interpreter, within one bf16 step on the GPU), and the chain it carries stays fp32: dv_new
    and dh0 equal the fp32 run's. Varlen with one-token sequences and partial chunks, the final state's gradient in,
    the in-place form (acc, the scale not a power of two) and the form with separate products."""
    import math

    import triton.language as tl

    from kimik3.ops.kda.triton_backward import _bwd_dh_kernel
    from kimik3.ops.kda.triton_forward import make_plan

    gen = torch.Generator().manual_seed(3)
    H, K, V, lengths = 2, 32, 32, [1, 63, 65, 7, 64]
    N, T = len(lengths), sum(lengths)
    cu = cu_seqlens(lengths, DEV)
    plan = make_plan(1, T, cu, torch.device(DEV))
    qg, kg, w = ((torch.randn(1, T, H, K, generator=gen) * 0.2).bfloat16().to(DEV) for _ in range(3))
    do = torch.randn(1, T, H, V, generator=gen).bfloat16().to(DEV)
    eg = (torch.rand(plan.NT, H, K, generator=gen) * 0.5 + 0.5).to(DEV)
    dht = torch.randn(N, H, K, V, generator=gen).to(DEV)
    dv_local = torch.randn(1, T, H, V, generator=gen).to(DEV)  # what _dvn_local_kernel leaves, at random
    scale = K**-0.5
    dscale = 2.0 ** (math.frexp(scale)[1] - 1) if acc else 1.0
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        dh = torch.full((plan.NT, H, K, V), float("nan"), device=DEV, dtype=dt)
        dvn, dh0 = dv_local.clone(), torch.full((N, H, K, V), float("nan"), device=DEV)
        _bwd_dh_kernel[(1, N * H)](qg, kg, eg, w, do, dht, dh, dvn, dh0, plan.cu, plan.chunk_off, H, float(scale),
                                   dscale, K=K, V=V, BKF=K, BV=V, PREC="tf32", HAS_DHT=True, STORE_DH0=True,
                                   INTERP=not ON_GPU, DT=tl.bfloat16, ACC=acc, num_warps=4)
        out[dt] = dh, dvn, dh0
    (dh32, dvn32, dh0_32), (dh16, dvn16, dh0_16) = out[torch.float32], out[torch.bfloat16]
    assert not dh32.isnan().any() and not dh16.float().isnan().any()
    if ON_GPU:
        step = dh32.abs() * 2.0**-7  # one bf16 step (8 significant bits) at the value's size
        assert ((dh16.float() - dh32).abs() <= step).all()
    else:
        assert torch.equal(dh16, dh32.bfloat16())
    assert torch.equal(dvn16, dvn32) and torch.equal(dh0_16, dh0_32)
    assert rel_rms(dh32, dh16.float()) > 0  # (the rounding happened)


@pytest.mark.parametrize("pattern", ["all", "tile", "alternate"])
def test_gates_at_the_bound(pattern):
    B, H, K, V = SMALL
    T = 80
    q, k, v, g, beta = make_inputs(B, T, H, K, V, seed=5)
    with torch.no_grad():
        if pattern == "all":
            g.fill_(G_MIN)
        elif pattern == "tile":  # one whole 16-token sub-tile (and more) saturated: in-tile decay e^-80
            g[:, 16:40] = G_MIN
        else:
            g[:, ::2] = G_MIN
            g[:, 1::2] = -1e-4
    check_against_naive([q, k, v, g, beta], make_state(B, H, K, V))


def test_bf16_inputs():
    B, H, K, V = SMALL
    inputs = make_inputs(B, 130, H, K, V, dtype=torch.bfloat16, seed=11)
    h0 = make_state(B, H, K, V)
    ref_inputs = [x.detach().float() for x in inputs]
    with torch.no_grad():
        o_ref, s_ref = naive_recurrent_kda(*ref_inputs, initial_state=h0, output_final_state=True)
        o, s = chunk_kda(*inputs, initial_state=h0, output_final_state=True, backend="triton")
    assert o.dtype == torch.bfloat16
    assert rel_rms(o_ref, o) < BF16_O_TOL, rel_rms(o_ref, o)
    assert rel_rms(s_ref, s) < 5e-3, rel_rms(s_ref, s)


@pytest.mark.parametrize("use_gate,K", [(True, 100), (False, 16)])
def test_prologue_gamma_is_the_chunk_cumsum_of_the_gate(use_gate, K):
    """The forward prologue's Gamma and sigmoid(beta) (``_gate_cols_kernel``) against torch: each chunk's inclusive
    cumulative sum of the gate g_min sigmoid(exp(A_log) (z + dt_bias)) (or of g itself without the fused gate),
    restarting at every sequence and every 64 tokens; varlen with one-token sequences and partial chunks, K = 100 (a
    partial key block). fp32 throughout: within 1e-5."""
    import kimik3.ops.kda.triton_prologue as tp
    from kimik3.ops.kda.triton_forward import make_plan

    gen = torch.Generator().manual_seed(4)
    lengths, H = [1, 63, 130, 2], 2
    T = sum(lengths)
    z = torch.randn(1, T, H, K, generator=gen)
    if not use_gate:
        z = -torch.rand(1, T, H, K, generator=gen) * 5
    beta = torch.randn(1, T, H, generator=gen)
    alog, dtb = torch.rand(H, generator=gen), 0.5 * torch.randn(H * K, generator=gen)
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    cu = cu_seqlens(lengths, DEV)
    plan = make_plan(1, T, cu, torch.device(DEV))
    G, betan, qn, kn = (torch.full_like(x, float("nan"), device=DEV) for x in (z, beta, q, k))
    BKF = 128
    tp.launch_prologue(z.to(DEV), G, q.to(DEV), k.to(DEV), qn, kn, beta.to(DEV), betan, alog.to(DEV), dtb.to(DEV),
                       plan, H, K, BKF, 64, G_MIN, use_gate, True, True)
    g = G_MIN * torch.sigmoid(alog.exp()[:, None] * (z + dtb.view(H, K))) if use_gate else z
    want = torch.empty_like(g)
    for b, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for t0 in range(b, e, 64):
            want[:, t0:min(t0 + 64, e)] = g[:, t0:min(t0 + 64, e)].cumsum(1)
    assert not G.isnan().any()
    assert (G.cpu() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.allclose(betan.cpu(), torch.sigmoid(beta), atol=1e-6)


@pytest.mark.parametrize("prep_parts", [1, 3, "l2rows", "l2rows-K100", "fused-intra"])
def test_fused_preactivations(monkeypatch, prep_parts):
    """Gate, q/k L2 norm and beta sigmoid fused: values and gradients (raw z, A_log, dt_bias too), with the
    prologue as one program per (chunk, head), as three (``triton_prologue.PREP_PARTS``), and as the gate alone
    per column block with the norms over contiguous rows in 32-row programs (``L2_ROWS``; 140 rows, so the last
    program is partial; K = 100: two column blocks, the second partial; the default), and that prologue before
    the fused intra kernel."""
    import kimik3.ops.kda.triton_forward as tf
    import kimik3.ops.kda.triton_prologue as tp

    B, T, H, K, V = 1, 70, 2, SMALL[2], SMALL[3]
    if str(prep_parts).startswith("l2rows"):
        monkeypatch.setattr(tp, "L2_ROWS", True)
        monkeypatch.setattr(tp, "L2_ROWS_CONFIG", (32, 2))
        if "K100" in prep_parts:
            K, V = 100, 16
    elif prep_parts == "fused-intra":
        monkeypatch.setattr(tf, "INTRA_MODE", "fused")
    else:
        monkeypatch.setattr(tp, "L2_ROWS", False)
        monkeypatch.setattr(tp, "PREP_PARTS", prep_parts)
    gen = torch.Generator().manual_seed(3)
    raw = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
           torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, K, generator=gen),
           torch.randn(B, T, H, generator=gen), torch.rand(H, generator=gen) * 2,
           0.5 * torch.randn(H, K, generator=gen), 0.5 * torch.randn(B, H, K, V, generator=gen)]
    flags = (True, True, True)

    def run(fn_kind, xs):
        q, k, v, z, b, a_log, dtb, h0 = xs
        if fn_kind == "naive":
            qq, kk, gg, bb = _torch_preactivations(q, k, z, b, a_log, dtb, G_MIN, *flags)
            return naive_recurrent_kda(qq, kk, v, gg, bb, initial_state=h0, output_final_state=True)
        return chunk_kda(q, k, v, z, b, initial_state=h0, output_final_state=True, backend="triton",
                         A_log=a_log, dt_bias=dtb, lower_bound=G_MIN, use_gate_in_kernel=True,
                         use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)

    outs = {}
    for kind in ("naive", "triton"):
        xs = [x.to(DEV).requires_grad_() for x in raw]
        o, s = run(kind, xs)
        gen2 = torch.Generator().manual_seed(9)
        do, ds = torch.randn(o.shape, generator=gen2).to(DEV), torch.randn(s.shape, generator=gen2).to(DEV)
        outs[kind] = (o, s, torch.autograd.grad((o * do).sum() + (s * ds).sum(), xs))
    (o_r, s_r, g_r), (o, s, g) = outs["naive"], outs["triton"]
    assert rel_rms(o_r, o) < TOL["o"] and rel_rms(s_r, s) < TOL["state"]
    names = ["dq", "dk", "dv", "dz", "dbeta", "dA_log", "ddt_bias", "dh0"]
    tols = [8e-3, 8e-3, 8e-3, 2e-2, 2e-2, 2e-2, 2e-2, 5e-3]
    for name, tol, a, b in zip(names, tols, g_r, g):
        assert rel_rms(a, b) < tol, (name, rel_rms(a, b))
    monkeypatch.setattr(tp, "PREP_PARTS", 2)  # refused whichever prologue runs
    with pytest.raises(ValueError, match="KIMIK3_KDA_PREP_PARTS"):
        run("triton", [x.to(DEV) for x in raw])


# --------------------------------------------------------------------------
# Triton backward specifics
# --------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, True, False),
                                   (False, False, True), (False, True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_preact_backward_kernel(flags, dtype):
    """triton_preact.preact_bwd_triton vs torch autograd through _torch_preactivations, 37 tokens (not a
    multiple of the kernel's 32 rows), K = 40 (padded to 64): each fused stage alone and together."""
    from kimik3.ops.kda.triton_preact import preact_bwd_triton

    use_gate, use_l2, use_bsig = flags
    B, T, H, K = 1, 37, 3, 40
    gen = torch.Generator().manual_seed(5)
    q, k, z = (torch.randn(B, T, H, K, generator=gen).to(DEV, dtype) for _ in range(3))
    b = torch.randn(B, T, H, generator=gen).to(DEV, dtype)
    a_log = (torch.rand(H, generator=gen) * 2).to(DEV)
    dtb = (0.5 * torch.randn(H, K, generator=gen)).to(DEV)
    dq, dk, dg = (torch.randn(B, T, H, K, generator=gen).to(DEV) for _ in range(3))
    db = torch.randn(B, T, H, generator=gen).to(DEV)
    leaves = [x.detach().float().requires_grad_() for x in (q, k, z, b, a_log, dtb)]
    outs = _torch_preactivations(*leaves[:4], leaves[4], leaves[5], G_MIN, use_gate, use_l2, use_bsig)
    ref = torch.autograd.grad(outs, leaves, (dq, dk, dg, db), allow_unused=True)
    got = preact_bwd_triton(q, k, z, b, dq, dk, dg, db, a_log, dtb, G_MIN, use_gate, use_l2, use_bsig)
    assert [x.dtype for x in got[:4]] == [dtype] * 4
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the outputs are rounded to bf16
    for name, r, x in zip(["dq", "dk", "dz", "dbeta", "dA_log", "ddt_bias"], ref, got):
        if name in ("dA_log", "ddt_bias") and not use_gate:
            assert x is None and r is None, name
            continue
        assert rel_rms(r, x) < tol, (name, rel_rms(r, x))


@pytest.mark.parametrize("case", ["all", "all-K100", "all-varlen", "all-bf16", "gate", "l2", "bsig", "l2-bsig",
                                  "all-K130-unfused", "all-tiles-unfused", "all-K100-sfx32", "all-varlen-sfx32",
                                  "all-varlen-step1", "l2-bsig-step1"])
def test_fused_preact_backward(monkeypatch, case):
    """The pre-activations' chain rules inside the intra backward (``FUSE_PREACT_BWD``: the L2 norm and the
    sigmoid where dq, dk, dbeta are completed, the gate in the suffix-sum pass) give the separate pass's
    gradients, and the naive loop's: each stage alone and together, K = 100 (one 128-column key block, the
    last 28 masked; "sfx32": the suffix-sum pass in 32-column blocks of one warp, the last partial), varlen with tiny
    segments, bf16. Where it cannot fuse (K = 130 needs two key blocks; the "tiles" form) the separate pass runs
    instead; the test counts which ran. The suffix-sum pass runs in both: with the gate's chain rule (fused) and
    writing dg in place (separate), at K = 130 in two key blocks, the second of 2 columns, and one row a step as on
    the GPU ("step1"; the interpreter's default is 16)."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_bwd_intra as tbi

    B, T, H, K, V, cu, dtype = 1, 70, 2, 16, 16, None, torch.float32
    flags = tuple(name in case or "all" in case for name in ("gate", "l2", "bsig"))
    if "K1" in case:
        K = int(case.split("K")[1][:3])
    if "varlen" in case:
        lengths = [1, 2, 17, 50]
        cu = cu_seqlens(lengths, DEV)
        T = sum(lengths)
    if "bf16" in case:
        dtype, V = torch.bfloat16, 32
    if "tiles" in case:
        monkeypatch.setattr(tbi, "BWD_INTRA_MODE", "tiles")
    if "sfx32" in case:
        monkeypatch.setattr(tbi, "SUFFIX_BK", 32)
    if "step1" in case:  # the suffix-sum pass one row a step, as on the GPU (the interpreter's default: 16)
        monkeypatch.setattr(tbi, "SUFFIX_STEP", 1)
    gen = torch.Generator().manual_seed(11)
    raw = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
           torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, K, generator=gen) - (0 if flags[0] else 2),
           torch.randn(B, T, H, generator=gen) + (0 if flags[2] else 3), torch.rand(H, generator=gen) * 2,
           0.5 * torch.randn(H, K, generator=gen), 0.5 * torch.randn(B if cu is None else len(cu) - 1, H, K, V,
                                                                        generator=gen)]
    if not flags[2]:  # beta itself: keep it in (0, 1)
        raw[4] = torch.sigmoid(raw[4])
    if not flags[0]:  # the log-decay itself: within the bound
        raw[3] = raw[3].clamp(G_MIN, -0.01)
    raw = [x.to(dtype) if i < 5 else x for i, x in enumerate(raw)]
    kw = dict(cu_seqlens=cu) if cu is not None else {}
    separate = []
    orig = tb.preact_bwd_triton
    monkeypatch.setattr(tb, "preact_bwd_triton", lambda *a, **k: separate.append(1) or orig(*a, **k))

    def grads(kind):
        xs = [x.to(DEV).requires_grad_() for x in raw]
        q, k, v, z, b, a_log, dtb, h0 = xs
        if kind == "naive":
            qq, kk, gg, bb = _torch_preactivations(*(x.float() for x in (q, k, z, b)), a_log, dtb, G_MIN, *flags)
            o, s = naive_recurrent_kda(qq, kk, v.float(), gg, bb, initial_state=h0, output_final_state=True,
                                       **kw)
        else:
            o, s = chunk_kda(q, k, v, z, b, initial_state=h0, output_final_state=True, backend="triton",
                             A_log=a_log, dt_bias=dtb, lower_bound=G_MIN, use_gate_in_kernel=flags[0],
                             use_qk_l2norm_in_kernel=flags[1], use_beta_sigmoid_in_kernel=flags[2], **kw)
        gen2 = torch.Generator().manual_seed(9)
        do, ds = torch.randn(o.shape, generator=gen2).to(DEV), torch.randn(s.shape, generator=gen2).to(DEV)
        want = [x for i, x in enumerate(xs) if not (i in (5, 6) and not flags[0])]
        return torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), want)

    ref = grads("naive")
    monkeypatch.setattr(tbi, "FUSE_PREACT_BWD", False)
    sep = grads("triton")
    assert len(separate) == 1
    monkeypatch.setattr(tbi, "FUSE_PREACT_BWD", True)
    fused = grads("triton")
    assert len(separate) == (2 if "unfused" in case else 1), case
    names = ["dq", "dk", "dv", "dz", "dbeta", "dA_log", "ddt_bias", "dh0"] if flags[0] else \
        ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    tols = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 5e-3}
    same = 1e-5 if dtype == torch.float32 else 2e-3  # bf16: the same fp32 values, a rare rounding flip apart
    for name, r, a, b in zip(names, ref, sep, fused):
        assert a.dtype == b.dtype, name
        assert rel_rms(a.float(), b.float()) < same, (name, rel_rms(a.float(), b.float()))
        assert rel_rms(r.float(), b.float()) < (3 if dtype == torch.bfloat16 else 1) * tols.get(name, 2e-2), \
            (name, rel_rms(r.float(), b.float()))


@pytest.mark.parametrize("states_16bit", [True, False])
def test_bf16_grads(monkeypatch, states_16bit):
    """bf16 inputs: output and all gradients vs the fp32 token loop on the same (bf16-valued) inputs,
    with the backward's recomputed chunk states stored 16-bit (the default) and fp32."""
    import kimik3.ops.kda.triton_scan as ts

    monkeypatch.setattr(ts, "STATES_16BIT", states_16bit)
    B, H, K, V = SMALL
    inputs = make_inputs(B, 130, H, K, V, dtype=torch.bfloat16, seed=11)
    h0 = make_state(B, H, K, V)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, fresh([h0])[0])
    o, s, g = run_with_grads(chunk_kda, inputs, h0, backend="triton")
    assert [x.dtype for x in g] == [x.dtype for x in inputs] + [torch.float32]
    assert rel_rms(o_ref, o) < BF16_O_TOL and rel_rms(s_ref, s) < TOL["state"]
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < TOL[name], (name, rel_rms(a, b))


def test_bf16_hilo_scan_variant(monkeypatch):
    """Variant 'ach': the forward and backward scans take 16-bit operands, with v_new, Aqk and the state
    gradient split into a 16-bit high part and remainder. Output (to 1e-2, tighter than the default 'h''s
    BF16_O_TOL: tf32 intra-chunk products), state and every gradient vs the fp32 token loop, and the split
    buys accuracy: the final state is nearer the token loop than with the plain 16-bit scan ('ac')."""
    import kimik3.ops.kda.triton_forward as tf

    B, H, K, V = SMALL
    inputs = make_inputs(B, 130, H, K, V, dtype=torch.bfloat16, seed=11)
    h0 = make_state(B, H, K, V)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, fresh([h0])[0])
    state_err = {}
    for variant in ("ac", "ach"):
        monkeypatch.setattr(tf, "DEFAULT_VARIANT", variant)
        o, s, g = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], backend="triton")
        state_err[variant] = rel_rms(s_ref, s)
    assert rel_rms(o_ref, o) < 1e-2 and state_err["ach"] < 2e-3, (rel_rms(o_ref, o), state_err)
    assert state_err["ach"] < 0.5 * state_err["ac"], state_err
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < TOL[name], (name, rel_rms(a, b))
    monkeypatch.setattr(tf, "DEFAULT_VARIANT", "acx")
    with pytest.raises(ValueError, match="letters of 'acswh', got 'acx'"):
        chunk_kda(*inputs, backend="triton")


def test_grads_without_states_partial_needs():
    """No initial state, no final state (dht None), and only some inputs needing gradients."""
    B, H, K, V = SMALL
    q, k, v, g, beta = make_inputs(B, 70, H, K, V, seed=12)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(B, 70, H, V, generator=gen).to(DEV)
    leaves = fresh([q, k, v, g, beta])
    o_ref, _ = naive_recurrent_kda(*leaves, scale=0.3)
    g_ref = torch.autograd.grad((o_ref * do).sum(), [leaves[1], leaves[3]])
    k2, g2 = k.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    o, s = chunk_kda(q.detach(), k2, v.detach(), g2, beta.detach(), scale=0.3, backend="triton")
    assert s is None
    got = torch.autograd.grad((o * do).sum(), [k2, g2])
    assert rel_rms(g_ref[0], got[0]) < TOL["dk"] and rel_rms(g_ref[1], got[1]) < TOL["dg"]


def test_backward_modes_agree(monkeypatch):
    """KIMIK3_KDA_TRITON_BWD: 'triton' (default) runs the Triton kernels, 'torch' the hybrid; same gradients."""
    from kimik3.ops.kda import triton_backward

    calls = []
    orig = triton_backward.kda_bwd_triton
    monkeypatch.setattr(triton_backward, "kda_bwd_triton", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    H, K, V = SMALL[1:]
    lengths = [3, 0, 66, 1]
    cu = cu_seqlens(lengths, DEV)
    inputs = make_inputs(1, sum(lengths), H, K, V, seed=13)
    with torch.no_grad():
        inputs[3][:, 60:] = G_MIN
    h0 = make_state(len(lengths), H, K, V)
    res = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("KIMIK3_KDA_TRITON_BWD", mode)
        n0 = len(calls)
        res[mode] = run_with_grads(chunk_kda, fresh(inputs), fresh([h0])[0], cu_seqlens=cu, backend="triton")[2]
        assert (len(calls) > n0) == (mode == "triton")
    for name, a, b in zip(GRAD_NAMES, res["torch"], res["triton"]):
        assert rel_rms(a, b) < 1e-5, (name, rel_rms(a, b))


# --------------------------------------------------------------------------
# decode kernel vs recurrent_kda_step
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("K,V", [(16, 16), (24, 40)])
def test_decode_vs_step(fused, K, V):
    B, H, P = 3, 2, 5
    gen = torch.Generator().manual_seed(K + V)
    q, k = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen)
    v, z, b = torch.randn(B, H, V, generator=gen), torch.randn(B, H, K, generator=gen), torch.randn(B, H, generator=gen)
    a_log, dtb = torch.rand(H, generator=gen), torch.randn(H, K, generator=gen)
    pool = torch.randn(P, H, K, V, generator=gen)
    q, k, v, z, b, a_log, dtb, pool = (x.to(DEV) for x in (q, k, v, z, b, a_log, dtb, pool))
    slots = torch.tensor([3, -1, 0], device=DEV)
    if fused:
        qq, kk, gg, bb = _torch_preactivations(q, k, z, b, a_log, dtb, G_MIN, True, True, True)
    else:
        qq, kk = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        gg, bb = G_MIN * torch.sigmoid(z), torch.sigmoid(b)
    ref_pool = pool.clone()
    if fused:
        o = kda_decode(q, k, v, z, b, pool, slots, A_log=a_log, dt_bias=dtb, g_min=G_MIN, use_gate_in_kernel=True,
                       use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    else:
        o = kda_decode(qq, kk, v, gg, bb, pool, slots)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(o[i], torch.zeros_like(o[i]))
            continue
        o_ref, s_ref = recurrent_kda_step(qq[i:i + 1], kk[i:i + 1], v[i:i + 1], gg[i:i + 1], bb[i:i + 1],
                                          ref_pool[s:s + 1])
        assert rel_rms(o_ref[0], o[i]) < 1e-5
        ref_pool[s] = s_ref[0]
    assert rel_rms(ref_pool, pool) < 1e-6  # untouched slots bit-equal, updated ones to rounding


def test_decode_matches_chunk_continuation():
    """Prefill T tokens with chunk_kda, then decode 3 tokens: equals one naive pass over T + 3."""
    B, H, K, V = 2, 2, 16, 16
    q, k, v, g, beta = (x.detach() for x in make_inputs(B, 67, H, K, V, seed=21))
    with torch.no_grad():
        o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
        _, state = chunk_kda(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], output_final_state=True,
                             backend="triton")
    pool = torch.zeros(4, H, K, V, device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    pool[slots] = state
    for t in range(64, 67):
        o = kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots)
        assert rel_rms(o_ref[:, t], o) < 5e-5
    assert rel_rms(s_ref, pool[slots]) < 5e-5


def test_decode_dispatch_picks_the_kernel_or_the_torch_path():
    """kimik3.ops.kda.kda_decode with backend="triton" is the kernel (bit-equal); with "torch" the torch path,
    equal to rounding; both update the same pool rows."""
    from kimik3.ops.kda import kda_decode as dispatch

    B, H, K, V = 2, 2, 16, 16
    gen = torch.Generator().manual_seed(5)
    q, k, z = (torch.randn(B, H, K, generator=gen).to(DEV) for _ in range(3))
    v, b = torch.randn(B, H, V, generator=gen).to(DEV), torch.randn(B, H, generator=gen).to(DEV)
    a_log, dtb = torch.rand(H, generator=gen).to(DEV), torch.randn(H, K, generator=gen).to(DEV)
    pool = torch.randn(3, H, K, V, generator=gen).to(DEV)
    slots = torch.tensor([2, 0], device=DEV)
    kw = dict(A_log=a_log, dt_bias=dtb, g_min=G_MIN, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True)
    pools = [pool.clone() for _ in range(3)]
    o_kernel = kda_decode(q, k, v, z, b, pools[0], slots, **kw)
    o_triton = dispatch(q, k, v, z, b, pools[1], slots, backend="triton", **kw)
    o_torch = dispatch(q, k, v, z, b, pools[2], slots, backend="torch", **kw)
    assert torch.equal(o_kernel, o_triton) and torch.equal(pools[0], pools[1])
    assert rel_rms(o_torch, o_kernel) < 1e-5 and rel_rms(pools[2], pools[0]) < 1e-6


def test_decode_rejects_bad_inputs():
    """Each malformed argument is named in the error, before anything is launched or written."""
    B, H, K, V = 2, 2, 16, 16
    q, k, g = (torch.randn(B, H, K, device=DEV) for _ in range(3))
    v, beta = torch.randn(B, H, V, device=DEV), torch.rand(B, H, device=DEV)
    pool, slots = torch.zeros(3, H, K, V, device=DEV), torch.tensor([0, 2], device=DEV)
    cases = [
        (dict(q=q[0]), "q must be"),
        (dict(v=v[:1]), "v must have shape"),
        (dict(state_pool=pool.double()), "state_pool must be float32"),
        (dict(state_pool=pool.transpose(2, 3)), "contiguous"),
        (dict(slots=slots.float()), "slots must be an integer"),
        (dict(use_gate_in_kernel=True), "use_gate_in_kernel needs"),
    ]
    for bad, message in cases:
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=pool, slots=slots) | bad
        with pytest.raises(ValueError, match=message):
            kda_decode(**kw)
    assert torch.count_nonzero(pool) == 0


# --------------------------------------------------------------------------
# dispatch
# --------------------------------------------------------------------------


def test_dispatch(monkeypatch):
    x = torch.zeros(1, 1, 1, 16)
    monkeypatch.delenv("KIMIK3_KDA_BACKEND", raising=False)
    assert kda_backend(x) == "torch"  # CPU tensors: torch path
    assert kda_backend(x, backend="triton") == "triton"
    monkeypatch.setenv("KIMIK3_KDA_BACKEND", "torch")
    assert kda_backend(x.to(DEV), backend=None) == "torch"
    with pytest.raises(ValueError):
        kda_backend(x, backend="cuda")
    with pytest.raises(ValueError):
        kda_backend(x, chunk_size=32, backend="triton")
    if ON_GPU:
        monkeypatch.delenv("KIMIK3_KDA_BACKEND")
        assert kda_backend(x.cuda()) == "triton"
        assert kda_backend(x.cuda().requires_grad_()) == "triton"  # training too
        assert kda_backend(x.cuda(), chunk_size=32) == "torch"


# --------------------------------------------------------------------------
# GPU-only: K3 shapes
# --------------------------------------------------------------------------


@pytest.mark.skipif(not ON_GPU, reason="K3 shapes need the GPU")
@pytest.mark.parametrize("T", [63, 1000])
def test_gpu_k3_shape(T):
    inputs = make_inputs(1, T, 96, 128, 128, seed=T)
    check_against_naive(inputs, make_state(1, 96, 128, 128))  # gradients through the Triton backward


@pytest.mark.skipif(not ON_GPU, reason="GPU only")
def test_gpu_bf16_k3_shape():
    inputs = make_inputs(2, 300, 16, 128, 128, dtype=torch.bfloat16, seed=4)
    h0 = make_state(2, 16, 128, 128)
    with torch.no_grad():
        o_ref, s_ref = naive_recurrent_kda(*[x.float() for x in inputs], initial_state=h0, output_final_state=True)
        o, s = chunk_kda(*inputs, initial_state=h0, output_final_state=True)
    assert rel_rms(o_ref, o) < 1e-2 and rel_rms(s_ref, s) < 5e-3


# the interpreter's numpy warns at dA_log's 0 * inf for an infinite z (NaN there, as in the torch path)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_fused_gate_takes_any_raw_input_and_raw_log_decay_is_checked():
    """With the gate fused the log-decay is bounded for any raw z: +inf / -inf z saturate the sigmoid (output,
    state and dz finite and as the torch path's), so the Triton path does not scan z for them (no host sync);
    NaN z shows as NaN output. A raw log-decay g with +inf or NaN is refused by name."""
    B, T, H, K, V = 1, 40, 2, SMALL[2], SMALL[3]
    gen = torch.Generator().manual_seed(17)
    q, k, z = (torch.randn(B, T, H, K, generator=gen).to(DEV) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen).to(DEV)
    b = torch.randn(B, T, H, generator=gen).to(DEV)
    a_log, dtb = (torch.rand(H, generator=gen) * 2).to(DEV), (0.5 * torch.randn(H, K, generator=gen)).to(DEV)
    z[0, 5, 1, 3], z[0, 20, 0, 0] = float("inf"), float("-inf")
    kw = dict(A_log=a_log, dt_bias=dtb, lower_bound=G_MIN, use_gate_in_kernel=True,
              use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, output_final_state=True)
    do = torch.randn(B, T, H, V, generator=gen).to(DEV)
    res = {}
    for backend in ("torch", "triton"):
        z_leaf = z.clone().requires_grad_()
        o, s = chunk_kda(q, k, v, z_leaf, b, backend=backend, **kw)
        res[backend] = (o, s, torch.autograd.grad((o * do).sum() + s.sum(), z_leaf)[0])
    (o_ref, s_ref, dz_ref), (o, s, dz) = res["torch"], res["triton"]
    assert torch.isfinite(o).all() and torch.isfinite(s).all() and torch.isfinite(dz).all()
    assert rel_rms(o_ref, o) < TOL["o"] and rel_rms(s_ref, s) < TOL["state"] and rel_rms(dz_ref, dz) < TOL["dg"]
    assert dz[0, 5, 1, 3] == 0 and dz[0, 20, 0, 0] == 0  # a saturated sigmoid passes no gradient
    z_nan = z.clone()
    z_nan[0, 30, 1, 2] = float("nan")
    with torch.no_grad():
        o, _ = chunk_kda(q, k, v, z_nan, b, backend="triton", **kw)
    assert torch.isnan(o).any()
    g = -torch.rand(B, T, H, K, generator=gen).to(DEV)
    for bad in (float("inf"), float("nan")):
        g_bad = g.clone()
        g_bad[0, 7, 0, 1] = bad
        with pytest.raises(ValueError, match=r"g \(log-decay\) contains NaN or \+inf"):
            chunk_kda(q, k, v, g_bad, b.sigmoid(), backend="triton")
