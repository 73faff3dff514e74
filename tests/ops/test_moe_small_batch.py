"""Tests of the few-token routed experts (kimik3/ops/moe/small_batch.py) against their reference, the model's
``RoutedExperts.forward`` (torch, on CPU its grouped-matmul loop), and a per-(token, expert) loop in fp32 that
rounds the hidden rows as the kernels do.

(E, L, F, K) = (8, 48, 40, 2), (16, 64, 100, 4), (5, 33, 17, 3) (widths not powers of two), 1, 3 and 9 tokens, fp32
(rel_rms under 1e-5) and bf16 (rel_rms under 1e-2 against the reference run on fp32 copies and against its bf16
path; elementwise within a bf16 step of the loop reference plus one step of its largest term, for one hidden
element rounded the other way). Also: the loops over several L chunks, F blocks and F chunks (small blocks), the
default blocks, an expert named twice by a token and a token naming one expert K times (each occurrence counts),
ids outside 0..E-1 (they contribute nothing and read no weights), strided inputs, weights of another dtype than x
(rounded to x's as read), no tokens and K = 0, the block choice at K3's and the debug preset's shapes, the input
checks and, on a GPU, a CUDA-graph replay.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's and every load and store bounds-checked (tests/triton_bounds.py). The interpreter
runs one program at a time, so most cases use blocks as wide as their dims (fewest programs, ``fast_blocks``).

Legend: T tokens, K experts per token, E experts, L latent width, F expert hidden width.
"""

from __future__ import annotations


import pytest
import torch

from kimik3.model.ffn import situ_glu as situ_glu_ref
from kimik3.model.moe import RoutedExperts
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


if HAS_KERNELS:
    import kimik3.ops.moe.small_batch as small_batch
    from kimik3.ops.moe.small_batch import SMALL_BATCH_MAX_ROWS, routed_experts_small

SHAPES = [(8, 48, 40, 2), (16, 64, 100, 4), (5, 33, 17, 3)]  # (E, L, F, K)


@pytest.fixture
def fast_blocks(monkeypatch):
    """Under the interpreter: blocks as wide as the test shapes' dims (one F block, one L chunk, one L block per
    token), the fewest programs. On a GPU the defaults stay."""
    if not ON_GPU:
        set_blocks(monkeypatch, gate_l=128, gate_f=128, down_l=(128, 128), down_tile=128 * 128, target=1)


def set_blocks(monkeypatch, gate_l, gate_f, down_l, down_tile, target):
    """Fixed gate blocks [gate_l, gate_f]; the down kernel's L block range and tile; the grid's target."""
    for name, value in [("GATE_BLOCK_F_MAX", gate_f), ("GATE_BLOCK_F_MIN", gate_f),
                        ("GATE_TILE_ELEMS", gate_l * gate_f), ("DOWN_BLOCK_L_MIN", down_l[0]),
                        ("DOWN_BLOCK_L_MAX", down_l[1]), ("DOWN_TILE_ELEMS", down_tile), ("TARGET_PROGRAMS", target)]:
        monkeypatch.setattr(small_batch, name, value)


def inputs(E, L, F, K, T, dtype=torch.float32, seed=0, w_dtype=None):
    """(x, weights, ids, w_gate, w_up, w_down) on DEV: x ~ N(0, 1) and the expert matrices scaled so that gate and
    up are ~N(0, 1.5^2) (SiTU-GLU away from its linear range), ids uniform in 0..E-1 (repeats possible), weights
    normalised per token as the router's. x in ``dtype``, the matrices in ``w_dtype`` (default ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    w_dtype = w_dtype or dtype
    x = torch.randn(T, L, generator=gen).to(DEV, dtype)
    w_gate = (torch.randn(E, L, F, generator=gen) * 1.5 / L ** 0.5).to(DEV, w_dtype)
    w_up = (torch.randn(E, L, F, generator=gen) * 1.5 / L ** 0.5).to(DEV, w_dtype)
    w_down = (torch.randn(E, F, L, generator=gen) / F ** 0.5).to(DEV, w_dtype)
    ids = torch.randint(0, E, (T, K), generator=gen).to(DEV)
    weights = torch.rand(T, K, generator=gen) + 0.1
    weights = (weights / weights.sum(-1, keepdim=True)).to(DEV)
    return x, weights, ids, w_gate, w_up, w_down


def module_reference(x, weights, ids, w_gate, w_up, w_down):
    """``RoutedExperts.forward`` with these weights, in x's dtype (the module casts its weights to it)."""
    E, L, F = w_gate.shape
    module = RoutedExperts(E, L, F).to(DEV)
    with torch.no_grad():
        for p, w in zip((module.w_gate_ELF, module.w_up_ELF, module.w_down_EFL), (w_gate, w_up, w_down)):
            p.copy_(w.float())
        return module.to(w_gate.dtype)(x, weights, ids)


