"""Tests of the Triton KDA pipelines (kimik3/ops/kda/forward.py, backward.py and their stages) against the fp32
token loop.

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set
below before anything imports the kernels) at tiny shapes; with CUDA they run on the GPU at larger
shapes (H up to 96, D 128, T up to 1000). Skipped cleanly when triton is not installed.

Error measure: rel_rms(ref, out) = rms(ref - out) / rms(ref), computed in float64 -- the same
normalised error as fla's ``assert_close`` ratio (get_err_ratio). Tolerances (fla's): o and
state 5e-3, dq/dk/dv 8e-3, dg/dbeta 2e-2 (initial-state gradient 5e-3).

Every gradient test runs the Triton backward (backward.py: bwd_scan, bwd_wy, bwd_intra, preact_bwd), so each checks
those kernels against the token loop. Shapes are the smallest that reach every code path: partial and whole chunks,
one-token and empty varlen segments, K and V that are not powers of two, several K blocks (K = 100, 130) and V
blocks (V = 80), fp32 and bf16. On the CPU the Gluon stages never run (dispatch.py: they need sm_90);
tests/ops/test_kda_gluon.py checks them against these Triton stages.

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
    chunk_kda,
    kda_backend,
    kda_decode,
    naive_recurrent_kda,
    recurrent_kda_step,
    torch_preactivations,
)

DEV = "cuda" if ON_GPU else "cpu"
G_MIN = -5.0
TOL = {"o": 5e-3, "state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 5e-3}
GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
# bf16 inputs, output vs the fp32 token loop: bf16 output rounding alone is ~2e-3, and every product takes 16-bit
# operands (fla's precision class, benchmarks/kda_precision.py); on the interpreter's K = V = 16 case the o error is
# about 1.2e-2.
BF16_O_TOL = 1.5e-2


@pytest.fixture(autouse=True, scope="module")
def _interpreter_setup():
    import contextlib

    from tests.triton_bounds import bounds_checked

    checked = contextlib.nullcontext()
    if not ON_GPU:       # (tests/conftest.py makes the interpreter's bf16 the GPU's)
        checked = bounds_checked()  # every kernel launch in this file: no lane outside its tensors
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    with checked:
        yield
    torch.set_num_threads(saved)


@pytest.mark.skipif(ON_GPU, reason="checks the interpreter's bf16 patch (CPU only)")
def test_interpreter_rounds_to_bf16_as_the_gpu_does():
    """``interpreter_bf16_fix`` (on for every test: tests/conftest.py): fp32 -> bf16 in a kernel rounds to nearest
    even, as the GPU and torch do (Triton 3.6's interpreter alone truncates: 1 + 3 * 2^-9 became 1), ties and
    negatives too."""
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
# the pipeline (forward + gradients) vs naive
# --------------------------------------------------------------------------

# B, H, K, V: on the CPU each (chunk, head) program costs the interpreter about half a second, so most tests take one
# sequence and one head; test_fp32_vs_naive[65] and the decode tests cover batches and heads
SMALL = (1, 1, 16, 16) if not ON_GPU else (2, 4, 64, 64)


@pytest.mark.parametrize("B,T,H", [(2, 1, 1), (2, 65, 2)])
def test_fp32_vs_naive(B, T, H):
    """A batch of one-token sequences; two sequences and two heads over a whole chunk and a one-token chunk."""
    K, V = SMALL[2:]
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


@pytest.mark.parametrize("K,V", [(24, 40), (40, 80)])
def test_odd_head_dims(K, V):
    """Head sizes that are not powers of two (padded blocks), K != V, and V = 80: two 64-column V blocks in the
    scan, the output kernel, the state-gradient scan and the WY backward's V loops, the second partial."""
    inputs = make_inputs(1, 65, 1, K, V, seed=K)
    check_against_naive(inputs, make_state(1, 1, K, V))


@pytest.mark.parametrize("K", [100, 130])
def test_wide_keys(K):
    """Several 64-column key blocks (K = 100: two, the second partial; K = 130: three, padded to 256): the intra, WY
    and WY-backward blocks, three and four parts of dA / dbeta summed by the intra backward, its key blocks and the
    suffix sum's; V = 16 (the backward's 32-column V blocks, masked)."""
    inputs = make_inputs(1, 70, 1, K, 16, seed=K)
    check_against_naive(inputs, make_state(1, 1, K, 16))


def test_varlen():
    """Packed sequences: one-token and empty segments (an empty one's final state is its initial state), a whole
    chunk and a partial one."""
    lengths = [1, 3, 0, 64, 65, 2]
    H, K, V = SMALL[1:]
    cu = cu_seqlens(lengths, DEV)
    inputs = make_inputs(1, sum(lengths), H, K, V, seed=6)
    check_against_naive(inputs, make_state(len(lengths), H, K, V), cu=cu)


def test_intra_matrices_are_written_in_full():
    """Aqk and T (the forward's aux, read by the solve, the output and the backward) come out whole: lower
    triangular, zeros above the diagonal written rather than assumed, every chunk of a varlen batch with partial
    chunks covered. Under the interpreter the buffers start as NaN (``plan.scratch``), so an entry a kernel leaves
    unwritten shows here."""
    from kimik3.ops.kda.forward import kda_fwd
    from kimik3.ops.kda.plan import make_plan

    lengths, H, K, V = [1, 3, 64, 65, 47], 1, 16, 16
    cu = cu_seqlens(lengths, DEV)
    q, k, v, g, beta = make_inputs(1, sum(lengths), H, K, V, seed=5)
    plan = make_plan(1, sum(lengths), cu, q.device)
    with torch.no_grad():
        aux = kda_fwd(q, k, v, g, beta, K**-0.5, None, False, plan, return_aux=True)[2]
    for name in ("aqk", "tinv"):
        m = aux[name]
        assert m.shape == (plan.NT, H, 64, 64) and not m.isnan().any(), name
        assert torch.equal(m.triu(1), torch.zeros_like(m)), name


@pytest.mark.parametrize("pattern", ["all", "tile"])
def test_gates_at_the_bound(pattern):
    """Every gate at g_min, and one whole 16-token sub-tile (and more) saturated: an in-tile decay of e^-80."""
    B, H, K, V = SMALL
    q, k, v, g, beta = make_inputs(B, 80, H, K, V, seed=5)
    with torch.no_grad():
        if pattern == "all":
            g.fill_(G_MIN)
        else:
            g[:, 16:40] = G_MIN
            g[:, 40::2] = -1e-4
    check_against_naive([q, k, v, g, beta], make_state(B, H, K, V))


@pytest.mark.parametrize("scale", [None, 0.0])
def test_bf16_vs_naive(scale):
    """bf16 inputs: the output, the final state and every gradient vs the fp32 token loop on the same (bf16-valued)
    inputs; gradients in the inputs' dtypes. The state-gradient scan's 16-bit products accumulate in place with dO
    times the power of two of the scale (1 / sqrt(16) here); a zero scale takes its form with separate products."""
    B, H, K, V = SMALL
    inputs = make_inputs(B, 130, H, K, V, dtype=torch.bfloat16, seed=11)
    h0 = make_state(B, H, K, V)
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, fresh([h0])[0], scale=scale)
    o, s, g = run_with_grads(chunk_kda, inputs, h0, backend="triton", scale=scale)
    assert o.dtype == torch.bfloat16 and [x.dtype for x in g] == [x.dtype for x in inputs] + [torch.float32]
    if scale == 0.0:
        assert torch.count_nonzero(o) == 0
    else:
        assert rel_rms(o_ref, o) < BF16_O_TOL, rel_rms(o_ref, o)
    assert rel_rms(s_ref, s) < TOL["state"]
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        if scale == 0.0 and name == "dq":
            assert torch.count_nonzero(b) == 0
            continue
        assert rel_rms(a, b) < TOL[name], (name, rel_rms(a, b))


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


