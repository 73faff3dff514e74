"""Per-head Muon (kimik3.optim.muon): numerics against torch.optim.Muon, per-block orthogonality,
the AdamW-matching scale, the K3 grouping, training and state round trips, argument errors."""

from __future__ import annotations

import copy
import json
import math

import pytest
import safetensors.torch
import torch
from torch import nn

from kimik3.config import K3Config
from kimik3.model import K3ForCausalLM
from kimik3.optim import Muon, MultiOptimizer, block_layout, build_param_groups, classify_parameters, newton_schulz
from kimik3.train.checkpoint import flatten_state, unflatten_state
from tests.numerics import rel_rms

# A Newton–Schulz polynomial that converges to the exact polar factor (order 3, slope 15/8 at 0);
# with fp32 and 15 steps it reaches U V^T to ~1e-6, so orthogonality can be asserted tightly.
CONVERGENT = dict(ns_dtype=torch.float32, ns_coefficients=(15 / 8, -10 / 8, 3 / 8), ns_steps=15)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Run this module on one intra-op thread, restoring the previous count afterwards.

    The optimizer issues thousands of tiny batched matmuls per step on the tiny model; on a
    2-core box shared with other jobs, OpenMP's multi-threaded bmm costs ~10 ms each from
    contention alone (the file took minutes instead of ~7 s). One thread is also the faster
    choice at these sizes, and every comparison here is within one process, so it changes no
    assertion.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def polar(G: torch.Tensor) -> torch.Tensor:
    """Exact orthogonal factor U V^T of each matrix of G [..., m, n], fp64."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def one_step_update(weight_shape, grad, split, lr=1.0, **options) -> torch.Tensor:
    """-(change of a zero parameter) after one Muon step from zero momentum, without decay."""
    p = nn.Parameter(torch.zeros(weight_shape))
    opt = Muon([p], lr=lr, weight_decay=0.0, split=split, **options)
    p.grad = grad.clone()
    opt.step()
    return -p.detach()


def head_scaled_grad(blocks_BMN_shape, scales, seed=0) -> torch.Tensor:
    """Random [B, m, n] blocks, block b multiplied by scales[b]."""
    g = torch.randn(blocks_BMN_shape, generator=torch.Generator().manual_seed(seed))
    return g * torch.tensor(scales)[:, None, None]


# --------------------------------------------------------------------------- torch equivalence
@pytest.mark.parametrize("shape", [(48, 80), (96, 40)])
@pytest.mark.parametrize("split", [("whole",), ("rows", 1), ("cols", 1)])
def test_matches_torch_muon(shape, split):
    """One head, one matrix: our Muon is torch.optim.Muon(adjust_lr_fn="match_rms_adamw"), bit for bit."""
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(shape, generator=gen)
    ours, ref = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt = Muon([ours], split=split, **kwargs)
    opt_ref = torch.optim.Muon([ref], adjust_lr_fn="match_rms_adamw", **kwargs)
    for _ in range(4):
        grad = torch.randn(shape, generator=gen)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        opt_ref.step()
    assert torch.equal(ours, ref), f"max diff {(ours - ref).abs().max().item():.3g}"
    assert torch.equal(opt.state[ours]["momentum_buffer"], opt_ref.state[ref]["momentum_buffer"])


def test_experts_match_torch_muon_per_expert():
    """("experts",) on [E, a, b] == torch.optim.Muon stepping each expert as its own matrix (bitwise)."""
    E, a, b = 3, 24, 40
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(E, a, b, generator=gen)
    stacked = nn.Parameter(init.clone())
    singles = [nn.Parameter(init[e].clone()) for e in range(E)]
    kwargs = dict(lr=0.01, weight_decay=0.05, momentum=0.9, nesterov=True)
    opt = Muon([stacked], split=("experts",), **kwargs)
    opt_ref = torch.optim.Muon(singles, adjust_lr_fn="match_rms_adamw", **kwargs)
    for _ in range(3):
        grad = torch.randn(E, a, b, generator=gen)
        stacked.grad = grad.clone()
        for e, p in enumerate(singles):
            p.grad = grad[e].clone()
        opt.step()
        opt_ref.step()
    assert torch.equal(stacked, torch.stack(singles))


@pytest.mark.parametrize("split", [("rows", 4), ("cols", 4)])
def test_per_head_step_is_torch_muon_on_each_head(split):
    """Per-head Muon == torch's Muon with every head block as a separate parameter (its own lr scale)."""
    H, X, other = 4, 16, 40
    shape = (H * X, other) if split[0] == "rows" else (other, H * X)
    gen = torch.Generator().manual_seed(3)
    init = torch.randn(shape, generator=gen)
    heads = init.chunk(H, dim=0 if split[0] == "rows" else 1)
    ours = nn.Parameter(init.clone())
    singles = [nn.Parameter(h.clone()) for h in heads]
    kwargs = dict(lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True)
    opt = Muon([ours], split=split, **kwargs)
    opt_ref = torch.optim.Muon(singles, adjust_lr_fn="match_rms_adamw", **kwargs)
    for _ in range(3):
        grad = torch.randn(shape, generator=gen)
        ours.grad = grad.clone()
        for p, g in zip(singles, grad.chunk(H, dim=0 if split[0] == "rows" else 1)):
            p.grad = g.clone()
        opt.step()
        opt_ref.step()
    assert torch.equal(ours, torch.cat(list(singles), dim=0 if split[0] == "rows" else 1))


