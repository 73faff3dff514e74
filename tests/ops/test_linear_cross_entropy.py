"""Tests of kimik3/ops/loss: ``linear_cross_entropy`` (token chunks, grads computed in the forward) against the plain
formula ``F.cross_entropy(F.linear(h, W).float(), labels)``.

- fp32 (tight) and bf16 (loose): loss and both grads, mean and sum, with ignored rows, grad_output 3, token counts
  not a multiple of the chunk, chunks of 1, fewer tokens than a chunk, odd vocabularies;
- all rows ignored (mean nan with zero grads, sum 0, as torch), a weight shared with an embedding (grads add up),
  only one input requiring grad, the no-grad path (no gradient work), autocast, fp64 gradcheck, the argument errors;
- the Triton chunk kernel (under the interpreter on CPU) against the torch chunk path, several blocks a row;
- the model: a tiny K3 (with MTP, head tied or not) and the dense baseline give the loss and every gradient of the
  old formula (logits materialised, computed here by hand), with several chunks.

Legend: N tokens, D width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.baseline import DenseGPT, dense_baseline_for
from kimik3.model.k3 import IGNORE_INDEX
from kimik3.ops.loss import default_chunk_tokens, linear_cross_entropy, linear_cross_entropy_reference
from kimik3.ops.loss.ce_chunk import ce_chunk
from tests.kernel_testing import DEV, interpreter_setup, needs_kernels  # noqa: F401 (interpreter_setup: autouse)
from tests.numerics import rel_rms

# The module (its name is also the function's, which the package exports: ``import ... as`` would give the function).
lce_module = importlib.import_module("kimik3.ops.loss.linear_cross_entropy")


def make_inputs(N, D, V, dtype=torch.float32, ignored=(), seed=0, lead=None):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*(lead or (N,)), D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * D ** -0.5 * 2   # logits of O(2): a softmax far from uniform
    labels = torch.randint(0, V, hidden.shape[:-1], generator=gen)
    labels.view(-1)[list(ignored)] = IGNORE_INDEX
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels


def loss_and_grads(fn, hidden, weight, labels, **kw):
    loss = fn(hidden, weight, labels, **kw)
    return (loss, *torch.autograd.grad(loss * 3, [hidden, weight]))   # grad_output 3, not 1


CASES = [  # N, D, V, chunk_tokens, ignored rows
    (10, 16, 37, 4, (0, 5)),       # N not a multiple of the chunk
    (7, 8, 33, 1, (6,)),           # chunks of one token
    (3, 16, 101, 16, ()),          # fewer tokens than a chunk
    (12, 24, 64, 12, (1, 2, 3)),   # one chunk exactly
    (9, 16, 37, None, (4,)),       # the default chunk
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("N,D,V,chunk,ignored", CASES)
def test_fp32_matches_the_formula(N, D, V, chunk, ignored, reduction):
    inputs = make_inputs(N, D, V, ignored=ignored)
    got = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=chunk, reduction=reduction)
    want = loss_and_grads(linear_cross_entropy_reference, *inputs, reduction=reduction)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for g, w, name in zip(got[1:], want[1:], ("dhidden", "dweight")):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert rel_rms(w, g) < 1e-6, (name, rel_rms(w, g))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_matches_the_formula(reduction):
    inputs = make_inputs(2 * 13, 32, 77, torch.bfloat16, ignored=(3, 20), lead=(2, 13))
    got = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=5, reduction=reduction)
    want = loss_and_grads(linear_cross_entropy_reference, *inputs, reduction=reduction)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)   # the same bf16 logits, then fp32 alike
    for g, w, name in zip(got[1:], want[1:], ("dhidden", "dweight")):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape, name
        assert rel_rms(w, g) < 1e-2, (name, rel_rms(w, g))   # bf16 roundings of dz and of the products


def test_all_rows_ignored_is_what_torch_gives():
    for reduction in ("mean", "sum"):
        inputs = make_inputs(6, 8, 11, ignored=range(6))
        got = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=4, reduction=reduction)
        want = loss_and_grads(linear_cross_entropy_reference, *inputs, reduction=reduction)
        torch.testing.assert_close(got[0], want[0], equal_nan=True)       # mean: nan (0 / 0); sum: 0
        assert bool(got[0].isnan()) == (reduction == "mean")
        for g, w in zip(got[1:], want[1:]):
            assert not g.any() and not w.any()                          # zero grads either way


def test_no_tokens():
    hidden, weight, labels = make_inputs(0, 8, 11)
    loss = linear_cross_entropy(hidden, weight, labels, reduction="sum")
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    assert float(loss.detach()) == 0 and dh.shape == (0, 8) and not dw.any()


def test_other_ignore_index():
    hidden, weight, labels = make_inputs(8, 8, 11, seed=3)
    labels[::3] = 0
    got = loss_and_grads(linear_cross_entropy, hidden, weight, labels, ignore_index=0, chunk_tokens=3)
    want = loss_and_grads(linear_cross_entropy_reference, hidden, weight, labels, ignore_index=0)
    for g, w in zip(got, want):
        assert rel_rms(w, g) < 1e-6


def test_weight_shared_with_an_embedding_accumulates():
    """A tied head: the weight's grad is the embedding lookup's plus the head's."""
    torch.manual_seed(0)
    ids = torch.randint(0, 29, (2, 9))
    labels = ids.roll(-1, 1)
    labels[0, -1] = IGNORE_INDEX

    def grads(fn):
        embed = torch.nn.Embedding(29, 16)
        with torch.no_grad():
            embed.weight.copy_(torch.randn(29, 16, generator=torch.Generator().manual_seed(1)))
        hidden = torch.tanh(embed(ids))
        loss = fn(hidden, embed.weight, labels, **({"chunk_tokens": 4} if fn is linear_cross_entropy else {}))
        loss.backward()
        return loss, embed.weight.grad

    got, want = grads(linear_cross_entropy), grads(linear_cross_entropy_reference)
    torch.testing.assert_close(got[0], want[0])
    assert rel_rms(want[1], got[1]) < 1e-6


