import dataclasses

import pytest

from kimik3 import K3Config, K3ForCausalLM, param_counts
from kimik3.cli import main
from kimik3.model.moe import RoutedExperts


def test_k3_totals_match_the_report():
    counts = param_counts(K3Config.preset("k3"))
    assert counts["total"] == pytest.approx(2.78e12, rel=5e-3)
    assert counts["active"] == pytest.approx(104.2e9, rel=5e-3)
    assert counts["routed_expert"] == pytest.approx(33.0e6, rel=5e-3)
    assert counts["routed_per_layer"] == pytest.approx(29.6e9, rel=5e-3)
    assert counts["moe_routed_experts"] == pytest.approx(2.72e12, rel=5e-3)
    assert counts["routed_fraction"] == pytest.approx(0.98, abs=0.005)


def _meta_counts(config):
    model = K3ForCausalLM(config, device="meta")
    main_params = {n: p for n, p in model.named_parameters() if not n.startswith("mtp.")}
    total = sum(p.numel() for p in main_params.values())
    mtp = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    routed = sum(p.numel() for m in model.layers.modules() if isinstance(m, RoutedExperts) for p in m.parameters())
    idle = routed * (1 - config.moe.top_k / config.moe.num_experts)
    embed = 0 if config.tie_embeddings else model.embed.weight.numel()
    return total, mtp, round(total - idle - embed)


def _variants():
    tiny = K3Config.preset("tiny")
    yield tiny
    yield K3Config.preset("debug")
    yield K3Config.preset("k3")
    yield dataclasses.replace(tiny, tie_embeddings=True)
    yield dataclasses.replace(tiny, attn_res=dataclasses.replace(tiny.attn_res, enabled=False))
    yield dataclasses.replace(tiny, mtp=dataclasses.replace(tiny.mtp, num_modules=0), dense_layers=3)


@pytest.mark.parametrize("config", list(_variants()), ids=lambda c: c.name)
def test_analytic_counts_equal_the_meta_model(config):
    total, mtp, active = _meta_counts(config)
    counts = param_counts(config)
    assert counts["total"] == total
    assert counts["mtp"] == mtp
    assert counts["active"] == active


def test_k3_builds_on_meta_without_memory():
    model = K3ForCausalLM(K3Config.preset("k3"), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.layers[5].ffn.experts.w_gate_ELF.shape == (896, 3584, 3072)


def test_cli_params_prints_totals(capsys):
    assert main(["params", "k3"]) == 0
    out = capsys.readouterr().out
    assert "2.78T" in out and "104.19B" in out and "33.03M" in out
    assert main(["params", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
