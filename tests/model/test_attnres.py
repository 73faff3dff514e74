import dataclasses

import pytest
import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.attnres import AttnResMix, attnres_mix_reference, attnres_mix_torch
from tests.numerics import rel_rms


def _pair(seed=0):
    config = K3Config.preset("tiny")
    plain_config = dataclasses.replace(config, attn_res=dataclasses.replace(config.attn_res, enabled=False))
    attn_res = K3ForCausalLM(config, seed=seed)
    plain = K3ForCausalLM(plain_config, seed=seed)
    shared = {k: v for k, v in attn_res.state_dict().items() if k in plain.state_dict()}
    assert set(plain.state_dict()) <= set(shared)
    plain.load_state_dict(shared)
    return config, attn_res, plain


def test_at_init_attnres_equals_the_plain_prenorm_model():
    # Zero pseudo-queries make every mix the mean of its entries; the RMSNorm after each mix
    # removes the 1/N, so the two models agree up to the norms' eps.
    config, attn_res, plain = _pair()
    ids = torch.randint(0, config.vocab_size, (2, 24))
    a, b = attn_res(ids).logits, plain(ids).logits
    assert rel_rms(b, a) < 1e-3
    # ... and stop agreeing once a pseudo-query moves
    with torch.no_grad():
        for name, p in attn_res.named_parameters():
            if name.endswith("query"):
                p.normal_(std=3.0)
    assert rel_rms(b, attn_res(ids).logits) > 1e-1


def test_mix_is_the_softmax_over_normalised_entries():
    torch.manual_seed(0)
    mix = AttnResMix(8)
    torch.nn.init.normal_(mix.key_norm_weight)
    torch.nn.init.normal_(mix.query)
    entries = [torch.randn(3, 5, 8) * s for s in (1.0, 4.0, 0.1)]
    values = torch.stack(entries, dim=-2)
    keys = values / values.square().mean(-1, keepdim=True).add(mix.eps).sqrt()
    probs = torch.softmax(keys @ (mix.key_norm_weight * mix.query), dim=-1)
    torch.testing.assert_close(mix(entries), (probs[..., None] * values).sum(-2))


def test_block_bookkeeping_counts_entries():
    # tiny: 9 layers in blocks of 4 -> blocks open at 0, 4, 8; the final mix sees the embedding,
    # the two completed blocks and the running partial block.
    config = K3Config.preset("tiny")
    model = K3ForCausalLM(config, seed=0)
    seen = []
    model.final_mix.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    layer_seen = []
    for block in model.layers:
        block.ffn_mix.register_forward_pre_hook(lambda module, args: layer_seen.append(len(args[0])))
    model(torch.randint(0, config.vocab_size, (1, 4)))
    assert seen == [config.num_attn_res_blocks + 1] == [4]
    assert layer_seen == [2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert K3Config.preset("k3").num_attn_res_blocks == 8


def _mix_case(N, lead, D, dtypes, seed=0, param_dtype=torch.float32):
    """Entries of different scales (the RMS normalisation matters) in the given dtypes, parameters near those of a
    trained mix (scores of a few units), and an output grad."""
    gen = torch.Generator().manual_seed(seed)
    entries = [(torch.randn(*lead, D, generator=gen) * (0.5 + n)).to(dtypes[n % len(dtypes)]).requires_grad_()
               for n in range(N)]
    knw = (1 + 0.3 * torch.randn(D, generator=gen)).to(param_dtype).requires_grad_()
    query = (0.3 * torch.randn(D, generator=gen)).to(param_dtype).requires_grad_()
    grad = torch.randn(*lead, D, generator=gen).to(entries[-1].dtype)
    return entries, knw, query, grad


def _values_and_grads(fn, entries, knw, query, grad):
    out = fn(entries, knw, query, 1e-5)
    wrt = [t for t in (*entries, knw, query) if t.requires_grad]
    return [out, *torch.autograd.grad(out, wrt, grad)]


@pytest.mark.parametrize("N, lead, D", [(1, (3, 5), 96), (2, (2, 7), 128), (5, (1, 13), 200), (3, (0, 4), 64)])
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.bfloat16)])
def test_the_hand_written_cpu_mix_matches_the_formula_through_autograd(N, lead, D, dtypes):
    """``attnres_mix_torch`` (the CPU path, its backward by hand) against ``attnres_mix_reference``: the output and
    the grads of every entry, the key norm weight and the query; fp32, bf16 and mixed entries (each grad in its
    entry's dtype, the output in the last's), widths that are not powers of two, no rows."""
    case = _mix_case(N, lead, D, dtypes)
    got = _values_and_grads(attnres_mix_torch, *case)
    ref = _values_and_grads(attnres_mix_reference, *case)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and g.dtype == r.dtype, (i, g.dtype, r.dtype)
        if r.dtype == torch.bfloat16:   # the same fp32 math in another order, rounded once: within a bf16 step
            assert bool(((g.double() - r.double()).abs() <= r.double().abs() * 2 ** -7 + 1e-6).all()), i
        else:
            assert rel_rms(r, g) < 1e-6 or r.numel() == 0, (i, rel_rms(r, g))


def test_the_hand_written_cpu_mix_passes_gradcheck_and_skips_what_needs_no_grad():
    """fp64 gradcheck of every input; entries or parameters without grad get none (and the others are unchanged)."""
    entries, knw, query, _ = _mix_case(3, (2, 3), 8, (torch.float64,), param_dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda k, q, *e: attnres_mix_torch(list(e), k, q, 1e-5), (knw, query, *entries))
    entries, knw, query, grad = _mix_case(3, (2, 3), 16, (torch.float32,))
    full = _values_and_grads(attnres_mix_torch, entries, knw, query, grad)
    entries[1].requires_grad_(False)
    query.requires_grad_(False)
    part = _values_and_grads(attnres_mix_torch, entries, knw, query, grad)
    assert len(part) == len(full) - 2
    for g, r in zip(part, [full[0], full[1], full[3], full[4]]):
        assert torch.equal(g, r)


def test_the_module_takes_the_hand_written_path_off_cuda():
    mix = AttnResMix(16)
    torch.nn.init.normal_(mix.key_norm_weight)
    torch.nn.init.normal_(mix.query)
    entries = [torch.randn(2, 3, 16, requires_grad=True) for _ in range(2)]
    out = mix(entries)
    assert type(out.grad_fn).__name__ == "_AttnResMixTorchBackward"
    torch.testing.assert_close(out, attnres_mix_reference(entries, mix.key_norm_weight, mix.query, mix.eps))