def test_one_input_requiring_grad():
    hidden, weight, labels = make_inputs(9, 8, 13, ignored=(2,))
    for frozen in (hidden, weight):
        frozen.requires_grad_(False)
        other = weight if frozen is hidden else hidden
        got = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk_tokens=4), other)[0]
        want = torch.autograd.grad(linear_cross_entropy_reference(hidden, weight, labels), other)[0]
        assert rel_rms(want, got) < 1e-6
        frozen.requires_grad_(True)


def test_no_grad_path_does_no_gradient_work(monkeypatch):
    hidden, weight, labels = make_inputs(9, 8, 13, ignored=(2,))
    want = linear_cross_entropy_reference(hidden, weight, labels)

    def boom(*args, **kwargs):
        raise AssertionError("gradient work without grad")

    monkeypatch.setattr(lce_module, "_accumulate", boom)
    calls = []
    original = lce_module._chunk_torch
    monkeypatch.setattr(lce_module, "_chunk_torch", lambda *a: calls.append(a[3]) or original(*a))
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    plain = linear_cross_entropy(hidden.detach(), weight.detach(), labels, chunk_tokens=4)
    for loss in (got, plain):
        assert loss.grad_fn is None and not loss.requires_grad
        torch.testing.assert_close(loss, want.detach())
    assert len(calls) == 6 and all(row_scale is None for row_scale in calls)   # 3 chunks each, no gradient