def loop_reference(x, weights, ids, w_gate, w_up, w_down):
    """The kernels' math in fp32, one (token, expert) at a time: the weights rounded to x's dtype, the hidden row
    rounded to x's dtype, ids outside 0..E-1 skipped. Returns (y in fp32, the largest term |h_f w_down[e][f, l]|
    over k and f per output [T, L], the sum of those terms [T, L])."""
    T, L = x.shape
    E = w_gate.shape[0]
    wg, wu, wd = (w.to(x.dtype).float() for w in (w_gate, w_up, w_down))
    y = torch.zeros(T, L, dtype=torch.float64, device=DEV)
    max_term = torch.zeros(T, L, dtype=torch.float64, device=DEV)
    sum_terms = torch.zeros(T, L, dtype=torch.float64, device=DEV)
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < E:
                continue
            xt = x[t].float()
            h = situ_glu_ref(xt @ wg[e], xt @ wu[e]) * weights[t, k]
            h = h.to(x.dtype).double()
            terms = (h[:, None] * wd[e].double()).abs()
            y[t] += h @ wd[e].double()
            max_term[t] = torch.maximum(max_term[t], terms.max(0).values)
            sum_terms[t] += terms.sum(0)
    return y.float(), max_term, sum_terms


def check(got, args, what=""):
    """got matches the references: fp32 within rel_rms 1e-5 of ``RoutedExperts``; bf16 within rel_rms 1e-2 of it
    run on fp32 copies and of its bf16 path, and elementwise within a bf16 step of the loop reference (the final
    rounding) plus a bf16 step of the largest term (one hidden element that rounds the other way after a
    different fp32 summation order) plus 1e-6 of the terms' sum (fp32 accumulation)."""
    x = args[0]
    assert got.shape == x.shape and got.dtype == x.dtype and got.device == x.device, (what, got.shape, got.dtype)
    if x.dtype == torch.float32:
        ref = module_reference(*args)
        assert rel_rms(ref, got) < 1e-5, (what, rel_rms(ref, got))
        return
    ref32 = module_reference(x.float(), *args[1:3], *(w.float() for w in args[3:]))
    assert rel_rms(ref32, got) < 1e-2, (what, rel_rms(ref32, got))
    ref16 = module_reference(*args)
    assert rel_rms(ref16, got) < 1e-2, (what, rel_rms(ref16, got))
    ref, max_term, sum_terms = loop_reference(*args)
    err = (got.double() - ref.double()).abs()
    tol = ref.double().abs() * BF16_ULP + max_term * BF16_ULP + sum_terms * 1e-6
    assert bool((err <= tol).all()), (what, (err - tol).max())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("E,L,F,K", SHAPES)
def test_matches_the_reference(fast_blocks, E, L, F, K, T, dtype):
    args = inputs(E, L, F, K, T, dtype, seed=T)
    with torch.no_grad():
        check(routed_experts_small(*args), args)


@needs_kernels
@pytest.mark.parametrize("E,L,F,K,dtype", [(*SHAPES[0], torch.float32), (*SHAPES[2], torch.bfloat16)],
                         ids=["fp32", "bf16"])
def test_loops_over_several_blocks(monkeypatch, E, L, F, K, dtype):
    # L chunks of 16 (L = 48: 3 whole, L = 33: 2 and a 1-wide tail), F blocks of 16 (F = 40: 3, F = 17: 2), and
    # the down kernel's L blocks of 8 and F chunks of 16: every loop runs several steps, every mask has a tail.
    set_blocks(monkeypatch, gate_l=16, gate_f=16, down_l=(8, 8), down_tile=128, target=1)
    assert small_batch._blocks(2, 2 * K, L, F) == (16, 16, 8, 16)
    args = inputs(E, L, F, K, 2, dtype, seed=20)
    with torch.no_grad():
        check(routed_experts_small(*args), args)


