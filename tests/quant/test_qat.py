"""Quantisation-aware routed experts (``kimik3.quant.qat``, ``moe.expert_quant``): the forward is the expert
formula on MXFP4 weights and MXFP8 inputs, the gradients pass straight through the rounding, and the setting
travels with the config (``--qat`` included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.ffn import situ_glu_cast
from kimik3.model.moe import RoutedExperts
from kimik3.quant import fake_quantize
from kimik3.quant.qat import fake_quantize_ste
from kimik3.train.args import TrainArgs, resolve_model_config


def test_straight_through_gradient():
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    y = fake_quantize_ste(x, "mxfp4")
    assert torch.equal(y, fake_quantize(x.detach(), "mxfp4"))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_quantised_experts_equal_the_per_token_formula_and_its_gradients():
    torch.manual_seed(0)
    experts, latent, hidden, tokens, top_k = 5, 64, 96, 11, 2
    module = RoutedExperts(experts, latent, hidden, quant="mxfp4").double()
    for w in module.parameters():
        torch.nn.init.normal_(w, std=0.3)
    x = torch.randn(tokens, latent, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, dtype=torch.float64)
    out = module(x, weights, ids)

    # The reference: each (token, expert) pair alone, on the quantised weights as leaves of their own.
    wq = {name: fake_quantize(getattr(module, name).detach(), "mxfp4", axis=-2).requires_grad_()
          for name in ("w_gate_ELF", "w_up_ELF", "w_down_EFL")}
    xr = x.detach().clone().requires_grad_()
    rows = []
    for t in range(tokens):
        acc = torch.zeros(latent, dtype=torch.float64)
        xq = fake_quantize_ste(xr[t:t + 1], "mxfp8_e4m3")
        for k in range(top_k):
            e = int(ids[t, k])
            # (the SiTU-GLU in fp32, as the layer computes it)
            h = situ_glu_cast(xq @ wq["w_gate_ELF"][e], xq @ wq["w_up_ELF"][e], weights[t, k:k + 1],
                              torch.float64)
            acc = acc + (fake_quantize_ste(h, "mxfp8_e4m3") @ wq["w_down_EFL"][e])[0]
        rows.append(acc)
    ref = torch.stack(rows)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # Not the unquantised result: the quantisation is really applied.
    plain = RoutedExperts(experts, latent, hidden).double()
    plain.load_state_dict(module.state_dict())
    assert (plain(x.detach(), weights, ids) - ref).abs().max() > 1e-3

    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-10)
    for name, leaf in wq.items():
        torch.testing.assert_close(getattr(module, name).grad, leaf.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_the_setting_travels_with_the_config_and_the_train_args(tmp_path):
    tiny = K3Config.preset("tiny")
    config = resolve_model_config(TrainArgs(qat="mxfp4"))
    assert config.moe.expert_quant == "mxfp4" and resolve_model_config(TrainArgs()).moe.expert_quant is None
    model = K3ForCausalLM(config, seed=0)
    assert all(moe.experts.quant == "mxfp4" for moe in model.modules() if hasattr(moe, "experts"))
    model.save_pretrained(tmp_path / "m")
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.moe.expert_quant == "mxfp4"
    ids = torch.randint(0, tiny.vocab_size, (1, 40))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="moe.expert_quant"):
        dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, expert_quant="int4")).validate()
    with pytest.raises(ValueError, match="multiple of the 32-element MX block"):
        dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, expert_quant="mxfp4", latent_dim=48)).validate()
    with pytest.raises(ValueError, match="--qat must be mxfp4"):
        TrainArgs(qat="nvfp4").validate()


def test_packed_checkpoints_load_packed_and_give_the_fake_quantised_logits(tmp_path):
    from kimik3.model.moe import RoutedExperts

    config = resolve_model_config(TrainArgs(qat="mxfp4"))
    model = K3ForCausalLM(config, seed=0).eval()
    model.save_pretrained(tmp_path / "full")
    model.save_pretrained(tmp_path / "packed", pack_experts=True)
    full_bytes = (tmp_path / "full" / "model.safetensors").stat().st_size
    packed_bytes = (tmp_path / "packed" / "model.safetensors").stat().st_size
    assert packed_bytes < full_bytes   # the experts at 4.25 bits instead of fp32's 32

    loaded = K3ForCausalLM.from_pretrained(tmp_path / "packed")
    layers = [m for m in loaded.modules() if isinstance(m, RoutedExperts)]
    assert layers and all(m.packed is not None and m.w_gate_ELF.is_meta for m in layers)
    assert not any(p.is_meta for p in loaded.parameters())   # everything else allocated and loaded
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    # `kimik3 convert --layout kimik3 --pack-experts` writes the same file.
    from kimik3.cli import main

    assert main(["convert", str(tmp_path / "full"), str(tmp_path / "converted"), "--layout", "kimik3",
                 "--pack-experts"]) == 0
    assert (tmp_path / "converted" / "model.safetensors").read_bytes() == \
        (tmp_path / "packed" / "model.safetensors").read_bytes()
    assert main(["convert", str(tmp_path / "full"), str(tmp_path / "as-hf"), "--pack-experts"]) == 2
    # A packed model saves packed again, the same bytes.
    loaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
        (tmp_path / "packed" / "model.safetensors").read_bytes()

    unquantised = K3ForCausalLM(K3Config.preset("tiny"), seed=0)
    with pytest.raises(ValueError, match="no moe.expert_quant"):
        unquantised.save_pretrained(tmp_path / "nope", pack_experts=True)
    with pytest.raises(ValueError, match="kimik3 layout only"):
        model.save_pretrained(tmp_path / "hf", layout="hf", pack_experts=True)
    # Packed experts in a checkpoint whose config does not quantise them are refused, naming the file.
    (tmp_path / "packed" / "config.json").write_text(K3Config.preset("tiny").to_json())
    with pytest.raises(ValueError, match=r"model.safetensors: layer .* is stored as MXFP4"):
        K3ForCausalLM.from_pretrained(tmp_path / "packed")