# --------------------------------------------------------------------------
# the fused pre-activations (gate, q / k L2 norm, beta sigmoid)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("use_gate,K", [(True, 100), (False, 16)])
def test_prologue_gamma_is_the_chunk_cumsum_of_the_gate(use_gate, K):
    """The forward prologue's Gamma and sigmoid(beta) against torch: each chunk's inclusive cumulative sum of the gate
    g_min sigmoid(exp(A_log) (z + dt_bias)) (or of g itself without the fused gate), restarting at every sequence and
    every 64 tokens; varlen with one-token sequences and partial chunks, K = 100 (a partial key block). With the L2
    norm fused (the gate per column block, the norms over rows), and without (one program per chunk and head). fp32
    throughout: within 1e-5."""
    from kimik3.ops.kda.plan import make_plan
    from kimik3.ops.kda.prologue import launch_prologue

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
    BKF = 128 if K > 64 else 16
    use_l2 = use_gate  # both prologue forms
    launch_prologue(z.to(DEV), G, q.to(DEV), k.to(DEV), qn, kn, beta.to(DEV), betan, alog.to(DEV), dtb.to(DEV),
                    plan, H, K, BKF, min(64, BKF), G_MIN, use_gate, use_l2, True)
    g = G_MIN * torch.sigmoid(alog.exp()[:, None] * (z + dtb.view(H, K))) if use_gate else z
    want = torch.empty_like(g)
    for b, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for t0 in range(b, e, 64):
            want[:, t0:min(t0 + 64, e)] = g[:, t0:min(t0 + 64, e)].cumsum(1)
    assert not G.isnan().any()
    assert (G.cpu() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.allclose(betan.cpu(), torch.sigmoid(beta), atol=1e-6)
    if use_l2:
        assert torch.allclose(qn.cpu(), torch.nn.functional.normalize(q, dim=-1, eps=0), atol=1e-5)


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, True, False),
                                   (False, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_preact_backward_kernel(flags, dtype):
    """preact_bwd.preact_bwd_triton vs torch autograd through torch_preactivations, 37 tokens (not a multiple of the
    kernel's 32 rows), K = 40 (padded to 64): each fused stage alone and together."""
    from kimik3.ops.kda.preact_bwd import preact_bwd_triton

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
    outs = torch_preactivations(*leaves[:4], leaves[4], leaves[5], G_MIN, use_gate, use_l2, use_bsig)
    ref = torch.autograd.grad(outs, leaves, (dq, dk, dg, db), allow_unused=True)
    got = preact_bwd_triton(q, k, z, b, dq, dk, dg, db, a_log, dtb, G_MIN, use_gate, use_l2, use_bsig)
    assert [x.dtype for x in got[:4]] == [dtype] * 4
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the outputs are rounded to bf16
    for name, r, x in zip(["dq", "dk", "dz", "dbeta", "dA_log", "ddt_bias"], ref, got):
        if name in ("dA_log", "ddt_bias") and not use_gate:
            assert x is None and r is None, name
            continue
        assert rel_rms(r, x) < tol, (name, rel_rms(r, x))


@pytest.mark.parametrize("case", ["all", "all-K100-sfx32", "all-K130", "all-varlen-step1", "all-bf16", "gate",
                                  "l2-bsig-rows32"])
def test_fused_preactivations(monkeypatch, case):
    """Gate, q/k L2 norm and beta sigmoid fused: the output, the final state and the gradients w.r.t. the raw inputs
    (z, A_log, dt_bias too) vs the naive loop on the torch pre-activations. Their chain rules run inside the intra
    backward (the L2 norm and the sigmoid where dq, dk, dbeta are completed, the gate in the suffix-sum pass) up to
    K = 128: K = 100 (one 128-column key block, the last 28 masked; "sfx32": the suffix-sum pass in 32-column blocks
    of one warp, the last partial); at K = 130 the L2 norm's and sigmoid's by their own pass (counted here). Varlen
    with tiny segments and the suffix-sum pass one row a step as on the GPU ("step1"; the interpreter's default is
    16 rows), bf16, the gate alone (the prologue's per-chunk form) and the norms over 32-row programs (the last
    partial; "rows32")."""
    from kimik3.ops.kda import backward, bwd_intra, prologue

    B, T, H, K, V, cu, dtype = 1, 70, 1, 16, 16, None, torch.float32
    flags = tuple(name in case or "all" in case for name in ("gate", "l2", "bsig"))
    if "K1" in case:
        K = int(case.split("K")[1][:3])
    if "varlen" in case:
        lengths = [1, 2, 17, 50]
        cu = cu_seqlens(lengths, DEV)
        T = sum(lengths)
    if "bf16" in case:
        dtype, V = torch.bfloat16, 32
    if "sfx32" in case:
        monkeypatch.setattr(bwd_intra, "SUFFIX_BK", 32)
    if "step1" in case:
        monkeypatch.setattr(bwd_intra, "SUFFIX_STEP", 1)
    if "rows32" in case:
        monkeypatch.setattr(prologue, "L2_ROWS_CONFIG", (32, 2))
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
    orig = backward.preact_bwd_triton
    monkeypatch.setattr(backward, "preact_bwd_triton", lambda *a, **k: separate.append(1) or orig(*a, **k))

    def run(kind):
        xs = [x.to(DEV).requires_grad_() for x in raw]
        q, k, v, z, b, a_log, dtb, h0 = xs
        if kind == "naive":
            qq, kk, gg, bb = torch_preactivations(*(x.float() for x in (q, k, z, b)), a_log, dtb, G_MIN, *flags)
            o, s = naive_recurrent_kda(qq, kk, v.float(), gg, bb, initial_state=h0, output_final_state=True, **kw)
        else:
            o, s = chunk_kda(q, k, v, z, b, initial_state=h0, output_final_state=True, backend="triton",
                             A_log=a_log, dt_bias=dtb, lower_bound=G_MIN, use_gate_in_kernel=flags[0],
                             use_qk_l2norm_in_kernel=flags[1], use_beta_sigmoid_in_kernel=flags[2], **kw)
        gen2 = torch.Generator().manual_seed(9)
        do, ds = torch.randn(o.shape, generator=gen2).to(DEV), torch.randn(s.shape, generator=gen2).to(DEV)
        want = [x for i, x in enumerate(xs) if not (i in (5, 6) and not flags[0])]
        return o, s, torch.autograd.grad((o.float() * do).sum() + (s * ds).sum(), want)

    o_r, s_r, ref = run("naive")
    o, s, got = run("triton")
    assert len(separate) == (1 if "K130" in case else 0), case
    bf16 = dtype == torch.bfloat16
    assert rel_rms(o_r, o) < (BF16_O_TOL if bf16 else TOL["o"]) and rel_rms(s_r, s) < TOL["state"]
    names = ["dq", "dk", "dv", "dz", "dbeta", "dA_log", "ddt_bias", "dh0"] if flags[0] else \
        ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    tols = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 5e-3}
    assert [x.dtype for x in got[:5]] == [x.dtype for x in raw[:5]]  # the raw inputs' gradients in their dtypes
    for name, r, b in zip(names, ref, got):
        assert rel_rms(r.float(), b.float()) < (3 if bf16 else 1) * tols.get(name, 2e-2), \
            (name, rel_rms(r.float(), b.float()))


