"""The fused training kernels as custom operators (``kimik3::...``): each pair of forward and backward operators
passes ``torch.library.opcheck`` (schema, fake shapes and dtypes, autograd registration), and each public function
compiled with ``fullgraph=True`` (a graph break fails) gives eager's output and gradients bit for bit, with a
graph of one call of it: the condition for torch.compile to take a block of the model in one graph.

The KDA chunk operators are tested the same way in tests/ops/test_kda_triton.py. Without CUDA the kernels run under
the Triton interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import sys

import pytest
import torch

from kimik3.ops.glue import attnres_mix, rms_norm
from kimik3.ops.glue.attnres import MAX_ENTRIES
from kimik3.ops.glue.causal_conv import causal_conv
from kimik3.ops.glue.gated_norm import gated_rms_norm
from kimik3.ops.glue.situ import situ_glu
from kimik3.ops.moe.route import sigmoid_topk
from tests.kernel_testing import DEV, interpreter_setup, needs_kernels  # noqa: F401 (interpreter_setup: autouse)

OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _inputs(*shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype).requires_grad_() for shape in shapes]


def _cases():
    """(name, function, inputs, extra arguments): K3's calls of each kernel at small shapes."""
    x, w = _inputs((2, 5, 24), (24,))
    o, gate, gw = _inputs((2, 3, 4, 16), (2, 3, 64), (16,), dtype=torch.float32, seed=1)
    g, u, rw = _inputs((7, 40), (7, 40), (7,), seed=2)
    entries = _inputs((3, 24), (3, 24), (3, 24), seed=3)
    kw, q = _inputs((24,), (24,), seed=4)
    cx, cw1, cw2, cstate = _inputs((1, 9, 12), (8, 4), (4, 4), (1, 12, 3), seed=5)
    logits, = _inputs((6, 8), seed=6)
    many = _inputs(*[(3, 24)] * (MAX_ENTRIES + 1), seed=7)
    half, = _inputs((3, 24), dtype=torch.bfloat16, seed=8)
    bias = torch.zeros(8, device=DEV)
    return [
        ("rms_norm", lambda x, w: rms_norm(x, w, 1e-5), [x, w]),
        ("gated_rms_norm", lambda o, gate, gw: gated_rms_norm(o, gate, gw, 1e-5, torch.bfloat16), [o, gate, gw]),
        ("situ_glu", lambda g, u, rw: situ_glu(g, u, rw), [g, u, rw]),
        ("attnres_mix", lambda a, b, c, kw, q: attnres_mix([a, b, c], kw, q, 1e-6), [*entries, kw, q]),
        # more entries than the kernel's pointer tuple, and entries of two dtypes: the backward reads them stacked
        ("attnres_mix:many", lambda kw, q, *es: attnres_mix(list(es), kw, q, 1e-6), [kw, q, *many]),
        ("attnres_mix:mixed", lambda a, b, kw, q: attnres_mix([a, b], kw, q, 1e-6), [entries[0], half, kw, q]),
        ("causal_conv", lambda x, w1, w2, s: causal_conv(x, (w1, w2), s)[0], [cx, cw1, cw2, cstate]),
        ("sigmoid_topk", lambda lg: sigmoid_topk(lg, bias, 3, 2.5)[0], [logits]),
    ]


@needs_kernels
@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_the_operators_pass_opcheck(name):
    _, fn, inputs = next(c for c in _cases() if c[0] == name)
    name = name.split(":")[0]   # the operator's
    calls = []
    real = torch.library.opcheck

    def record(op):   # the forward operator the public function calls, with its arguments
        def run(*args):
            calls.append(args)
            return op(*args)
        return run

    op = getattr(torch.ops.kimik3, name).default
    module = sys.modules[{"rms_norm": "kimik3.ops.glue.rmsnorm", "gated_rms_norm": "kimik3.ops.glue.gated_norm",
                          "situ_glu": "kimik3.ops.glue.situ", "attnres_mix": "kimik3.ops.glue.attnres",
                          "causal_conv": "kimik3.ops.glue.causal_conv", "sigmoid_topk": "kimik3.ops.moe.route"}[name]]
    attr = f"_{name}_op"
    original = getattr(module, attr)
    setattr(module, attr, record(original))
    try:
        out = fn(*inputs)
    finally:
        setattr(module, attr, original)
    assert len(calls) == 1, "the public function goes through its operator when a gradient is needed"
    real(op, calls[0], test_utils=OPCHECKS)
    # the backward operator, on the forward's saved inputs and a gradient of the output
    backward = getattr(torch.ops.kimik3, f"{name}_backward", None)
    if backward is not None:
        bwd_attr = f"_{name}_backward_op"
        original = getattr(module, bwd_attr)
        setattr(module, bwd_attr, record(original))
        calls.clear()
        try:
            (out.float() * torch.randn_like(out.float())).sum().backward()
        finally:
            setattr(module, bwd_attr, original)
        captured = calls
        assert len(captured) == 1
        real(backward.default, captured[0], test_utils=("test_schema", "test_faketensor"))


@needs_kernels
@pytest.mark.parametrize("name", [c[0] for c in _cases()])
def test_compiled_in_one_graph_with_eager_results(name):
    _, fn, inputs = next(c for c in _cases() if c[0] == name)

    def loss(*xs):
        return (fn(*xs).float().square()).sum()

    explained = torch._dynamo.explain(loss)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    results = []
    for run in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        value = run(*xs)
        results.append([value, *torch.autograd.grad(value, xs)])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