@needs_kernels
def test_default_blocks():
    E, L, F, K = SHAPES[1]
    # F = 100: four F blocks of 32 (the grid is short of programs); L = 64: four L blocks, F in one chunk
    assert small_batch._blocks(2, 2 * K, L, F) == (64, 32, 16, 128)
    args = inputs(E, L, F, K, 2, torch.bfloat16, seed=21)
    with torch.no_grad():
        check(routed_experts_small(*args), args)


@needs_kernels
def test_blocks_at_k3_and_debug_shapes():
    L, F = 3584, 3072
    assert small_batch._blocks(1, 16, L, F) == (64, 64, 16, 512)  # 768 gate programs, 224 down
    assert small_batch._blocks(4, 64, L, F) == (64, 64, 32, 256)  # 448 down
    assert small_batch._blocks(64, 1024, L, F) == (64, 64, 64, 128)
    # The debug preset's experts (L 512, F 384, top-4) at one token: 48 gate programs of [128, 32], 32 down of
    # [512, 16] (the grid stays short of the target: the blocks stop at their minimums)
    assert small_batch._blocks(1, 4, 512, 384) == (128, 32, 16, 512)
    assert isinstance(SMALL_BATCH_MAX_ROWS, int) and SMALL_BATCH_MAX_ROWS >= 64


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_repeated_experts_count_each_time(fast_blocks, dtype):
    E, L, F, K = SHAPES[1]
    x, weights, ids, *ws = inputs(E, L, F, K, 3, dtype, seed=22)
    ids = torch.tensor([[3, 9, 3, 3], [7, 7, 7, 7], [0, 15, 1, 14]], device=DEV)
    args = (x, weights, ids, *ws)
    with torch.no_grad():
        got = routed_experts_small(*args)
        check(got, args)
        if dtype == torch.float32:
            # Token 1 names expert 7 four times: its output is expert 7's, times the sum of its weights.
            one = routed_experts_small(x[1:2], weights[1:2].sum(-1, keepdim=True), ids[1:2, :1], *ws)
            assert rel_rms(one, got[1:2]) < 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ids_out_of_range_contribute_nothing(fast_blocks, dtype):
    # A padding row (id -1, or E) adds nothing, whatever its weight (NaN here: its weight is not read either);
    # under the interpreter the bounds checker would flag a read of expert -1's or E's matrices.
    E, L, F, K = SHAPES[2]
    x, weights, ids, *ws = inputs(E, L, F, K, 3, dtype, seed=23)
    bad_ids = ids.clone()
    bad_ids[0, 1], bad_ids[2, :] = -1, E
    bad_weights = weights.clone()
    bad_weights[0, 1] = bad_weights[2, 0] = float("nan")
    with torch.no_grad():
        got = routed_experts_small(x, bad_weights, bad_ids, *ws)
    assert bool((got[2] == 0).all())
    keep = torch.ones(3, K, device=DEV)
    keep[0, 1] = keep[2] = 0
    args = (x, weights * keep, ids, *ws)  # the same rows given weight 0
    ref, _, _ = loop_reference(*args)
    if dtype == torch.float32:
        assert rel_rms(ref, got) < 1e-5
    else:
        check(got, args)


@needs_kernels
def test_strided_inputs(fast_blocks):
    E, L, F, K = SHAPES[0]
    T = 3
    x, weights, ids, w_gate, w_up, w_down = inputs(E, L, F, K, T, seed=24)
    x_s = torch.zeros(T, 2 * L, device=DEV)[:, 1::2].copy_(x)        # x along L with stride 2
    weights_s = weights.t().contiguous().t()                          # [T, K] with strides (1, T)
    ids_s = torch.zeros(T, 3 * K, dtype=torch.int64, device=DEV)[:, ::3].copy_(ids)
    w_gate_s = w_gate.transpose(1, 2).contiguous().transpose(1, 2)    # [E, L, F] stored [E, F, L]
    w_up_s = torch.zeros(2 * E, L, F + 3, device=DEV)[::2, :, 3:].copy_(w_up)
    w_down_s = w_down.transpose(0, 1).contiguous().transpose(0, 1)   # [E, F, L] stored [F, E, L]
    with torch.no_grad():
        got = routed_experts_small(x_s, weights_s, ids_s, w_gate_s, w_up_s, w_down_s)
    check(got, (x, weights, ids, w_gate, w_up, w_down))