# --------------------------------------------------------------------------
# the custom operators (kimik3/ops/kda/autograd.py) and torch.compile
# --------------------------------------------------------------------------


def _fused_layer_inputs(T=20, dtype=torch.float32, N=1):
    """K3's layer call: raw q, k, gate input z and beta logit, with the gate, L2 norms and sigmoid fused."""
    gen = torch.Generator().manual_seed(5)
    H, K, V = 1, 16, 16
    xs = [torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen),
          torch.randn(1, T, H, V, generator=gen), torch.randn(1, T, H, K, generator=gen),
          torch.randn(1, T, H, generator=gen)]
    xs = [x.to(dtype) for x in xs] + [torch.rand(H, generator=gen), 0.5 * torch.randn(H, K, generator=gen),
                                      0.5 * torch.randn(N, H, K, V, generator=gen)]
    return [x.to(DEV).requires_grad_() for x in xs]


FUSED = dict(lower_bound=G_MIN, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
             use_beta_sigmoid_in_kernel=True)


@pytest.mark.parametrize("case", ["fused", "plain", "varlen"])
def test_custom_ops_pass_opcheck(case):
    """Both operators' schemas, fake implementations (shapes and dtypes of every output, the intermediates
    included), autograd registration and tracing as torch.library.opcheck checks them."""
    import kimik3.ops.kda.autograd  # noqa: F401  (registers the operators)

    q, k, v, z, b, a_log, dtb, h0 = _fused_layer_inputs(N=3 if case == "varlen" else 1)
    cu = cu_seqlens([1, 0, 19], DEV) if case == "varlen" else None
    flags = (True, True, True) if case != "plain" else (False, False, False)
    if case == "plain":
        z = (-torch.rand_like(z.detach()) * 4).requires_grad_()
        b = torch.sigmoid(b.detach()).requires_grad_()
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = (q, k, v, z, b, h0, a_log if flags[0] else None, dtb if flags[0] else None, cu, 0.25, True, G_MIN,
            *flags, True)
    torch.library.opcheck(torch.ops.kimik3.kda_chunk_fwd.default, args, test_utils=tests)
    out = torch.ops.kimik3.kda_chunk_fwd(*args)
    aux = [x.detach() for x in out[2:]]
    grads = [torch.randn_like(out[0]), torch.randn_like(out[1])]
    plain = [x.detach() for x in (q, k, v, z, b, h0)] + ([a_log.detach(), dtb.detach()] if flags[0] else [None] * 2)
    bwd_args = (*grads, aux, *plain, cu, 0.25, G_MIN, *flags, 0b11111111 if flags[0] else 0b00111111)
    torch.library.opcheck(torch.ops.kimik3.kda_chunk_bwd.default, bwd_args, test_utils=tests[:1] + tests[2:])


