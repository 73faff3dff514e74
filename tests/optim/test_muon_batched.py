"""Muon's batched step (kimik3.optim.muon): foreach momentum / decay / update and one Newton–Schulz call per
bucket of equal block shapes and options, against the per-parameter formula of the class docstring.

On the CPU the batched step is bit-for-bit the per-parameter one, in fp32 and bf16 iterations alike: the
batched matmul treats every matrix of a batch on its own, and per-head column blocks are stacked in their
own strided layout (fp32 rounding depends on it), so each block is iterated exactly as it is alone.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import kimik3.optim.muon as muon_module
from kimik3.optim import Muon, block_layout, newton_schulz


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """One intra-op thread for this module (many tiny matmuls on a shared 2-core box); restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference_step(opt: Muon) -> None:
    """The per-parameter step: the formula of ``Muon``'s docstring, one parameter (and one
    ``newton_schulz`` call) at a time, on ``opt``'s groups and state."""
    with torch.no_grad():
        for group in opt.param_groups:
            lr, momentum = float(group["lr"]), float(group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                layout = block_layout(group["split"], p.shape)
                state = opt.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1.0 - momentum)
                direction = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                ortho = newton_schulz(layout.to_blocks(direction), group["ns_steps"], group["ns_coefficients"],
                                      group["eps"], getattr(torch, group["ns_dtype"]))
                p.mul_(1.0 - lr * float(group["weight_decay"]))
                p.add_(layout.from_blocks(ortho, p.shape), alpha=-lr * float(group["rms_scale"]) * layout.lr_ratio)


# name: (shape, dtype); the groups below say how each is cut
SHAPES = {
    "q_a": ((64, 32), torch.float32),        # rows 4 -> 4 wide blocks [16, 32]
    "q_b": ((64, 32), torch.float32),        # same block shape as q_a
    "k_tall": ((128, 16), torch.float32),    # rows 4 -> 4 tall blocks [32, 16]
    "frozen": ((64, 32), torch.float32),     # never has a gradient
    "o_proj": ((32, 64), torch.float32),     # cols 4 -> 4 tall column blocks [32, 16]
    "o_proj_2": ((32, 64), torch.float32),   # same column blocks as o_proj
    "o_wide": ((16, 128), torch.float32),    # cols 4 -> 4 wide column blocks [16, 32]
    "experts_3": ((3, 16, 32), torch.float32),  # 3 experts [16, 32], like q_a's blocks
    "experts_5": ((5, 32, 16), torch.float32),  # 5 tall experts [32, 16]
    "whole_wide": ((48, 80), torch.float32),
    "whole_tall": ((80, 48), torch.float32),
    "whole_bf16": ((48, 80), torch.bfloat16),   # same block as whole_wide, another dtype
    "whole_4_steps": ((48, 80), torch.float32),  # same block as whole_wide, other Newton–Schulz options
}


def make_groups(params: dict[str, nn.Parameter]) -> list[dict]:
    """Four groups with different lr / decay / momentum / Nesterov, sharing block shapes across groups."""
    def pick(*names):
        return [(n, params[n]) for n in names]
    return [
        {"params": pick("q_a", "q_b", "k_tall", "frozen"), "split": ("rows", 4), "lr": 0.02, "weight_decay": 0.1},
        {"params": pick("o_proj", "o_proj_2", "o_wide"), "split": ("cols", 4), "lr": 0.03, "weight_decay": 0.0,
         "nesterov": False, "momentum": 0.9},
        {"params": pick("experts_3", "experts_5"), "split": ("experts",), "lr": 0.01, "weight_decay": 0.05},
        {"params": pick("whole_wide", "whole_tall", "whole_bf16"), "lr": 0.02, "weight_decay": 0.1,
         "nesterov": False},
        {"params": pick("whole_4_steps"), "lr": 0.02, "ns_steps": 4},
    ]


