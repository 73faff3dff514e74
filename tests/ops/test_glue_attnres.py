"""Tests of the fused AttnRes mix (kimik3/ops/glue/attnres.py) against its reference, ``attnres_mix_reference``:
forward and every gradient (entries, key norm weight, query), fp32 and bf16, N = 1, 2, 5 entries, widths that are not
powers of two (96, 200), 1, 3 and 130 rows (several row blocks, and several a backward program with a partial last
one); the stacked-tensor input, a list longer than the pointer tuple, mixed entry dtypes, bf16 parameters, strided
entries, no rows, fp64 gradcheck, the backend choice, and the input checks. The mix with its RMSNorm in one kernel
(``attnres_mix_norm``, forward only) against the two kernels and the torch modules, and the block's choice of it
(``mixed_and_normed``).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's (``interpreter_bf16_fix``) and every load and store bounds-checked, the tensors
inside tuple arguments included (``tests/triton_bounds.py``).

Legend: B batch, T tokens, N entries, D width, R rows.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from kimik3.model.attnres import AttnResMix, added_mixed_and_normed, attnres_mix_reference, mixed_and_normed
from kimik3.model.norm import RMSNorm
from kimik3.ops.glue import (MAX_ENTRIES, MAX_WIDTH, attnres_mix, attnres_mix_backward, attnres_mix_forward,
                             attnres_mix_norm, glue_backend, rms_norm)
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


def make_mix(D, seed=0, dtype=torch.float32) -> AttnResMix:
    """A mix with random key norm weight (around 1) and query (scores of a few units), on DEV."""
    gen = torch.Generator().manual_seed(seed)
    mix = AttnResMix(D)
    with torch.no_grad():
        mix.key_norm_weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        mix.query.copy_(0.3 * torch.randn(D, generator=gen))
    return mix.to(device=DEV, dtype=dtype)


def make_entries(N, lead, D, dtype, seed=1):
    """N leaf entries [*lead, D] with different scales (so the RMS normalisation matters)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*lead, D, generator=gen) * (0.5 + n)).to(device=DEV, dtype=dtype).requires_grad_()
            for n in range(N)]


def reference(mix, entries, grad):
    """Output and grads (entries..., key norm weight, query) of the formula through autograd
    (``attnres_mix_reference``)."""
    out = attnres_mix_reference(entries, mix.key_norm_weight, mix.query, mix.eps)
    return [out, *torch.autograd.grad(out, [*entries, mix.key_norm_weight, mix.query], grad)]


def assert_matches(got, ref, dtype, what):
    """fp32 (and fp32 parameter grads): rel_rms under 1e-5 (the parameter grads sum over every row, in another order
    on a GPU than on the CPU). bf16: every element within one bf16 step of the
    reference's (the two round the same fp32 math, computed in another order, to bf16) plus 1e-5 of the tensor's
    RMS, rel_rms under 2e-3."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    if dtype == torch.float32 or got.dtype == torch.float32:
        assert rel_rms(ref, got) < 1e-5, (what, rel_rms(ref, got))
    else:
        g, r = got.double(), ref.double()
        # Plus fp32 noise at the tensor's scale: an output is a weighted sum of entries, and where it cancels to
        # near zero the two summation orders differ by more than a bf16 step of the small result.
        atol = 1e-5 * float(r.detach().square().mean().sqrt())
        assert bool(((g - r).abs() <= r.abs() * BF16_ULP + atol).all()), (what, (g - r).abs().max())
        assert rel_rms(ref, got) < 2e-3, (what, rel_rms(ref, got))


def check_kernel_against_module(mix, entries, grad, dtype, names=None) -> torch.Tensor:
    """The kernel's output and its grads (entries, key norm weight, query) against the module's, each checked by
    ``assert_matches`` in ``dtype`` (labelled by ``names``, else by position); returns the kernel's output."""
    ref = reference(mix, entries, grad)
    out = attnres_mix(entries, mix.key_norm_weight, mix.query, mix.eps)
    got = [out, *torch.autograd.grad(out, [*entries, mix.key_norm_weight, mix.query], grad)]
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert_matches(g, r, dtype, names[i] if names else i)
    return out


CASES = [  # dtype, N, lead dims (R = their product), D
    (torch.float32, 1, (1, 3), 96),
    (torch.float32, 2, (2, 17), 200),
    (torch.float32, 5, (1, 1), 96),
    (torch.bfloat16, 5, (3,), 200),
    (torch.bfloat16, 2, (2, 17), 96),
    (torch.bfloat16, 1, (1,), 200),
]