@needs_kernels
def test_weights_in_another_dtype_are_rounded_to_xs(fast_blocks):
    E, L, F, K = SHAPES[2]
    # bf16 x, fp32 weights: the reference casts the weights to bf16 (w.to(x.dtype)); so do the kernels' loads.
    args = inputs(E, L, F, K, 3, torch.bfloat16, seed=25, w_dtype=torch.float32)
    with torch.no_grad():
        check(routed_experts_small(*args), args)
    # fp32 x, bf16 weights: exact upcasts, fp32 math.
    args = inputs(E, L, F, K, 3, torch.float32, seed=26, w_dtype=torch.bfloat16)
    with torch.no_grad():
        check(routed_experts_small(*args), args)


@needs_kernels
def test_no_tokens_and_no_experts():
    E, L, F, K = SHAPES[0]
    x, weights, ids, *ws = inputs(E, L, F, K, 0, torch.bfloat16)
    out = routed_experts_small(x, weights, ids, *ws)
    assert out.shape == (0, L) and out.dtype == torch.bfloat16
    x, weights, ids, *ws = inputs(E, L, F, K, 2)
    out = routed_experts_small(x, weights[:, :0], ids[:, :0], *ws)
    assert out.shape == (2, L) and bool((out == 0).all())


@needs_kernels
def test_bad_inputs_are_named():
    E, L, F, K = SHAPES[2]
    x, w, ids, wg, wu, wd = inputs(E, L, F, K, 2)
    cases = [
        ((x[0], w, ids, wg, wu, wd), r"x_TL must be 2-D \[T, L\]"),
        ((x.long(), w, ids, wg, wu, wd), "x_TL must be fp32 or bf16"),
        ((x.half(), w, ids, wg, wu, wd), "x_TL must be fp32 or bf16"),
        ((x, w, ids, wg[0], wu, wd), r"w_gate_ELF must be 3-D \[E, L, F\]"),
        ((x[:, :-1], w, ids, wg, wu, wd), "has L = 33 but x_TL"),
        ((x, w, ids, wg, wu[:, :, :-1], wd), "w_up_ELF must have w_gate_ELF's shape"),
        ((x, w, ids, wg, wu, wd.transpose(1, 2)), r"w_down_EFL must be \[E, F, L\] = \(5, 17, 33\)"),
        ((x, w, ids[:1], wg, wu, wd), r"ids_TK must be 2-D \[T=2, K\]"),
        ((x, w, ids[:, 0], wg, wu, wd), r"ids_TK must be 2-D"),
        ((x, w[:, :-1], ids, wg, wu, wd), "weights_TK must have ids_TK's shape"),
        ((x, w, ids.int(), wg, wu, wd), "ids_TK must be int64"),
        ((x, w.bfloat16(), ids, wg, wu, wd), "weights_TK must be fp32"),
        ((x, w, ids, wg.double(), wu, wd), "w_gate_ELF must be fp32 or bf16"),
        ((x, w, ids, wg, wu, wd.half()), "w_down_EFL must be fp32 or bf16"),
        ((x, w, ids, wg, wu.to("meta"), wd), "w_up_ELF is on meta but x_TL"),
        ((x, w.to("meta"), ids, wg, wu, wd), "weights_TK is on meta"),
        ((x, w, ids.tolist(), wg, wu, wd), "ids_TK must be a tensor"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            routed_experts_small(*args)
    # Forward only: an input that requires grad is refused while grad is enabled, taken under no_grad (serving
    # runs the model's nn.Parameters, which require grad, under no_grad or inference_mode).
    wg_param = torch.nn.Parameter(wg)
    with pytest.raises(RuntimeError, match="forward only"):
        routed_experts_small(x, w, ids, wg_param, wu, wd)
    with torch.inference_mode():
        out = routed_experts_small(x[:1], w[:1], ids[:1], wg_param, wu, wd)
    assert out.shape == (1, L)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    E, L, F, K = SHAPES[1]
    x, weights, ids, *ws = inputs(E, L, F, K, 4, torch.bfloat16, seed=27)
    with torch.no_grad():
        routed_experts_small(x, weights, ids, *ws)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = routed_experts_small(x, weights, ids, *ws)
        x2, weights2, ids2, *_ = inputs(E, L, F, K, 4, torch.bfloat16, seed=28)
        x.copy_(x2)
        weights.copy_(weights2)
        ids.copy_(ids2)
        graph.replay()
        check(out.clone(), (x, weights, ids, *ws), "replayed")