def build(ns_dtype: str, seed: int = 0) -> tuple[Muon, dict[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    params = {n: nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for n, (shape, dtype) in SHAPES.items()}
    return Muon(make_groups(params), ns_dtype=ns_dtype), params


def set_grads(params: dict[str, nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for name, p in params.items():
        grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        # "frozen" never has a gradient; "q_b" skips the second step (no momentum, no decay, no update)
        p.grad = None if name == "frozen" or (name == "q_b" and step == 1) else grad


def count_newton_schulz(monkeypatch) -> list[tuple]:
    """Replace the module's ``newton_schulz`` by a wrapper recording (input shape, steps, dtype) per call."""
    calls = []
    original = muon_module.newton_schulz

    def counting(G, steps, coefficients, eps, dtype):
        calls.append((tuple(G.shape), steps, dtype))
        return original(G, steps, coefficients, eps, dtype)
    monkeypatch.setattr(muon_module, "newton_schulz", counting)
    return calls


# The buckets of one step with every gradient (q_b's skipped step removes its 4 blocks from [16, 32]),
# across groups with different lr / decay / momentum / Nesterov:
# [16, 32]: q_a 4 + q_b 4 + experts_3 3;  [32, 16]: k_tall 4 + experts_5 5;  column blocks [32, 16]:
# o_proj 4 + o_proj_2 4;  column blocks [16, 32]: o_wide 4;  [48, 80] fp32: whole_wide;  [80, 48]:
# whole_tall;  [48, 80] bf16 parameters: whole_bf16;  [48, 80] with 4 steps: whole_4_steps.
def expected_calls(ns_dtype: torch.dtype, q_b: bool = True) -> Counter:
    shapes = [((11 if q_b else 7, 16, 32), 5), ((9, 32, 16), 5), ((8, 32, 16), 5), ((4, 16, 32), 5),
              ((1, 48, 80), 5), ((1, 80, 48), 5), ((1, 48, 80), 5), ((1, 48, 80), 4)]
    return Counter((shape, steps, ns_dtype) for shape, steps in shapes)


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_batched_step_is_the_per_parameter_step_bit_for_bit(ns_dtype, monkeypatch):
    """Several steps on a mix of splits, shapes, dtypes and groups: parameters and momentum equal the
    per-parameter formula exactly, with one Newton–Schulz call per bucket, not per parameter."""
    opt, params = build(ns_dtype)
    ref_opt, ref_params = build(ns_dtype)
    calls = count_newton_schulz(monkeypatch)
    for step in range(3):
        set_grads(params, step)
        set_grads(ref_params, step)
        calls.clear()
        opt.step()
        assert Counter(calls) == expected_calls(getattr(torch, ns_dtype), q_b=step != 1), step
        reference_step(ref_opt)
        for name, p in params.items():
            diff = (p - ref_params[name]).abs().max()
            assert torch.equal(p, ref_params[name]), f"step {step}: {name}, max diff {diff}"
            if p in opt.state:
                assert torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[ref_params[name]]["momentum_buffer"])
    assert "frozen" not in {n for n, p in params.items() if p in opt.state}
    assert not torch.equal(params["q_a"], build(ns_dtype)[1]["q_a"])  # something happened


def test_byte_bound_cuts_buckets_into_batches(monkeypatch):
    """With room for 6 blocks per call, a bucket is cut between parameters, and a parameter of more blocks
    than that (a 7-expert stack, 8 column heads) is orthogonalised in slices; the step is unchanged."""
    block_bytes = 16 * 32 * 4
    monkeypatch.setattr(muon_module, "NS_BUCKET_BYTES", 6 * block_bytes + 1)
    gen = torch.Generator().manual_seed(3)
    shapes = {"a": ((64, 32), ("rows", 4)), "b": ((32, 32), ("rows", 2)), "c": ((64, 32), ("rows", 4)),
              "experts_7": ((7, 16, 32), ("experts",)), "cols_8": ((16, 256), ("cols", 8)),
              "cols_2": ((16, 64), ("cols", 2))}
    init = {n: torch.randn(shape, generator=gen) for n, (shape, _) in shapes.items()}
    grads = [{n: torch.randn(shape, generator=gen) for n, (shape, _) in shapes.items()} for _ in range(2)]
    runs = []
    for batched in (True, False):
        params = {n: nn.Parameter(t.clone()) for n, t in init.items()}
        opt = Muon([{"params": [params[n]], "split": split} for n, (_, split) in shapes.items()], lr=0.02,
                   ns_dtype="float32")
        calls = count_newton_schulz(monkeypatch) if batched else []
        for step_grads in grads:
            for n, p in params.items():
                p.grad = step_grads[n].clone()
            if batched:
                opt.step()
            else:
                reference_step(opt)
        runs.append((params, calls))
    (params, calls), (ref_params, _) = runs
    for n in shapes:
        assert torch.equal(params[n], ref_params[n]), n
    # per step: a 4 + b 2; experts 0:6; experts 6:7 (alone); c 4; then column blocks: cols_8 0:6; 6:8; cols_2
    assert [shape[0] for shape, *_ in calls] == [6, 6, 1, 4, 6, 2, 2] * 2


def test_state_dict_round_trip_is_unchanged():
    """The state is the per-parameter momentum buffer, as before; a restored optimizer continues the run
    exactly, and one without the momentum does not."""
    opt, params = build("float32")
    for step in range(2):
        set_grads(params, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert sorted(saved) == ["param_groups", "state"]
    assert all(set(s) == {"momentum_buffer"} for s in saved["state"].values())
    assert len(saved["state"]) == len(SHAPES) - 1  # every parameter but "frozen"

    twin_params = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
    twin = Muon(make_groups(twin_params), ns_dtype="float32")
    twin.load_state_dict(saved)
    fresh_params = {n: nn.Parameter(p.detach().clone()) for n, p in params.items()}
    fresh = Muon(make_groups(fresh_params), ns_dtype="float32")
    for ps, o in ((params, opt), (twin_params, twin), (fresh_params, fresh)):
        set_grads(ps, 2)
        o.step()
    for name, p in params.items():
        assert torch.equal(p, twin_params[name]), name
    assert not torch.equal(params["q_a"], fresh_params["q_a"])
    assert opt.state_dict()["param_groups"] == twin.state_dict()["param_groups"]


def test_empty_matrices_step():
    """Zero-size parameters (no rows, no columns, no experts) step without error and stay empty."""
    params = [nn.Parameter(torch.zeros(0, 8)), nn.Parameter(torch.zeros(8, 0)), nn.Parameter(torch.zeros(0, 4, 4))]
    opt = Muon([{"params": params[:2]}, {"params": params[2:], "split": ("experts",)}])
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert [tuple(p.shape) for p in params] == [(0, 8), (8, 0), (0, 4, 4)]


def test_tensor_learning_rate_is_read_at_each_step():
    """Learning rates held in 0-dim tensors (what a CUDA-graphed step reads, the schedule writing them in place
    between steps): the same parameters as float ones to fp32 rounding (the tensor path scales the update before
    adding it, one more rounding), a write to the tensor taking effect at the next step, and lr 0 leaving the
    parameters unchanged (no decay, no update)."""
    opt, params = build("float32")
    ref_opt, ref_params = build("float32")
    lrs = [torch.tensor(float(g["lr"]), dtype=torch.float64) for g in opt.param_groups]
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    for step in range(3):
        for lr, ref_group in zip(lrs, ref_opt.param_groups):
            value = float(ref_group["lr"]) * (0.5 if step == 2 else 1.0)
            lr.fill_(value)
            ref_group["lr"] = value
        set_grads(params, step)
        set_grads(ref_params, step)
        opt.step()
        ref_opt.step()
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=2e-6, atol=2e-6, msg=f"step {step}: {name}")
    before = {name: p.detach().clone() for name, p in params.items()}
    for lr in lrs:
        lr.zero_()
    set_grads(params, 3)
    opt.step()
    for name, p in params.items():
        assert torch.equal(p, before[name]), name


def test_a_step_with_tensor_learning_rates_reads_nothing_on_the_host():
    """Muon's step with tensor learning rates (what a CUDA graph captures) reads no tensor value back to the host;
    counted on the CPU as tests/parallel/test_moonep_sync.py counts reads."""
    from tests.parallel.test_moonep_sync import HostReads

    opt, params = build("float32")
    for group in opt.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))
    for step in range(2):     # the first step creates the momentum buffers
        set_grads(params, step)
        with HostReads() as reads:
            opt.step()
        assert reads.seen == [], (step, reads.seen)