@needs_kernels
@pytest.mark.parametrize("dtype,N,lead,D", CASES)
def test_forward_and_grads_match_the_module(dtype, N, lead, D):
    mix = make_mix(D)
    entries = make_entries(N, lead, D, dtype)
    grad = torch.randn(*lead, D, generator=torch.Generator().manual_seed(2)).to(device=DEV, dtype=dtype)
    names = ["out", *(f"d entries[{n}]" for n in range(N)), "d key_norm_weight", "d query"]
    check_kernel_against_module(mix, entries, grad, dtype, names)


@needs_kernels
def test_module_dispatch_uses_the_kernel_when_asked():
    mix = make_mix(96)
    entries = make_entries(3, (2,), 96, torch.float32)
    ref = mix(entries)  # "auto": torch on the CPU, the kernel on CUDA
    mix.backend = "triton"
    assert rel_rms(ref, mix(entries)) < 2e-6
    direct = attnres_mix_forward(entries, mix.key_norm_weight, mix.query, mix.eps)
    assert torch.equal(mix(entries), direct)


@needs_kernels
def test_stacked_input_strided():
    # One [B, T, N, D] tensor, itself a strided view ([B, N, T, D] transposed): read in place, grad in its shape.
    mix = make_mix(96)
    base = torch.randn(2, 3, 4, 96, generator=torch.Generator().manual_seed(3)).to(DEV).requires_grad_()
    stacked = base.transpose(1, 2)  # [B, T, N, D] with T's stride > N's
    grad = torch.randn(2, 4, 96, generator=torch.Generator().manual_seed(4)).to(DEV)
    ref = reference(mix, list(stacked.unbind(-2)), grad)
    out = attnres_mix(stacked, mix.key_norm_weight, mix.query, mix.eps)
    d_stacked, d_kw, d_q = torch.autograd.grad(out, [stacked, mix.key_norm_weight, mix.query], grad)
    assert_matches(out, ref[0], torch.float32, "out")
    assert_matches(d_stacked, torch.stack(ref[1:4], dim=-2), torch.float32, "d stacked")
    assert_matches(d_kw, ref[4], torch.float32, "d key_norm_weight")
    assert_matches(d_q, ref[5], torch.float32, "d query")


@needs_kernels
def test_more_entries_than_the_pointer_tuple_takes():
    N = MAX_ENTRIES + 1  # stacked into one tensor first
    mix = make_mix(16)
    entries = make_entries(N, (2,), 16, torch.float32)
    grad = torch.randn(2, 16, generator=torch.Generator().manual_seed(5)).to(DEV)
    check_kernel_against_module(mix, entries, grad, torch.float32)


@needs_kernels
def test_mixed_entry_dtypes_bf16_params_and_strided_entries():
    # Entries of two dtypes (the module's torch.stack promotes them; the kernel reads each in its own), one of them
    # a column slice of a wider tensor (a row stride of 2 D), bf16 parameters (grads in bf16, from fp32 math).
    D = 96
    mix = make_mix(D, dtype=torch.bfloat16)
    wide = torch.randn(3, 2 * D, generator=torch.Generator().manual_seed(6)).to(DEV).requires_grad_()
    entries = [*make_entries(2, (3,), D, torch.bfloat16), wide[:, D:]]
    grad = torch.randn(3, D, generator=torch.Generator().manual_seed(7)).to(DEV)
    out = check_kernel_against_module(mix, entries, grad, torch.bfloat16)
    assert out.dtype == torch.float32  # the last entry's


@needs_kernels
def test_mixed_dtypes_with_as_many_rows_as_entries():
    """Three entries of 3 rows, the first fp32 and the rest bf16: the entries' grads come back from the [R, N, D]
    stack of the promoted dtype, whose shape is also an [N, R, D] one and whose dtype is the first entry's; each
    entry must still get its own rows."""
    D = 24
    mix = make_mix(D)
    entries = [*make_entries(1, (3,), D, torch.float32), *make_entries(2, (3,), D, torch.bfloat16, seed=9)]
    grad = torch.randn(3, D, generator=torch.Generator().manual_seed(8)).to(DEV, torch.bfloat16)
    check_kernel_against_module(mix, entries, grad, torch.bfloat16)