# --------------------------------------------------------------------------- Newton–Schulz
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(16, 48), (48, 16), (32, 32)])
def test_batched_newton_schulz_equals_loop(dtype, block):
    gen = torch.Generator().manual_seed(4)
    G = torch.randn(2, 3, *block, generator=gen) * torch.logspace(0, -3, 3)[None, :, None, None]
    batched = newton_schulz(G, dtype=dtype)
    looped = torch.stack([torch.stack([newton_schulz(G[i, j], dtype=dtype) for j in range(3)]) for i in range(2)])
    assert batched.dtype == dtype and batched.shape == G.shape
    assert torch.equal(batched, looped)


def test_newton_schulz_fp32_converges_to_polar_factor():
    G = torch.randn(5, 24, 56, generator=torch.Generator().manual_seed(5))
    O = newton_schulz(G, steps=CONVERGENT["ns_steps"], coefficients=CONVERGENT["ns_coefficients"],
                      dtype=torch.float32)
    assert rel_rms(polar(G), O) < 1e-5
    # The default (Jordan) coefficients stop at singular values in a band around 1, not at 1.
    s = torch.linalg.svdvals(newton_schulz(G, dtype=torch.float32))
    assert 0.6 < s.min() and s.max() < 1.25


def test_newton_schulz_zero_gradient_stays_zero():
    out = newton_schulz(torch.zeros(2, 8, 4))
    assert torch.equal(out, torch.zeros(2, 8, 4, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- per-block orthogonality
SCALES = [1.0, 1e-1, 1e-2, 1e-3]  # very different gradient scales per head / expert


def _blocks_of(update: torch.Tensor, split) -> torch.Tensor:
    return block_layout(split, update.shape).to_blocks(update)


@pytest.mark.parametrize("kind", ["rows", "cols", "experts"])
def test_each_block_is_orthogonal_on_its_own(kind):
    """One step from zero momentum: every block's update is c * polar(its own gradient block).

    Whole-matrix orthogonalisation of the same gradient (the contrast) leaves the blocks with
    norms spread over ~3 orders of magnitude, following the gradient scales.
    """
    H = 4
    # Blocks are shaped so that the loudest block alone spans the whole matrix's smaller side:
    # then whole-matrix orthogonalisation spends (almost) all of the update on it.
    M, N = (16, 32) if kind == "cols" else (32, 16)
    grad_blocks = head_scaled_grad((H, M, N), SCALES)
    if kind == "rows":        # [H*M, N], head h = rows h*M:(h+1)*M
        split, grad = ("rows", H), grad_blocks.reshape(H * M, N)
    elif kind == "cols":      # [M, H*N], head h = columns h*N:(h+1)*N
        split, grad = ("cols", H), grad_blocks.permute(1, 0, 2).reshape(M, H * N)
    else:                     # [E, M, N]
        split, grad = ("experts",), grad_blocks
    block = block_layout(split, grad.shape)
    assert (block.blocks, block.rows, block.cols) == (H, M, N)
    assert torch.equal(block.to_blocks(grad), grad_blocks)

    lr = 0.5
    update = one_step_update(grad.shape, grad, split, lr=lr, **CONVERGENT)
    scale = lr * 0.2 * math.sqrt(max(M, N))
    update_BMN = _blocks_of(update, split)
    for h in range(H):
        assert rel_rms(scale * polar(grad_blocks[h]), update_BMN[h]) < 1e-5, f"block {h}"
        s = torch.linalg.svdvals(update_BMN[h].double())
        assert (s.max() - s.min()) / s.max() < 1e-5, f"block {h} singular values {s}"
    norms = update_BMN.flatten(1).norm(dim=1)
    assert (norms.max() / norms.min()) < 1 + 1e-5

    # Contrast: the same gradient orthogonalised as one matrix.
    whole_grad = grad if kind != "experts" else grad.reshape(H * M, N)
    whole = one_step_update(whole_grad.shape, whole_grad, ("whole",), lr=lr, **CONVERGENT)
    whole_BMN = _blocks_of(whole.reshape(grad.shape), split)
    whole_norms = whole_BMN.flatten(1).norm(dim=1)
    assert whole_norms.max() / whole_norms.min() > 100
    s_quiet = torch.linalg.svdvals(whole_BMN[-1].double())
    assert s_quiet.max() < 0.05 * s.max()  # the quietest head gets almost no update at all


def test_default_bf16_per_head_keeps_quiet_heads_alive():
    """With the production settings (bf16, 5 quintic steps) every head's singular values sit in
    the usual Newton–Schulz band, while whole-matrix Muon leaves the quiet heads near zero."""
    H, X, D = 4, 32, 16
    grad = head_scaled_grad((H, X, D), SCALES, seed=6).reshape(H * X, D)
    unit = 0.2 * math.sqrt(max(X, D))  # lr = 1
    per_head = one_step_update(grad.shape, grad, ("rows", H)).reshape(H, X, D) / unit
    whole = one_step_update(grad.shape, grad, ("whole",)).reshape(H, X, D) / unit
    for h in range(H):
        s = torch.linalg.svdvals(per_head[h].double())
        assert 0.6 < s.min() and s.max() < 1.25, f"head {h}: {s}"
    assert torch.linalg.svdvals(whole[-1].double()).max() < 0.05
    assert torch.linalg.svdvals(whole[-2].double()).max() < 0.2


# --------------------------------------------------------------------------- AdamW-matching scale
@pytest.mark.parametrize("split,shape", [
    (("rows", 8), (64, 32)),        # block [8, 32]: block max 32, tensor max 64
    (("cols", 8), (32, 64)),        # block [32, 8]: block max 32, tensor max 64
    (("experts",), (16, 8, 4)),     # block [8, 4]: block max 8, torch's shape[:2] rule would say 16
])
def test_update_rms_matches_adamw_scale_per_block(split, shape):
    """An orthogonal m x n block has RMS 1/sqrt(max(m, n)), so with the block's own scale
    lr * 0.2 * sqrt(max(m, n)) every block's update RMS is exactly 0.2 * lr. Using the whole
    tensor's shape would give 0.2 * lr * sqrt(2) for these shapes."""
    lr = 0.03
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    update = one_step_update(shape, grad, split, lr=lr, **CONVERGENT)
    blocks = _blocks_of(update, split)
    rms_B = blocks.double().square().mean(dim=(1, 2)).sqrt()
    assert torch.allclose(rms_B, torch.full_like(rms_B, 0.2 * lr), rtol=1e-4), rms_B
    # Production settings: the NS band keeps the RMS within ~15 % of the target (not sqrt(2) off).
    rms_default = one_step_update(shape, grad, split, lr=lr).double().square().mean().sqrt()
    assert 0.8 < rms_default / (0.2 * lr) < 1.15


def test_weight_decay_is_decoupled_and_unscaled():
    """p <- p * (1 - lr * wd) - update: a zero gradient leaves pure decay (the lr ratio is not applied)."""
    p = nn.Parameter(torch.randn(16, 32, generator=torch.Generator().manual_seed(8)))
    before = p.detach().clone()
    opt = Muon([p], lr=0.1, weight_decay=0.2, split=("rows", 2))
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), before * (1 - 0.1 * 0.2))


