"""A quantisation-aware model (``moe.expert_quant = "mxfp4"``) served packed: the engine stores its routed experts
as MXFP4 codes + scales (``RoutedExperts.pack_mxfp4``), frees the full-precision copies, and generates the greedy
tokens the fake-quantised model generates."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3 import K3ForCausalLM
from kimik3.model.moe import RoutedExperts
from kimik3.serve.types import SamplingParams
from tests.serve.test_engine import assert_no_leak, make_engine, prompts, reference


@pytest.fixture(scope="module")
def qat_model(serve_model):
    config = dataclasses.replace(serve_model.config,
                                 moe=dataclasses.replace(serve_model.config.moe, expert_quant="mxfp4"))
    model = K3ForCausalLM(config, device="cpu", dtype=torch.float32, seed=0).eval()
    for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
        for w in experts.parameters():   # away from the init's scale, so the rounding moves the outputs visibly
            w.data.normal_(0.0, 0.5)
    return model


def test_the_engine_serves_packed_experts_with_the_fake_quantised_greedy_tokens(qat_model, serve_tokenizer):
    batch = prompts(2, 19, seed=3)
    expected = [reference(qat_model, prompt, 8) for prompt in batch]
    served = K3ForCausalLM(qat_model.config, device="cpu", dtype=torch.float32, seed=0).eval()
    served.load_state_dict(qat_model.state_dict())
    full_bytes = sum(p.numel() * p.element_size() for m in served.modules() if isinstance(m, RoutedExperts)
                     for p in m.parameters())
    engine = make_engine(served, serve_tokenizer, checkpoints=0)
    try:
        experts = [m for m in served.modules() if isinstance(m, RoutedExperts)]
        assert experts and all(m.packed is not None and m.w_gate_ELF.is_meta for m in experts)
        packed_bytes = engine.core.runner.packed_expert_bytes
        assert packed_bytes == sum(mx.nbytes for m in experts for mx in m.packed.values())
        assert full_bytes / packed_bytes == pytest.approx(32 / 4.25)   # fp32 weights: 32 bits vs 4.25
        for prompt, want in zip(batch, expected, strict=True):
            tokens, _ = engine.complete(prompt, SamplingParams(max_tokens=8, temperature=0.0))
            assert tokens == want
        assert_no_leak(engine)
    finally:
        engine.close()


def test_packing_needs_quantisation_aware_experts_and_then_matches_them():
    torch.manual_seed(0)
    plain = RoutedExperts(4, 64, 32)
    with pytest.raises(ValueError, match="quant='mxfp4'"):
        plain.pack_mxfp4()
    module = RoutedExperts(4, 64, 32, quant="mxfp4")
    for w in module.parameters():
        torch.nn.init.normal_(w, std=0.5)
    x = torch.randn(9, 64)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    with torch.no_grad():
        fake = module(x, weights, ids)
        module.pack_mxfp4()
        packed = module(x, weights, ids)
    torch.testing.assert_close(packed, fake, rtol=1e-6, atol=1e-6)


def test_gate_and_up_are_held_as_one_matmul_and_written_through_their_views():
    """The packed gate and up weights are views of one [E, L, 2F] tensor (one matmul reads both); a weight update
    written into them (a rollout's) is what the next forward multiplies; moving keeps them one tensor."""
    torch.manual_seed(1)
    module = RoutedExperts(4, 64, 32, quant="mxfp4")
    other = RoutedExperts(4, 64, 32, quant="mxfp4")
    for w in [*module.parameters(), *other.parameters()]:
        torch.nn.init.normal_(w, std=0.5)
    x, ids, weights = torch.randn(7, 64), torch.randint(0, 4, (7, 2)), torch.rand(7, 2)
    with torch.no_grad():
        expected = other(x, weights, ids)
        module.pack_mxfp4()
        other.pack_mxfp4()
        module.move_packed(torch.device("cpu"))
        fused = module.packed_gate_up
        assert fused.shape == (4, 64, 64) and fused.codes.shape == (4, 64, 32)
        for name, half in (("w_gate_ELF", 0), ("w_up_ELF", 1)):
            view = module.packed[name]
            assert view.shape == (4, 64, 32)
            assert view.codes.data_ptr() == fused.codes[:, 32 * half].data_ptr()
        for name, mx in other.packed.items():
            module.packed[name].codes.copy_(mx.codes)
            module.packed[name].scales.copy_(mx.scales)
        torch.testing.assert_close(module(x, weights, ids), expected, rtol=0, atol=0)