@needs_kernels
def test_no_rows():
    mix = make_mix(8)
    entries = make_entries(2, (0, 5), 8, torch.float32)
    out = attnres_mix(entries, mix.key_norm_weight, mix.query, mix.eps)
    assert out.shape == (0, 5, 8)
    d0, d1, dkw, dq = torch.autograd.grad(out.sum(), [*entries, mix.key_norm_weight, mix.query])
    assert d0.shape == (0, 5, 8) and torch.equal(dkw, torch.zeros(8, device=DEV)) and not dq.any()


@needs_kernels
def test_gradcheck_fp64():
    # The kernels compute in fp64 when an input is fp64, so gradcheck can compare the backward with finite
    # differences of the kernel's own forward.
    gen = torch.Generator().manual_seed(8)
    entries = [(torch.randn(2, 7, generator=gen, dtype=torch.float64) * (1 + n)).to(DEV).requires_grad_()
               for n in range(3)]
    kw = (1 + 0.3 * torch.randn(7, generator=gen, dtype=torch.float64)).to(DEV).requires_grad_()
    q = torch.randn(7, generator=gen, dtype=torch.float64).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda kw, q, *e: attnres_mix(list(e), kw, q, 1e-5), (kw, q, *entries),
                                    fast_mode=True)


@needs_kernels
def test_backward_programs_do_not_change_the_grads_beyond_rounding():
    mix = make_mix(96)   # rows of 96 (128 wide) are row blocks of 8: 24 rows, three blocks
    entries = make_entries(2, (24,), 96, torch.float32)
    grad = torch.randn(24, 96, generator=torch.Generator().manual_seed(9)).to(DEV)
    args = (entries, mix.key_norm_weight.detach(), mix.query.detach(), mix.eps, grad)
    d1, kw1, q1 = attnres_mix_backward(*args, programs=1)  # one program walks all three row blocks
    d3, kw3, q3 = attnres_mix_backward(*args, programs=3)
    assert all(torch.equal(a, b) for a, b in zip(d1, d3))  # per-row grads do not depend on G
    assert rel_rms(kw1, kw3) < 1e-6 and rel_rms(q1, q3) < 1e-6
    with pytest.raises(ValueError, match="programs"):
        attnres_mix_backward(*args, programs=0)


@needs_kernels
def test_row_chunks_past_the_rows_with_eps_zero():
    # 18 rows of D = 256 are 5 row blocks of 4 (the last one of 2 rows). programs=2: 2 programs of 3 blocks (the
    # last with 2 blocks and 1 past the rows); 3: 3 of 2 (the last with 1 and 1 past; row_chunks itself is tested in
    # test_glue_rmsnorm). The rows past R are loaded clamped to the last row, and with eps = 0 a zero row would give
    # r = inf: nothing of theirs may leak into dw.
    D = 256
    mix = make_mix(D)
    mix.eps = 0.0
    entries = make_entries(3, (18,), D, torch.float32)
    grad = torch.randn(18, D, generator=torch.Generator().manual_seed(11)).to(DEV)
    ref = reference(mix, entries, grad)
    args = ([e.detach() for e in entries], mix.key_norm_weight.detach(), mix.query.detach(), 0.0, grad)
    first = None
    for programs in (2, 3):
        d, dkw, dq = attnres_mix_backward(*args, programs=programs)
        for n in range(3):
            assert_matches(d[n], ref[1 + n], torch.float32, (programs, n))
        assert_matches(dkw, ref[4], torch.float32, (programs, "d key_norm_weight"))
        assert_matches(dq, ref[5], torch.float32, (programs, "d query"))
        if first is None:
            first = d
        assert all(torch.equal(a, b) for a, b in zip(first, d))  # per-row grads do not depend on G


@needs_kernels
def test_a_full_pointer_tuple_of_entries_with_different_row_strides():
    # MAX_ENTRIES listed entries of one dtype (the backward picks each pointer and row stride by a runtime index:
    # the longest chain), every other one a column slice of a tensor twice as wide.
    D = 16
    mix = make_mix(D)
    gen = torch.Generator().manual_seed(12)
    entries = []
    for n in range(MAX_ENTRIES):
        width = D * (1 + n % 2)
        wide = (torch.randn(3, width, generator=gen) * (0.5 + n / 4)).to(DEV, torch.bfloat16).requires_grad_()
        entries.append(wide[:, width - D:])
    grad = torch.randn(3, D, generator=gen).to(DEV, torch.bfloat16)
    check_kernel_against_module(mix, entries, grad, torch.bfloat16)


