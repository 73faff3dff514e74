"""The model runner's decode graph body, run eagerly on the CPU: a batch padded to a larger bucket computes what
the plain batch computes and leaves every live cache row as the plain batch leaves it (the padding rows touch only
the scratch rows). The capture itself needs CUDA: ``benchmarks/serve_gpu.py`` checks graphs against eager there."""

import pytest
import torch

from kimik3.serve.memory import EngineConfig, plan_cache
from kimik3.serve.model_runner import BUCKETS, graph_buckets
from kimik3.serve.scheduler import EngineCore
from kimik3.serve.types import GenerationRequest, SamplingParams
from tests.serve.test_engine import prompts


def pool_tensors(core):
    cache = core.cache
    return list(cache.latents.tensors) + list(cache.states.conv) + list(cache.states.recurrent)


def live_rows(core, seqs):
    """The parts of every pool that belong to live sequences (their blocks and slots), flattened."""
    blocks = sorted({b for seq in seqs for b in seq.blocks})
    slots = sorted(seq.slot for seq in seqs)
    cache = core.cache
    out = [t[blocks] for t in cache.latents.tensors]
    out += [t[slots] for t in list(cache.states.conv) + list(cache.states.recurrent)]
    return out


def test_the_padded_graph_body_matches_the_plain_decode_and_spares_live_rows(serve_model, serve_tokenizer):
    config = EngineConfig(memory_bytes=48 * 2**20, max_running=8, checkpoints=0, prefill_chunk=64, max_context=512)
    core = EngineCore(serve_model, serve_tokenizer, config)
    for i, prompt in enumerate(prompts(3, 21, seed=4)):
        core.add(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=50, temperature=0.0)), lambda e: None)
    while any(seq.prefilling for seq in core.running) or core.waiting:
        core.step()
    core.step()                                   # ragged lengths: every row has decoded at least once
    seqs = list(core.running)
    assert len(seqs) == 3 and len({seq.computed for seq in seqs}) == 3
    before = [t.clone() for t in pool_tensors(core)]

    plain = core.runner.decode(seqs).clone()       # no graphs on the CPU: the eager forward on 3 rows
    after_plain = [t.clone() for t in live_rows(core, seqs)]

    for tensor, saved in zip(pool_tensors(core), before):
        tensor.copy_(saved)
    runner = core.runner
    runner._prepare_static(8)
    runner._stage(seqs, 8)
    staged = runner._staging[:8]
    assert staged[3:, 1].eq(-1).all() and staged[3:, 2].eq(0).all()
    assert staged[3:, 3:].eq(core.cache.latents.scratch_block).all()
    padded = runner._graph_body(8)
    torch.testing.assert_close(padded[:3], plain, rtol=1e-5, atol=1e-5)
    for got, want in zip(live_rows(core, seqs), after_plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_graph_buckets_cover_every_batch_up_to_max_running():
    for max_running in (1, 3, 8, 33, 64, 200, 512, 600):
        buckets = graph_buckets(max_running)
        assert buckets == sorted(set(buckets)) and buckets[-1] >= max_running
        for batch in range(1, max_running + 1):
            smallest = next(b for b in buckets if b >= batch)
            assert smallest < 2 * batch + 8   # never more than about twice the work
    assert graph_buckets(8)[-1] == 8 and graph_buckets(600) == [b for b in BUCKETS] + [600]


def test_gpu_memory_utilization_is_checked_and_the_layout_describes_itself(serve_model):
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    config = EngineConfig(memory_bytes=48 * 2**20, max_running=8, checkpoints=4, max_context=512)
    layout = plan_cache(serve_model.config, config, torch.float32)
    assert layout.total_bytes <= config.memory_bytes
    line = layout.describe(config.physical_block, config.max_running, 512)
    assert f"{layout.num_blocks} MLA blocks" in line and "up to 8 sequences" in line
