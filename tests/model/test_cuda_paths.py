"""The model on CUDA, where every fused kernel runs (glue, router selection, conv and KDA decode steps, the packed
projections), against the same model on the CPU, where the torch references run: fp32 weights, a prefill and
single-token decode steps through the hybrid cache, and a training step's gradients. GPU only."""

from __future__ import annotations

import pytest
import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.cache import K3Cache
from kimik3.model.fused_linear import pack_projections
from tests.numerics import away_from_init, rel_rms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _models():
    config = K3Config.preset("tiny")
    cpu = away_from_init(K3ForCausalLM(config, seed=0))
    gpu = K3ForCausalLM(config, seed=0).cuda()
    gpu.load_state_dict(cpu.state_dict())
    return config, cpu, gpu


def test_prefill_and_decode_match_the_cpu_references():
    config, cpu, gpu = _models()
    pack_projections(gpu)
    ids = torch.randint(0, config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    caches = {m: K3Cache.allocate(config, 3, 32, device=m.device) for m in (cpu, gpu)}
    with torch.no_grad():
        for a, b in ((0, 16), (16, 17), (17, 18), (18, 20)):   # prefill, two decode steps, a 2-token chunk
            ref = cpu(ids[:, a:b], cache=caches[cpu]).logits
            got = gpu(ids[:, a:b].cuda(), cache=caches[gpu]).logits.cpu()
            assert rel_rms(ref, got) < 2e-3, (a, b, rel_rms(ref, got))


def test_training_gradients_match_the_cpu_references():
    config, cpu, gpu = _models()
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    cpu(ids, labels=ids).loss.backward()
    gpu(ids.cuda(), labels=ids.cuda()).loss.backward()
    gpu_grads = dict(gpu.named_parameters())
    for name, p in cpu.named_parameters():
        if p.grad is not None:
            err = rel_rms(p.grad, gpu_grads[name].grad.cpu())
            assert err < 5e-3, (name, err)