@needs_kernels
def test_grad_out_of_another_dtype_listed_and_stacked():
    # An fp32 grad_out for bf16 entries: the backward's tiles (g's and the entries') share one pointer pick, so the
    # entries and g are stacked in fp32 first; the grads come back in bf16, the same for a list and a stack.
    D = 96
    mix = make_mix(D)
    entries = [e.detach() for e in make_entries(3, (5,), D, torch.bfloat16)]
    grad = torch.randn(5, D, generator=torch.Generator().manual_seed(13)).to(DEV)
    ref = reference(mix, [e.float().requires_grad_() for e in entries], grad)  # fp32 math on the same values
    kw, q = mix.key_norm_weight.detach(), mix.query.detach()
    d, dkw, dq = attnres_mix_backward(entries, kw, q, mix.eps, grad)
    d_stacked, dkw_s, dq_s = attnres_mix_backward(torch.stack(entries, -2), kw, q, mix.eps, grad)
    assert d_stacked.dtype == torch.bfloat16 and torch.equal(dkw, dkw_s) and torch.equal(dq, dq_s)
    for n in range(3):
        assert torch.equal(d[n], d_stacked[..., n, :])
        assert_matches(d[n], ref[1 + n].to(torch.bfloat16), torch.bfloat16, n)
    assert_matches(dkw, ref[4], torch.float32, "d key_norm_weight")
    assert_matches(dq, ref[5], torch.float32, "d query")


def test_backend_choice():
    x = torch.zeros(2, 8)
    assert glue_backend(x) == "torch"  # CPU tensors stay on torch under "auto", interpreter or not
    assert glue_backend(x, "torch") == "torch"
    assert glue_backend(x, "AUTO") == "torch"
    with pytest.raises(ValueError, match="backend"):
        glue_backend(x, "cuda")
    if HAS_KERNELS and not ON_GPU:
        assert glue_backend(x, "triton") == "triton"  # the interpreter runs them on the CPU
    if importlib.util.find_spec("triton") is not None:  # "auto" on CUDA: the kernels, up to MAX_WIDTH
        assert glue_backend(types.SimpleNamespace(is_cuda=True, ndim=2, shape=(3, MAX_WIDTH))) == "triton"
        assert glue_backend(types.SimpleNamespace(is_cuda=True, ndim=2, shape=(3, MAX_WIDTH + 1))) == "torch"


def test_module_auto_on_cpu_keeps_the_torch_code(monkeypatch):
    import kimik3.model.attnres as module

    def boom(*a, **k):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(module, "attnres_mix", boom)
    mix = AttnResMix(8)
    torch.nn.init.normal_(mix.key_norm_weight)
    torch.nn.init.normal_(mix.query)
    mix([torch.randn(2, 8), torch.randn(2, 8)])


@needs_kernels
def test_bad_inputs_are_named():
    kw, q = torch.ones(8, device=DEV), torch.zeros(8, device=DEV)
    x = torch.randn(2, 8, device=DEV)
    cases = [
        (([], kw, q, 1e-5), "non-empty list"),
        ((torch.randn(8, device=DEV), kw, q, 1e-5), r"\[\.\.\., N, D\]"),  # a stack needs 2 dims at least
        (([x, torch.randn(3, 8, device=DEV)], kw, q, 1e-5), "shape"),
        (([x, x.long()], kw, q, 1e-5), "entries\\[1\\]"),
        (([x], torch.ones(7, device=DEV), q, 1e-5), "key_norm_weight"),
        (([x], kw, q[None], 1e-5), "query"),
        (([x], kw, q, torch.tensor(1e-5)), "eps"),
        (([x], kw, q, -1.0), "eps"),
        (([torch.randn(1, MAX_WIDTH + 1, device=DEV)], torch.ones(MAX_WIDTH + 1, device=DEV),
          torch.ones(MAX_WIDTH + 1, device=DEV), 1e-5), "widths"),
        (([x], kw.to("meta"), q, 1e-5), "key_norm_weight is on meta"),
        (("x", kw, q, 1e-5), "list of tensors"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            attnres_mix_forward(*args)
    with pytest.raises(ValueError, match="list of tensors"):
        attnres_mix("x", kw, q, 1e-5)
    with pytest.raises(ValueError, match="grad_out"):
        attnres_mix_backward([x], kw, q, 1e-5, torch.zeros(3, 8, device=DEV))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    # No host sync on the launch path: a captured mix replays on new entry values (the decode step's use).
    mix = make_mix(1024, dtype=torch.bfloat16)
    entries = [e.detach() for e in make_entries(4, (8,), 1024, torch.bfloat16)]
    with torch.inference_mode():
        attnres_mix(entries, mix.key_norm_weight, mix.query, mix.eps)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attnres_mix(entries, mix.key_norm_weight, mix.query, mix.eps)
        for e in entries:
            e.copy_(torch.randn_like(e))
        graph.replay()
        mix.backend = "torch"
        ref = mix(entries)
    assert_matches(out, ref, torch.bfloat16, "replayed out")


def make_norm(D, seed=5, dtype=torch.float32) -> RMSNorm:
    norm = RMSNorm(D)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=torch.Generator().manual_seed(seed)))
    return norm.to(device=DEV, dtype=dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,lead,D", [(1, (3,), 96), (3, (2, 5), 200), (5, (130,), 64)])
def test_mix_with_its_norm_in_one_kernel(dtype, N, lead, D):
    # The fused forward against the mix kernel then the norm kernel (the same fp32 math and the same rounding of
    # the mix to the entries' dtype between them: equal up to the reduction order), and against the torch modules.
    mix, norm = make_mix(D, seed=N, dtype=dtype), make_norm(D, dtype=dtype)
    entries = [e.detach() for e in make_entries(N, lead, D, dtype, seed=N + 1)]
    with torch.no_grad():
        got = attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps)
        two = rms_norm(attnres_mix_forward(entries, mix.key_norm_weight, mix.query, mix.eps), norm.weight, norm.eps)
        mix.backend = norm.backend = "torch"
        ref = norm(mix(entries))
    assert got.shape == (*lead, D) and got.dtype == dtype
    if ON_GPU:
        assert_matches(got, two, dtype, "fused against the two kernels")
    else:
        assert torch.equal(got, two)
    assert_matches(got, ref, dtype, "fused against the torch modules")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,lead,D", [(1, (3,), 96), (3, (2, 5), 200)])
