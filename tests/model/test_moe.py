import pytest
import torch

from kimik3 import K3Config
from kimik3.model.ffn import situ_glu
from kimik3.model.moe import LatentMoE, Router, RoutingRecord, router_logits
from kimik3.ops.moe import grouped_mm, grouped_mm_loop


def _moe(seed=0, **moe_changes):
    torch.manual_seed(seed)
    config = K3Config.preset("tiny")
    moe = LatentMoE(config)
    for name, p in moe.named_parameters():
        torch.nn.init.normal_(p, std=0.2) if p.ndim > 1 else torch.nn.init.normal_(p, mean=1.0, std=0.1)
    return config, moe


def test_bias_changes_selection_never_the_mixture_weights():
    torch.manual_seed(0)
    router = Router(dim=8, num_experts=6, top_k=2)
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(50, 8)
    scores = torch.sigmoid(x @ router.gate.weight.T)
    for trial in range(4):
        router.expert_bias.copy_(torch.randn(6) * (0 if trial == 0 else 0.5))
        weights, ids, _ = router(x)
        chosen = scores.gather(-1, ids)
        torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
        # the chosen experts are the top-k of the *biased* scores
        biased = scores + router.expert_bias
        assert torch.equal(ids.sort(-1).values, biased.topk(2, -1).indices.sort(-1).values)
    router.expert_bias.zero_()
    router.expert_bias[3] = 10.0  # a large bias forces expert 3 into every selection
    weights, ids, counts = router(x)
    assert (ids == 3).any(-1).all()
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=counts.shape[0]))
    chosen = scores.gather(-1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))


def test_router_stats_loads_and_margins():
    torch.manual_seed(1)
    router = Router(dim=8, num_experts=6, top_k=2)
    torch.nn.init.normal_(router.gate.weight)
    router.record_scores = True
    x = torch.randn(40, 8)
    with RoutingRecord() as record:
        _, ids, _ = router(x)
    (stats,) = record.stats([router])
    assert stats.loads_E.sum() == 40 * 2
    assert torch.equal(stats.loads_E, torch.bincount(ids.flatten(), minlength=6))
    assert torch.equal(stats.ids_TK, ids)
    biased = stats.scores_TE + router.expert_bias
    chosen_min = biased.gather(-1, ids).min(-1).values
    assert (chosen_min >= stats.cutoff_T).all()              # chosen experts beat the cutoff
    assert torch.allclose(stats.cutoff_T, biased.topk(3, -1).values[:, 2])
    stats.drop_scores()
    assert stats.scores_TE is None and stats.cutoff_T is None and stats.ids_TK is None


def test_routing_record_scope_merges_calls_and_keeps_scores_for_training_only():
    torch.manual_seed(2)
    router, other = Router(dim=8, num_experts=6, top_k=2), Router(dim=8, num_experts=6, top_k=2)
    router.record_scores = True
    x = torch.randn(30, 8)
    router(x)   # no record open: nothing is kept anywhere
    with RoutingRecord() as outer:
        router(x[:10])
        with RoutingRecord() as inner:
            router(x)
        router(x[10:])
    merged, missing = outer.stats([router, other])
    assert missing is None
    (alone,) = inner.stats([router])
    assert torch.equal(merged.loads_E, alone.loads_E)                     # 10 + 20 tokens, merged
    # (a matmul over 10 or 20 rows need not round as over 30: the scores are close, not bitwise equal)
    torch.testing.assert_close(merged.scores_TE, alone.scores_TE)
    assert torch.equal(merged.ids_TK, alone.ids_TK)
    router.eval()
    with RoutingRecord() as record:
        router(x)
    (stats,) = record.stats([router])
    assert torch.equal(stats.loads_E, alone.loads_E) and stats.scores_TE is None   # eval: loads only
    router.train()
    router.record_scores = False
    with RoutingRecord() as record:
        router(x)
    assert record.stats([router])[0].scores_TE is None


def test_compiled_routers_report_to_the_record_in_one_graph_without_recompiling():
    """Routers compiled with fullgraph=True (the record's context variable is read by the report torch.compile runs
    after the graph): three routers of one code share one graph across steps (a recompilation fails), each step's
    record gets each router's loads and scores, as eagerly; a deep copy reports as a router of its own."""
    import copy

    torch.manual_seed(0)
    routers = [Router(dim=8, num_experts=6, top_k=2) for _ in range(3)]
    for router in routers:
        router.record_scores = True
    compiled = [torch.compile(r, backend="aot_eager", fullgraph=True) for r in routers]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            x = torch.randn(10, 8, requires_grad=True)
            with RoutingRecord() as record:
                outs = [c(x) for c in compiled]
            with RoutingRecord() as eager:
                expected = [r(x) for r in routers]
            for got, want, (weights, ids, counts) in zip(record.stats(routers), eager.stats(routers), outs):
                assert torch.equal(got.loads_E, want.loads_E) and torch.equal(got.loads_E, counts)
                assert torch.equal(got.ids_TK, ids) and torch.equal(got.cutoff_T, want.cutoff_T)
                torch.testing.assert_close(got.scores_TE, want.scores_TE)
            assert all(torch.equal(o[0], e[0]) for o, e in zip(outs, expected))
    twin = copy.deepcopy(routers[0])
    with RoutingRecord() as record:
        twin(x)
    assert record.stats([routers[0]]) == (None,) and record.stats([twin])[0].loads_E.sum() == 20


