"""Tests of kimik3/model/fused_linear.py: one matmul for several projections, packed in place or concatenated.

- ``project`` equals the separate linears, forward and every weight's gradient (the concatenation path);
- ``pack_projections`` keeps names, values and dtypes, makes ``concat_weight`` read the buffer in place (no copy),
  survives a state-dict load, and leaves the model's outputs and training gradients unchanged;
- under grad, a packed group still gives each weight its own gradient (the concatenation path is taken);
- a group whose weights differ in dtype is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.fused_linear import concat_weight, pack_projections, project


def _linears(seed=0, dims=(5, 7, 3), d=6):
    torch.manual_seed(seed)
    return [nn.Linear(d, n, bias=False) for n in dims]


def test_project_matches_separate_linears_and_their_grads():
    lins = _linears()
    x = torch.randn(2, 4, 6, requires_grad=True)
    outs = project(x, lins)
    refs = [lin(x) for lin in lins]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref)
    grads = [torch.randn_like(r) for r in refs]
    got = torch.autograd.grad(outs, [x] + [lin.weight for lin in lins], grads)
    want = torch.autograd.grad(refs, [x] + [lin.weight for lin in lins], grads)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_packed_group_is_read_in_place():
    lins = _linears()
    before = [lin.weight.detach().clone() for lin in lins]
    holder = nn.Module()
    holder.lins = nn.ModuleList(lins)
    holder.projection_groups = lambda: [list(lins)]
    assert pack_projections(holder) == 1
    assert pack_projections(holder) == 0                     # already packed
    for lin, w in zip(lins, before):
        assert torch.equal(lin.weight, w) and isinstance(lin.weight, nn.Parameter)
    with torch.no_grad():
        packed = concat_weight(lins)
    assert packed.data_ptr() == lins[0].weight.data_ptr() and torch.equal(packed, torch.cat(before))
    # a state-dict load copies in place: the layout stays packed and the new values are read
    state = {k: torch.randn_like(v) for k, v in holder.state_dict().items()}
    holder.load_state_dict(state)
    with torch.no_grad():
        again = concat_weight(lins)
    assert again.data_ptr() == packed.data_ptr()
    torch.testing.assert_close(again, torch.cat([state[f"lins.{i}.weight"] for i in range(3)]))
    # under grad each weight still gets its own gradient
    x = torch.randn(3, 6)
    outs = project(x, lins)
    sum(o.square().sum() for o in outs).backward()
    for lin in lins:
        torch.testing.assert_close(lin.weight.grad, 2 * (x @ lin.weight.detach().T).T @ x)


def test_pack_refuses_mixed_dtypes():
    lins = _linears()
    lins[1].to(torch.float64)
    holder = nn.Module()
    holder.projection_groups = lambda: [list(lins)]
    with pytest.raises(ValueError, match="share dtype"):
        pack_projections(holder)


def test_packed_model_gives_the_same_outputs_and_grads():
    config = K3Config.preset("tiny")
    model = K3ForCausalLM(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    ref = model(ids, labels=ids)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    groups = pack_projections(model)
    assert groups >= config.num_layers            # every layer has at least its mixer's group
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.hidden, ref.hidden)
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], msg=name)