def test_mix_with_its_norm_after_the_add_in_one_kernel(dtype, N, lead, D):
    # The running sum's add in the same launch: its sum rounded as torch's add (bit-equal), then the mix and the
    # norm as the kernel without it computes them from that sum. The addend a column slice (rows strided).
    mix, norm = make_mix(D, seed=N, dtype=dtype), make_norm(D, dtype=dtype)
    entries = [e.detach() for e in make_entries(N, lead, D, dtype, seed=N + 3)]
    wide = torch.randn(*lead, D + 7, generator=torch.Generator().manual_seed(N)).to(device=DEV, dtype=dtype)
    h = wide[..., 3:3 + D]
    with torch.no_grad():
        got, total = attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps,
                                      addend=h)
        want_total = entries[-1] + h
        want = attnres_mix_norm(entries[:-1] + [want_total], mix.key_norm_weight, mix.query, mix.eps, norm.weight,
                                norm.eps)
    assert torch.equal(total, want_total) and torch.equal(got, want)


@needs_kernels
def test_mix_with_its_norm_after_the_add_checked_and_beyond_the_pointer_tuple():
    from kimik3.ops.glue.attnres import MAX_ENTRIES

    D = 32
    mix, norm = make_mix(D), make_norm(D)
    entries = [e.detach() for e in make_entries(MAX_ENTRIES + 1, (2,), D, torch.float32)]
    h = torch.randn(2, D, generator=torch.Generator().manual_seed(9)).to(DEV)
    args = (mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps)
    with torch.no_grad():
        got, total = attnres_mix_norm(entries, *args, addend=h)   # stacked: the sum made first
        assert torch.equal(total, entries[-1] + h)
        assert torch.equal(got, attnres_mix_norm(entries[:-1] + [total], *args))
        with pytest.raises(ValueError, match="addend must match the last entry"):
            attnres_mix_norm(entries[:3], *args, addend=h[:1])
        with pytest.raises(ValueError, match="addend must match the last entry"):
            attnres_mix_norm(entries[:3], *args, addend=h.double())
        with pytest.raises(ValueError, match="not a stacked tensor"):
            attnres_mix_norm(torch.stack(entries[:3], -2), *args, addend=h)
    with pytest.raises(RuntimeError, match="forward only"):
        attnres_mix_norm(entries[:3], *args, addend=h.requires_grad_())