def test_latent_moe_equals_per_token_reference():
    config, moe = _moe()
    x = torch.randn(2, 7, config.dim)
    out = moe(x)
    x_TD = x.reshape(-1, config.dim)
    weights, ids, _ = moe.router(x_TD)
    latent = moe.routed_down(x_TD)
    ref = []
    ex = moe.experts
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(config.moe.latent_dim)
        for w, e in zip(weights[t], ids[t]):
            h = situ_glu(latent[t] @ ex.w_gate_ELF[e], latent[t] @ ex.w_up_ELF[e])
            acc = acc + w * (h @ ex.w_down_EFL[e])
        ref.append(moe.routed_up(moe.routed_norm(acc)) + moe.shared(x_TD[t]))
    torch.testing.assert_close(out.reshape(-1, config.dim), torch.stack(ref), rtol=1e-5, atol=1e-5)


def test_latent_moe_backward_reaches_router_and_experts():
    config, moe = _moe()
    x = torch.randn(3, 5, config.dim, requires_grad=True)
    moe(x).square().sum().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w_down_EFL.grad.abs().sum() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("counts", [[3, 0, 5, 8], [0, 0, 16, 0], [4, 4, 4, 4]])
def test_grouped_mm_paths_agree(counts):
    torch.manual_seed(0)
    counts_E = torch.tensor(counts)
    rows = int(counts_E.sum())
    x = torch.randn(rows, 16, requires_grad=True)   # 16 fp32 = 64 bytes: aligned for _grouped_mm
    w = torch.randn(4, 16, 8, requires_grad=True)
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts_E)
    ref = torch.einsum("ri,rio->ro", x, w[expert_of_row])
    grad = torch.randn(rows, 8)
    ref_grads = torch.autograd.grad(ref, (x, w), grad)
    for fn in (grouped_mm, grouped_mm_loop):
        out = fn(x, w, counts_E)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(torch.autograd.grad(out, (x, w), grad), ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if hasattr(torch, "_grouped_mm"):
        fused = torch._grouped_mm(x, w, offs=torch.cumsum(counts_E, 0).to(torch.int32))
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)


def test_grouped_mm_loop_gives_only_the_grads_asked_and_handles_no_rows():
    """The loop's hand-written backward: the input's grad alone, the weights' alone (an expert without rows gets
    zeros), and no rows at all."""
    torch.manual_seed(1)
    counts_E = torch.tensor([2, 0, 3])
    x, w = torch.randn(5, 6), torch.randn(3, 6, 4)
    grad = torch.randn(5, 4)
    expert_of_row = torch.repeat_interleave(torch.arange(3), counts_E)
    for needs_x, needs_w in ((True, False), (False, True)):
        xi, wi = x.clone().requires_grad_(needs_x), w.clone().requires_grad_(needs_w)
        wrt = [t for t in (xi, wi) if t.requires_grad]
        got = torch.autograd.grad(grouped_mm_loop(xi, wi, counts_E), wrt, grad)
        ref = torch.autograd.grad(torch.einsum("ri,rio->ro", xi, wi[expert_of_row]), wrt, grad)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if needs_w:
            assert torch.equal(got[0][1], torch.zeros(6, 4))
    empty = grouped_mm_loop(torch.randn(0, 6, requires_grad=True), w.requires_grad_(), torch.zeros(3, dtype=torch.long))
    assert empty.shape == (0, 4)
    empty.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    # Under autocast the products run in its dtype, as a matmul would; the grads come back in the inputs' dtype.
    xa, wa = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_mm_loop(xa, wa, counts_E)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert xa.grad.dtype == wa.grad.dtype == torch.float32


def test_grouped_mm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="features"):
        grouped_mm(torch.randn(4, 3), torch.randn(2, 5, 2), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="counts sum"):
        grouped_mm(torch.randn(4, 5), torch.randn(2, 5, 2), torch.tensor([2, 1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_router_logits_in_one_bf16_gemm_equal_the_upcast_fp32_gemm(tokens):
    # Serving's bf16 router: fp32 logits from one GEMM over the bf16 operands, against the upcast operands' fp32
    # GEMM (the same exact products; only the summation order may differ), and the same experts chosen.
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 1024, generator=gen).cuda().bfloat16()
    w = (0.05 * torch.randn(32, 1024, generator=gen)).cuda().bfloat16()
    with torch.no_grad():
        got = router_logits(x, w)
    ref = x.float() @ w.float().t()
    assert got.dtype == torch.float32 and got.shape == (tokens, 32)
    assert ((got - ref).abs() <= 1e-5 * ref.abs().max()).all()
    assert torch.equal(got.topk(4).indices, ref.topk(4).indices)
    # Under autograd (training) the upcast path runs and the gradient reaches the weight.
    w.requires_grad_(True)
    router_logits(x, w).sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_moe_with_many_rows_captures_in_a_cuda_graph():
    # An fp32 engine (greedy-identity checks) captures prefill chunks of hundreds of tokens: grouped_mm's fp32 route
    # loops over the experts on the host, so these rows take the unsorted kernels, which need no sync.
    from kimik3.ops.moe import SMALL_BATCH_MAX_ROWS

    config, moe = _moe()
    tokens = SMALL_BATCH_MAX_ROWS // config.moe.top_k + 9
    x = torch.randn(tokens, config.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = moe(x)
        gpu = moe.cuda()
        static = x.cuda()
        gpu(static)   # the kernels compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gpu(static)
        graph.replay()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
