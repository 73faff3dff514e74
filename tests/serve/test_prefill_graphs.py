"""Prefill chunks replayed as piecewise CUDA graphs (``serve/piecewise.py``, ``ModelRunner``) against the same
engine with ``enforce_eager``: every chunk (the first of a prompt and the later ones, which attend over the cached
latents between the graphs; a short last one, padded to the smallest captured size) gives the eager chunk's logits
and leaves the caches as it does, and greedy generation is token for token the same. GPU only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3 import K3ForCausalLM
from kimik3.serve.memory import EngineConfig
from kimik3.serve.scheduler import EngineCore
from kimik3.serve.types import GenerationRequest, SamplingParams
from tests.numerics import away_from_init
from tests.serve.test_engine import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CHUNK = 64


def _core(model, tokenizer, eager: bool) -> EngineCore:
    config = EngineConfig(memory_bytes=64 * 2**20, max_running=4, checkpoints=0, prefill_chunk=CHUNK,
                          max_context=512, enforce_eager=eager)
    return EngineCore(model, tokenizer, config)


@pytest.fixture(scope="module")
def cuda_model(serve_model):
    return away_from_init(K3ForCausalLM(serve_model.config, device="cuda", seed=0).eval())


def _prefill_logits(core: EngineCore, prompt: list[int]) -> list[torch.Tensor]:
    """Every chunk's logits of one prompt, driven through the runner as the scheduler drives it."""
    core.add(GenerationRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0)), lambda e: None)
    core._admit()
    seq = core.running[0]
    out = []
    with torch.no_grad():
        while seq.computed < seq.prompt_len:
            end = min(seq.computed + CHUNK, seq.prompt_len)
            out.append(core.runner.prefill(seq, end).float().clone())
            seq.computed = end
    return out


def test_full_chunks_replay_the_graphs_and_match_eager(cuda_model, serve_tokenizer):
    prompt = prompts(1, 3 * CHUNK + 9, seed=3)[0]
    graphs = _core(cuda_model, serve_tokenizer, eager=False)
    eager = _core(cuda_model, serve_tokenizer, eager=True)
    assert sorted(graphs.runner.prefill_graphs) == [16, 32, 64] and not eager.runner.prefill_graphs
    replays = []
    for size, graph in graphs.runner.prefill_graphs.items():
        graph.run = lambda seq, end, size=size, real=graph.run: replays.append((size, end)) or real(seq, end)
    got, want = _prefill_logits(graphs, prompt), _prefill_logits(eager, prompt)
    # The 9-token last chunk is padded to 16 (in both engines).
    assert replays == [(64, CHUNK), (64, 2 * CHUNK), (64, 3 * CHUNK), (16, 3 * CHUNK + 9)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    seq_g, seq_e = graphs.running[0], eager.running[0]
    for pool_g, pool_e in zip(graphs.cache.latents.tensors, eager.cache.latents.tensors):
        torch.testing.assert_close(pool_g[seq_g.blocks], pool_e[seq_e.blocks], rtol=0, atol=0)
    for pool_g, pool_e in zip(list(graphs.cache.states.recurrent) + list(graphs.cache.states.conv),
                              list(eager.cache.states.recurrent) + list(eager.cache.states.conv)):
        torch.testing.assert_close(pool_g[seq_g.slot], pool_e[seq_e.slot], rtol=0, atol=0)


def test_greedy_generation_is_the_same_with_and_without_graphs(cuda_model, serve_tokenizer):
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts(4, 2 * CHUNK - 3, seed=5))]
    tokens = {}
    for eager in (False, True):
        core = _core(cuda_model, serve_tokenizer, eager)
        out: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for r in requests:
            core.add(dataclasses.replace(r), lambda e, rid=r.request_id: out[rid].append(e.token_id)
                     if e.token_id is not None else None)
        while core.has_work():
            core.step()
        tokens[eager] = out
    assert tokens[False] == tokens[True] and all(len(t) == 12 for t in tokens[False].values())