@needs_kernels
def test_the_block_fuses_the_add_with_the_pair_only_without_gradients(monkeypatch):
    # added_mixed_and_normed: one kernel for the add, the mix and the norm under no_grad when the modules take the
    # kernels; the add and the two modules when a gradient is needed or a module keeps its torch code.
    import kimik3.model.attnres as attnres_module
    calls = []
    real = attnres_module.attnres_mix_norm
    monkeypatch.setattr(attnres_module, "attnres_mix_norm",
                        lambda *a, **kw: calls.append(sorted(kw)) or real(*a, **kw))
    D = 64
    mix, norm = make_mix(D), make_norm(D)
    mix.backend = norm.backend = "triton"
    entries = [e.detach() for e in make_entries(3, (3,), D, torch.float32)]
    prefix, h = entries[-1], torch.randn(3, D, generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.no_grad():
        fused, total = added_mixed_and_normed(mix, norm, entries[:-1], prefix, h)
    assert calls == [["addend"]]
    separate, separate_total = added_mixed_and_normed(mix, norm, entries[:-1], prefix, h)   # parameters need grad
    assert calls == [["addend"]] and separate.requires_grad
    assert torch.equal(total, separate_total)
    assert_matches(fused, separate.detach(), torch.float32, "fused against the add and the modules' kernels")
    norm.backend = "torch"
    with torch.no_grad():
        _, total = added_mixed_and_normed(mix, norm, entries[:-1], prefix, h)
    assert calls == [["addend"]] and torch.equal(total, prefix + h)


@needs_kernels
def test_mix_with_its_norm_stacked_and_checked():
    D = 48
    mix, norm = make_mix(D), make_norm(D)
    entries = [e.detach() for e in make_entries(3, (4,), D, torch.float32)]
    with torch.no_grad():
        listed = attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps)
        stacked = attnres_mix_norm(torch.stack(entries, -2), mix.key_norm_weight, mix.query, mix.eps, norm.weight,
                                   norm.eps)
        assert torch.equal(listed, stacked)
        with pytest.raises(ValueError, match=r"norm_weight must be a 1-D tensor \[D=48\]"):
            attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight[:40], norm.eps)
        with pytest.raises(ValueError, match="eps must be a finite Python number"):
            attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight, -1.0)
    with pytest.raises(RuntimeError, match="attnres_mix_norm is forward only"):
        attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps)


@needs_kernels
def test_the_block_fuses_the_pair_only_without_gradients(monkeypatch):
    # mixed_and_normed: the fused kernel under no_grad when both modules take the kernels; the two modules when a
    # gradient is needed (training) or either module keeps its torch code.
    import kimik3.model.attnres as attnres_module
    calls = []
    real = attnres_module.attnres_mix_norm
    monkeypatch.setattr(attnres_module, "attnres_mix_norm", lambda *a: calls.append(1) or real(*a))
    D = 64
    mix, norm = make_mix(D), make_norm(D)
    mix.backend = norm.backend = "triton"
    entries = [e.detach() for e in make_entries(2, (3,), D, torch.float32)]
    with torch.no_grad():
        fused = mixed_and_normed(mix, norm, entries)
    assert calls == [1]
    separate = mixed_and_normed(mix, norm, entries)   # grad mode on and the parameters require grad
    assert calls == [1] and separate.requires_grad
    assert_matches(fused, separate.detach(), torch.float32, "fused against the modules' kernels")
    norm.backend = "torch"
    with torch.no_grad():
        mixed_and_normed(mix, norm, entries)
    assert calls == [1]


@needs_kernels
def test_a_models_forward_with_the_fused_adds_equals_the_torch_modules(monkeypatch):
    # The tiny model with its AttnRes mixes and RMSNorms on the kernels, under no_grad: every block that does not
    # open an AttnRes block takes its running sum's add, the FFN's mix and its norm in one launch
    # (``added_mixed_and_normed``); against the torch modules.
    import kimik3.model.attnres as attnres_module
    from kimik3 import K3Config, K3ForCausalLM

    added = []
    real = attnres_module.attnres_mix_norm
    monkeypatch.setattr(attnres_module, "attnres_mix_norm",
                        lambda *a, **kw: added.append("addend" in kw) or real(*a, **kw))

    config = K3Config.preset("tiny")
    model = K3ForCausalLM(config, seed=0).to(DEV).eval()
    ids = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).to(DEV)

    def forward(backend):
        for module in model.modules():
            if isinstance(module, (AttnResMix, RMSNorm)):
                module.backend = backend
        with torch.no_grad():
            return model(ids).logits

    got, ref = forward("triton"), forward("torch")
    assert rel_rms(ref, got) < 1e-5, rel_rms(ref, got)
    assert added.count(True) == sum(not spec.opens_block for spec in config.layer_plan()) > 0