def test_compile_traces_a_kda_call_in_one_graph_with_eager_results():
    """torch.compile (fullgraph: a graph break fails) of a function around K3's fused KDA call gives eager's output
    and gradients bit for bit (the operators run the same kernels; the graph only orders the calls)."""
    from kimik3.ops.kda.autograd import chunk_kda_triton

    def f(q, k, v, z, b, a_log, dtb, h0):
        o, s = chunk_kda_triton(q * 1.5, k, v, z, b, initial_state=h0, output_final_state=True, A_log=a_log,
                                dt_bias=dtb, g_min=G_MIN, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True)
        return (o.float().square()).sum() + s.sin().sum()

    xs = _fused_layer_inputs(T=70)
    explained = torch._dynamo.explain(f)(*xs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        inputs = fresh(xs)
        loss = fn(*inputs)
        results.append([loss, *torch.autograd.grad(loss, inputs)])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
    with torch.no_grad():   # a forward without gradients keeps no intermediates
        out = torch.ops.kimik3.kda_chunk_fwd(*xs[:5], xs[7], xs[5], xs[6], None, 0.25, False, G_MIN, True, True,
                                             True, False)
    assert len(out) == 1


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
        qq, kk, gg, bb = torch_preactivations(q, k, z, b, a_log, dtb, G_MIN, True, True, True)
    else:
        qq, kk = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        gg, bb = G_MIN * torch.sigmoid(z), torch.sigmoid(b)
    ref_pool = pool.clone()
    if fused:
        # The layer's inputs are column slices of one projection output: rows strided, each row contiguous.
        wide = torch.cat([x.flatten(1) for x in (q, k, v, z, b)] + [torch.zeros(B, 3, device=DEV)], dim=1)
        sizes = [H * K, H * K, H * V, H * K, H, 3]
        sq, sk, sv, sz, sb, _ = wide.split(sizes, dim=1)
        sq, sk, sz = (x.unflatten(1, (H, K)) for x in (sq, sk, sz))
        o = kda_decode(sq, sk, sv.unflatten(1, (H, V)), sz, sb, pool, slots, A_log=a_log, dt_bias=dtb, g_min=G_MIN,
                       use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       backend="triton")
    else:
        o = kda_decode(qq, kk, v, gg, bb, pool, slots, backend="triton")
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(o[i], torch.zeros_like(o[i]))
            continue
        o_ref, s_ref = recurrent_kda_step(qq[i:i + 1], kk[i:i + 1], v[i:i + 1], gg[i:i + 1], bb[i:i + 1],
                                          ref_pool[s:s + 1])
        assert rel_rms(o_ref[0], o[i]) < 1e-5
        ref_pool[s] = s_ref[0]
    assert rel_rms(ref_pool, pool) < 1e-6  # untouched slots bit-equal, updated ones to rounding


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("K,V,T", [(16, 16, 3), (24, 40, 1), (128, 128, 2)])   # 128: the debug and K3 head size
def test_verify_kernel_matches_token_by_token_decode(fused, K, V, T):
    """kda_verify (a speculative verification: T tokens a row, each state recorded, the pool untouched) against
    kda_decode's torch path run token by token on a copy of the pool; the torch verify path as well."""
    from kimik3.ops.kda.verify import kda_verify, kda_verify_torch

    B, H, P = 3, 2, 5
    gen = torch.Generator().manual_seed(K + V + T)
    q, k, z = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    v, b = torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, generator=gen)
    a_log, dtb = torch.rand(H, generator=gen), torch.randn(H, K, generator=gen)
    pool = torch.randn(P, H, K, V, generator=gen)
    q, k, v, z, b, a_log, dtb, pool = (x.to(DEV) for x in (q, k, v, z, b, a_log, dtb, pool))
    slots = torch.tensor([3, -1, 0], device=DEV)
    if fused:
        kw = dict(A_log=a_log, dt_bias=dtb, g_min=G_MIN, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True)
        gate = z
    else:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        gate, b = G_MIN * torch.sigmoid(z), torch.sigmoid(b)
        kw = {}
    before = pool.clone()
    ref_pool = pool.clone()
    ref_o, ref_steps = [], []
    for t in range(T):
        ref_o.append(kda_decode(q[:, t], k[:, t], v[:, t], gate[:, t], b[:, t], ref_pool, slots, backend="torch", **kw))
        ref_steps.append(ref_pool[slots.clamp_min(0)].clone())
    ref_o = torch.stack(ref_o, dim=1)
    for verify, backend in ((kda_verify, {"backend": "triton"}), (kda_verify_torch, {})):
        steps = torch.full((T, B, H, K, V), float("nan"), device=DEV)
        o = verify(q, k, v, gate, b, pool, slots, steps, **kw, **backend)
        assert torch.equal(pool, before)                       # the pool is read, never written
        assert torch.equal(o[1], torch.zeros_like(o[1]))       # the padding row
        for i in (0, 2):
            assert rel_rms(ref_o[i], o[i]) < 1e-5
            assert rel_rms(torch.stack(ref_steps)[:, i], steps[:, i]) < 1e-6