def test_autocast_computes_in_its_dtype():
    hidden, weight, labels = make_inputs(10, 16, 37, ignored=(1,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_tokens=3)
        want = loss_and_grads(linear_cross_entropy_reference, hidden, weight, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert rel_rms(want[0], linear_cross_entropy_reference(hidden, weight, labels)) > 1e-5   # bf16 did happen
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == torch.float32 and rel_rms(w, g) < 1e-2


def test_gradcheck_fp64():
    hidden, weight, labels = make_inputs(5, 4, 7, torch.float64, ignored=(3,))
    for reduction in ("mean", "sum"):
        assert torch.autograd.gradcheck(
            lambda h, w: linear_cross_entropy(h, w, labels, chunk_tokens=2, reduction=reduction), (hidden, weight))


def test_default_chunk_tokens():
    assert default_chunk_tokens(163_840, "cuda") == 2048          # 1.34 GB of fp32 logits
    assert default_chunk_tokens(163_840, "cpu") == 64             # the floor (4 MiB would hold 6 rows)
    assert default_chunk_tokens(4096, "cpu") == 256               # 4 MiB of fp32 logits
    assert default_chunk_tokens(8, "cpu") == 1 << 17
    assert default_chunk_tokens(10 ** 12, "cuda") == 1
    for vocab in (1, 1000, 32_000, 163_840, 200_000):   # a power of two of tokens, fp32 logits in (1, 2] GiB
        chunk = default_chunk_tokens(vocab, "cuda")
        budget = lce_module.GPU_CHUNK_BYTES
        assert chunk & (chunk - 1) == 0 and budget // 2 < 4 * vocab * chunk <= budget, vocab


def test_bad_arguments_are_named():
    hidden, weight, labels = make_inputs(4, 8, 11)
    cases = [
        ((hidden, weight, labels[:3]), {}, "labels shape"),
        ((hidden, weight[:, :7], labels), {}, "same D"),
        ((hidden, weight, labels.float()), {}, "integer"),
        ((hidden.long(), weight, labels), {}, "hidden must be a floating"),
        ((hidden, weight.double(), labels), {}, "share a dtype"),
        ((hidden, weight, labels), {"reduction": "none"}, "reduction"),
        ((hidden, weight, labels), {"chunk_tokens": 0}, "chunk_tokens"),
        ((hidden, weight, labels), {"backend": "fast"}, "backend"),
        ((hidden, weight, labels.to("meta")), {}, "share a device"),
        ((hidden, weight, torch.tensor([0, 11, 2, 3])), {}, r"\[0, 11\).*got 11"),
        ((hidden, weight, torch.tensor([0, -1, 2, 3])), {}, "got -1"),
        ((hidden, weight, torch.tensor([0, -100, 2, 3])), {"ignore_index": -1}, "got -100"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            linear_cross_entropy(*args, **kwargs)


# ------------------------------------------------------------------ the Triton chunk kernel


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_kernel_matches_the_torch_chunk(dtype, grad):
    """Several blocks a row (block 8 over V = 37: the last one partial), ignored rows, a mean's scale."""
    gen = torch.Generator().manual_seed(5)
    z = (torch.randn(6, 37, generator=gen) * 3).to(device=DEV, dtype=dtype)
    labels = torch.randint(0, 37, (6,), generator=gen).to(DEV)
    labels[[1, 4]] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    scale = torch.tensor(1 / 4, device=DEV)
    ref_loss, ref_dz = lce_module._chunk_torch(z.clone(), torch.where(valid, labels, 0), valid,
                                               torch.where(valid, scale, 0.0) if grad else None, torch.float32)
    got_z = z.clone()
    loss = ce_chunk(got_z, labels, IGNORE_INDEX, scale, grad, block_v=8)
    assert rel_rms(ref_loss, loss) < 1e-6 and not loss[[1, 4]].any()
    if grad:
        assert rel_rms(ref_dz, got_z) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert not got_z[[1, 4]].any()
    else:
        assert torch.equal(got_z, z)                                   # logits untouched without grad


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_matches_the_torch_backend(dtype, monkeypatch):
    monkeypatch.setattr("kimik3.ops.loss.ce_chunk.BLOCK_V", 16)      # 3 blocks a row of V = 37
    inputs = [x.to(DEV) if i == 2 else x.detach().to(DEV).requires_grad_()
              for i, x in enumerate(make_inputs(11, 16, 37, dtype, ignored=(0, 7)))]
    for reduction in ("mean", "sum"):
        got = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=4, reduction=reduction, backend="triton")
        want = loss_and_grads(linear_cross_entropy, *inputs, chunk_tokens=4, reduction=reduction, backend="torch")
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        for g, w in zip(got[1:], want[1:]):
            assert g.dtype == w.dtype and rel_rms(w, g) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_triton_backend_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr("kimik3.ops.glue.common.interpreted", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        linear_cross_entropy(*make_inputs(4, 8, 11), backend="triton")


# ------------------------------------------------------------------ the models


def old_k3_loss(model, ids, labels):
    """The formula before issue 39: logits [B, T, V] materialised, then fp32 cross-entropies (main and MTP)."""
    out = model(ids)
    main = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    length = ids.shape[1] - 1
    known = labels[:, :length]
    targets = labels[:, 1:].masked_fill(known == IGNORE_INDEX, IGNORE_INDEX)
    mtp_hidden = model.mtp(out.hidden[:, :length], model.embed(known.clamp(min=0)), None)
    mtp = F.cross_entropy(model.head(mtp_hidden).flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
    return main + model.config.mtp.loss_weight * mtp, main, mtp


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("tied", [False, True])
def test_k3_loss_and_grads_equal_the_old_formula(tied, monkeypatch):
    monkeypatch.setattr(lce_module, "CPU_CHUNK_BYTES", 16 * 4 * 4096)   # 16-token chunks: several a call
    monkeypatch.setattr(lce_module, "CPU_MIN_CHUNK_TOKENS", 1)
    config = dataclasses.replace(K3Config.preset("tiny"), tie_embeddings=tied)
    model = K3ForCausalLM(config, seed=0).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 21), generator=gen)
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, 5:8] = IGNORE_INDEX
    out = model(ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    got = _grads(model)
    loss, main, mtp = old_k3_loss(model, ids, labels)
    loss.backward()
    want = _grads(model)
    for a, b in ((out.loss, loss), (out.main_loss, main), (out.mtp_loss, mtp)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    flat = lambda grads: torch.cat([grads[n].flatten() for n in sorted(grads)])   # noqa: E731
    assert rel_rms(flat(want), flat(got)) < 2e-6
    # Per parameter: rounding level. The AttnRes queries start at zero and their grads are sums that cancel: the old
    # formula itself moves them by ~5e-5 when its mean is taken as sum / n instead.
    worst = max((rel_rms(want[n], got[n]), n) for n in want if want[n].any())
    assert worst[0] < 2e-4, worst


def test_dense_baseline_loss_and_grads_equal_the_old_formula():
    config = dataclasses.replace(dense_baseline_for(K3Config.preset("tiny")), num_layers=2)
    model = DenseGPT(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    out = model(ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    got = _grads(model)
    old = F.cross_entropy(model(ids).logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    old.backward()
    want = _grads(model)
    torch.testing.assert_close(out.loss, old)
    assert max(rel_rms(want[n], got[n]) for n in want) < 1e-5