# --------------------------------------------------------------------------- K3 grouping
@pytest.fixture(scope="module")
def tiny_model() -> K3ForCausalLM:
    return K3ForCausalLM(K3Config.preset("tiny"), seed=0)


def test_grouping_covers_every_parameter_once(tiny_model):
    model = tiny_model
    rules = classify_parameters(model)
    names = [n for n, _ in model.named_parameters()]
    assert list(rules) == names and len(names) == len(list(model.parameters()))

    opt = build_param_groups(model, lr=1e-3, weight_decay=0.1)
    grouped = [p for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len(names)
    assert {id(p) for p in grouped} == {id(p) for p in model.parameters()}
    by_name = {g["name"]: g for g in opt.param_groups}
    assert set(by_name) == {"muon.rows4", "muon.cols4", "muon.whole", "muon.experts", "adamw.decay",
                            "adamw.no_decay"}
    assert all("base_lr" in g for g in opt.param_groups)
    assert by_name["adamw.no_decay"]["weight_decay"] == 0.0 and by_name["adamw.decay"]["weight_decay"] == 0.1

    def group_of(name):
        return next(g["name"] for g in opt.param_groups if name in g["param_names"])

    expected = {
        "embed.weight": "adamw.decay",
        "lm_head.weight": "adamw.decay",
        "norm.weight": "adamw.no_decay",
        "final_mix.query": "adamw.no_decay",
        "layers.2.mixer_mix.key_norm_weight": "adamw.no_decay",
        # KDA (layer 0)
        "layers.0.mixer.q_proj.weight": "muon.rows4",
        "layers.0.mixer.v_proj.weight": "muon.rows4",
        "layers.0.mixer.output_gate.weight": "muon.rows4",
        "layers.0.mixer.forget_b.weight": "muon.rows4",
        "layers.0.mixer.o_proj.weight": "muon.cols4",
        "layers.0.mixer.forget_a.weight": "muon.whole",
        "layers.0.mixer.beta_proj.weight": "adamw.decay",
        "layers.0.mixer.k_conv": "adamw.decay",
        "layers.0.mixer.A_log": "adamw.no_decay",
        "layers.0.mixer.dt_bias": "adamw.no_decay",
        "layers.0.mixer.output_norm_weight": "adamw.no_decay",
        "layers.0.ffn.w_down.weight": "muon.whole",          # dense FFN
        # Gated MLA (layer 3) and its MoE
        "layers.3.mixer.wq_b.weight": "muon.rows4",
        "layers.3.mixer.wkv_b.weight": "muon.rows4",
        "layers.3.mixer.gate.weight": "muon.rows4",
        "layers.3.mixer.wo.weight": "muon.cols4",
        "layers.3.mixer.wq_a.weight": "muon.whole",
        "layers.3.mixer.wkv_a.weight": "muon.whole",
        "layers.3.mixer.kv_norm.weight": "adamw.no_decay",
        "layers.3.ffn.router.gate.weight": "muon.whole",
        "layers.3.ffn.experts.w_down_EFL": "muon.experts",
        "layers.3.ffn.routed_up.weight": "muon.whole",
        "layers.3.ffn.shared.w_gate.weight": "muon.whole",
        # MTP follows the same rules
        "mtp.proj.weight": "muon.whole",
        "mtp.block.mixer.wkv_b.weight": "muon.rows4",
        "mtp.block.ffn.experts.w_gate_ELF": "muon.experts",
        "mtp.hidden_norm.weight": "adamw.no_decay",
    }
    for name, group in expected.items():
        assert group_of(name) == group, name
    # Every 1-D parameter is on AdamW without decay.
    assert all(group_of(n) == "adamw.no_decay" for n, p in model.named_parameters() if p.ndim == 1)


def test_grouping_rejects_uncovered_and_doubly_covered(tiny_model):
    model = copy.deepcopy(tiny_model)
    model.layers[1].mixer.register_parameter("mystery_HKV", nn.Parameter(torch.zeros(4, 8, 8)))
    with pytest.raises(ValueError, match=r"not covered.*layers\.1\.mixer\.mystery_HKV"):
        classify_parameters(model)
    with pytest.raises(ValueError, match="mystery_HKV"):
        build_param_groups(model, lr=1e-3)

    model = copy.deepcopy(tiny_model)
    model.layers[0].ffn.register_parameter("extra_matrix", nn.Parameter(torch.zeros(3, 5)))
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.extra_matrix"):
        classify_parameters(model)

    # One tensor reachable from two modules would be stepped twice: reported, not guessed.
    model = copy.deepcopy(tiny_model)
    model.mtp.block.mixer.wq_a.weight = model.layers[3].mixer.wq_a.weight
    with pytest.raises(ValueError, match=r"more than once.*layers\.3\.mixer\.wq_a\.weight"):
        classify_parameters(model)


# --------------------------------------------------------------------------- training + state
def _loss(model, ids):
    return model(ids, labels=ids.roll(-1, 1)).loss


def _train_step(model, opt, ids):
    opt.zero_grad(set_to_none=True)
    loss = _loss(model, ids)
    loss.backward()
    opt.step()
    return loss.item()


def test_training_lowers_loss_and_state_dict_round_trips(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    settings = dict(lr=3e-3, weight_decay=0.1)
    model = copy.deepcopy(tiny_model)
    opt = build_param_groups(model, **settings)
    losses = [_train_step(model, opt, ids) for _ in range(3)]
    with torch.no_grad():
        losses.append(float(_loss(model, ids)))
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

    # Save the way a training checkpoint does (tensors to safetensors, the rest to JSON), restore
    # into a fresh optimizer on a copy of the model, and take one more step on both.
    tensors: dict[str, torch.Tensor] = {}
    structure = json.loads(json.dumps(flatten_state(opt.state_dict(), tensors)))
    saved = unflatten_state(structure, safetensors.torch.load(safetensors.torch.save(tensors)))
    twin = copy.deepcopy(model)
    opt_twin = build_param_groups(twin, **settings)
    opt_twin.load_state_dict(saved)
    fresh = copy.deepcopy(model)
    opt_fresh = build_param_groups(fresh, **settings)

    for m, o in ((model, opt), (twin, opt_twin), (fresh, opt_fresh)):
        _train_step(m, o, ids)
    for (name, p), p_twin, p_fresh in zip(model.named_parameters(), twin.parameters(), fresh.parameters()):
        assert torch.equal(p, p_twin), name
    # The restored momentum matters: without it the step differs.
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    moments = opt["muon"].state[model.layers[0].mixer.q_proj.weight]["momentum_buffer"]
    assert torch.equal(moments, opt_twin["muon"].state[twin.layers[0].mixer.q_proj.weight]["momentum_buffer"])


def test_multi_optimizer_groups_are_live_and_state_dict_checked():
    a, b = nn.Parameter(torch.ones(8, 4)), nn.Parameter(torch.ones(4))
    opt = MultiOptimizer({"muon": Muon([a], lr=0.1, weight_decay=0.0),
                          "adamw": torch.optim.AdamW([b], lr=0.2, weight_decay=0.0)})
    assert [g["name"] for g in opt.param_groups] == ["muon.0", "adamw.0"]
    assert [g["base_lr"] for g in opt.param_groups] == [0.1, 0.2]
    for group in opt.param_groups:  # what a scheduler does
        group["lr"] = group["base_lr"] * 0.5
    assert opt["muon"].param_groups[0]["lr"] == 0.05 and opt["adamw"].param_groups[0]["lr"] == 0.1
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert set(opt.state) == {a, b}
    opt.zero_grad()
    assert a.grad is None and b.grad is None
    with pytest.raises(ValueError, match="members"):
        opt.load_state_dict({"muon": opt["muon"].state_dict()})


# --------------------------------------------------------------------------- bad inputs
def test_bad_splits_raise_value_errors_naming_the_problem():
    matrix = nn.Parameter(torch.zeros(10, 8))
    with pytest.raises(ValueError, match="split kind 'heads' is unknown"):
        Muon([matrix], split=("heads", 2))
    with pytest.raises(ValueError, match="10 rows are not divisible by 3 heads"):
        Muon([matrix], split=("rows", 3))
    with pytest.raises(ValueError, match="8 columns are not divisible by 3 heads"):
        Muon([matrix], split=("cols", 3))
    with pytest.raises(ValueError, match=r"my\.weight: split \('rows', 3\)"):
        Muon([("my.weight", matrix)], split=("rows", 3))
    with pytest.raises(ValueError, match="head count H must be an int >= 1"):
        Muon([matrix], split=("rows", 0))
    with pytest.raises(ValueError, match="split must be a tuple"):
        Muon([matrix], split="whole")
    with pytest.raises(ValueError, match=r"\('experts',\) needs a 3-D"):
        Muon([matrix], split=("experts",))
    with pytest.raises(ValueError, match="needs a 2-D matrix"):
        Muon([nn.Parameter(torch.zeros(2, 3, 4))], split=("whole",))
    with pytest.raises(ValueError, match="momentum must be in"):
        Muon([matrix], momentum=1.0)
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([matrix], ns_dtype=torch.int8)
    with pytest.raises(ValueError, match="G must be a tensor of shape"):
        newton_schulz(torch.zeros(5))
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.zeros(3, 3), coefficients=(1.0, 2.0))