def test_decode_matches_chunk_continuation():
    """Prefill T tokens with chunk_kda, then decode 3 tokens: equals one naive pass over T + 3."""
    B, H, K, V = 2, 1, 16, 16
    q, k, v, g, beta = (x.detach() for x in make_inputs(B, 67, H, K, V, seed=21))
    with torch.no_grad():
        o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
        _, state = chunk_kda(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], output_final_state=True,
                             backend="triton")
    pool = torch.zeros(4, H, K, V, device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    pool[slots] = state
    for t in range(64, 67):
        o = kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool, slots, backend="triton")
        assert rel_rms(o_ref[:, t], o) < 5e-5
    assert rel_rms(s_ref, pool[slots]) < 5e-5


def test_decode_dispatch_picks_the_kernel_or_the_torch_path():
    """kimik3.ops.kda.kda_decode with backend="triton" is the kernel (bit-equal); with "torch" the torch path,
    equal to rounding; both update the same pool rows."""
    from kimik3.ops.kda.decode_kernel import launch_decode

    dispatch = kda_decode

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
    o_kernel = launch_decode(q, k, v, z, b, pools[0], slots, **kw)
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
            kda_decode(**kw, backend="triton")
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
    B, T, H, K, V = 1, 40, 1, SMALL[2], SMALL[3]
    gen = torch.Generator().manual_seed(17)
    q, k, z = (torch.randn(B, T, H, K, generator=gen).to(DEV) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen).to(DEV)
    b = torch.randn(B, T, H, generator=gen).to(DEV)
    a_log, dtb = (torch.rand(H, generator=gen) * 2).to(DEV), (0.5 * torch.randn(H, K, generator=gen)).to(DEV)
    z[0, 5, 0, 3], z[0, 20, 0, 0] = float("inf"), float("-inf")
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
    assert dz[0, 5, 0, 3] == 0 and dz[0, 20, 0, 0] == 0  # a saturated sigmoid passes no gradient
    z_nan = z.clone()
    z_nan[0, 30, 0, 2] = float("nan")
    with torch.no_grad():
        o, _ = chunk_kda(q, k, v, z_nan, b, backend="triton", **kw)
    assert torch.isnan(o).any()
    g = -torch.rand(B, T, H, K, generator=gen).to(DEV)
    for bad in (float("inf"), float("nan")):
        g_bad = g.clone()
        g_bad[0, 7, 0, 1] = bad
        with pytest.raises(ValueError, match=r"g \(log-decay\) contains NaN or \+inf"):
            chunk_kda(q, k, v, g_bad, b.sigmoid(), backend="triton")
