import dataclasses

import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.attnres import AttnResMix
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
