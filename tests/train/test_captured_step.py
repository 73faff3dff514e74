"""``CapturedStep``: a training step replayed from one CUDA graph gives the eager step's losses and weights, and
refuses what a graph cannot do (other shapes, changed hyper-parameters, host-side optimizer counts, CPU tensors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.k3 import check_token_ids
from kimik3.optim.muon import build_param_groups
from kimik3.train.captured_step import CapturedStep

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_refuses_what_a_graph_cannot_replay_before_touching_a_gpu():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="capturable=True"):
        CapturedStep(lambda x: x, torch.optim.AdamW([w]))
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
        CapturedStep(lambda x: x, warmup_steps=0)
    step = CapturedStep(lambda x: x)
    with pytest.raises(ValueError, match="CUDA tensors"):
        step(torch.zeros(2))
    # A capturable AdamW (and Muon, which keeps no step count) is accepted.
    CapturedStep(lambda x: x, torch.optim.AdamW([w], capturable=True))


def _tiny_run(graphed: bool, optimizer_kind: str, steps: int = 6):
    config = dataclasses.replace(K3Config.preset("tiny"), vocab_size=512)
    model = K3ForCausalLM(config, seed=0).to("cuda").cast(torch.bfloat16).train()
    if optimizer_kind == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    else:
        optimizer = build_param_groups(model, lr=1e-3, capturable=True)

    def train_step(ids, labels):
        out = model(ids, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    run = CapturedStep(train_step, optimizer, warmup_steps=2,
                       check=lambda ids, labels: check_token_ids(ids, labels, config.vocab_size)) \
        if graphed else train_step
    gen = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 65), device="cuda", generator=gen)
        losses.append(float(run(ids[:, :-1], ids[:, 1:])))
    return losses, model, run, optimizer


@needs_cuda
@pytest.mark.parametrize("optimizer_kind", ["adamw", "muon"])
def test_replays_give_the_eager_losses_and_weights(optimizer_kind):
    eager, eager_model, _, _ = _tiny_run(False, optimizer_kind)
    graphed, graphed_model, run, _ = _tiny_run(True, optimizer_kind)
    assert run.captured and run.calls == 6
    assert eager[0] > eager[-1]   # it trains
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=0, atol=1e-3)
    for (name, a), b in zip(eager_model.named_parameters(), graphed_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-2, msg=name)


@needs_cuda
def test_refuses_other_shapes_changed_lr_and_bad_ids():
    _, _, run, optimizer = _tiny_run(True, "adamw", steps=3)
    ids = torch.zeros(2, 64, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="inputs it was captured with"):
        run(ids[:, :32], ids[:, :32])
    with pytest.raises(ValueError, match="input_ids must lie in"):
        run(ids - 1, ids)
    optimizer.param_groups[0]["lr"] = 5e-4
    with pytest.raises(RuntimeError, match=r"changed \['lr'\]"):
        run(ids, ids)
