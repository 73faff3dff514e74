"""The model runner's decode graph body, run eagerly on the CPU: a batch padded to a larger bucket computes what
the plain batch computes and leaves every live cache row as the plain batch leaves it (the padding rows touch only
the scratch rows). The capture itself needs CUDA: ``benchmarks/serve_gpu.py`` checks graphs against eager there."""

import pytest
import torch

from kimik3.serve.memory import EngineConfig, plan_cache
from kimik3.serve.model_runner import BUCKETS, PREFILL_MIN, ModelRunner, graph_buckets, prefill_sizes
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_padded_prefill_chunk_computes_what_the_plain_one_does(serve_model, serve_tokenizer, device):
    # The padded forward the GPU runs (graphs or eager), run eagerly: the logits at the last real token, the KDA
    # states and the latents of the real tokens are those of the unpadded chunk, whatever the padding ids. On CUDA
    # the Triton kernels (conv, KDA) see the padding; fp32 weights there too.
    model = serve_model
    if device == "cuda":
        model = type(serve_model)(serve_model.config, device="cuda", dtype=torch.float32)
        model.load_state_dict(serve_model.state_dict())
    config = EngineConfig(memory_bytes=48 * 2**20, max_running=2, checkpoints=0, prefill_chunk=64, max_context=512,
                          enforce_eager=True)
    cores = [EngineCore(model, serve_tokenizer, config) for _ in range(2)]
    prompt = prompts(1, 75, seed=9)[0]
    logits = []
    for padded, core in zip((False, True), cores):
        core.add(GenerationRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0)), lambda e: None)
        core._admit()
        seq = core.running[0]
        runner = core.runner
        with torch.no_grad():
            runner.prefill_sizes = []            # unpadded chunks: a first one of 64, then the 11-token rest
            runner.prefill(seq, 64)
            seq.computed = 64
            if padded:
                row = torch.from_numpy(runner._prefill_row(seq, 75, 32)).to(device)
                row[11:32] = torch.arange(21) + 100   # padding ids are arbitrary
                logits.append(runner._prefill_forward(row, 32, 64)[0].clone())
            else:
                logits.append(runner.prefill(seq, 75).clone())
    tol = 1e-4 if device == "cpu" else 3e-3   # the KDA kernels' fp32 dots run in TF32 on a GPU
    torch.testing.assert_close(logits[1], logits[0], rtol=tol, atol=tol)
    seqs = [core.running[0] for core in cores]
    for states in zip(*(list(c.cache.states.recurrent) + list(c.cache.states.conv) for c in cores)):
        torch.testing.assert_close(states[1][seqs[1].slot], states[0][seqs[0].slot], rtol=tol, atol=tol / 10)
    for pools in zip(*(c.cache.latents.tensors for c in cores)):
        flat = [pool[seq.blocks].reshape(-1, pool.shape[-1])[:75] for pool, seq in zip(pools, seqs)]
        torch.testing.assert_close(flat[1], flat[0], rtol=tol, atol=tol / 10)


def test_prefill_sizes_double_up_to_the_chunk():
    assert prefill_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_sizes(100) == [16, 32, 64, 100] and prefill_sizes(PREFILL_MIN) == [PREFILL_MIN]


def test_several_prefill_chunks_in_one_forward_compute_what_each_alone_does(serve_model, serve_tokenizer):
    # Rows of different cached lengths (0, 20, 48) and chunk lengths (37, 55, 5): right-padded to 55 in one forward,
    # they give each row's logits, KDA states and latents as its own unpadded chunk does.
    config = EngineConfig(memory_bytes=48 * 2**20, max_running=4, checkpoints=0, prefill_chunk=64, max_context=512)
    cores = [EngineCore(serve_model, serve_tokenizer, config) for _ in range(2)]
    starts, ends = [0, 20, 48], [37, 75, 53]
    for core in cores:
        for i, prompt in enumerate(prompts(3, 80, seed=13)):
            core.add(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0)),
                     lambda e: None)
        core._admit()
        assert core.runner.prefill_rows == 4
        with torch.no_grad():
            for seq, start in zip(core.running, starts):
                if start:
                    core.runner.prefill(seq, start)
                    seq.computed = start
    with torch.no_grad():
        together = cores[0].runner.prefill_many(cores[0].running, ends).clone()
        alone = torch.cat([cores[1].runner.prefill(seq, end).clone() for seq, end in zip(cores[1].running, ends)])
    assert together.shape == (3, serve_model.config.vocab_size)
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
    for seqs, core in zip(([c.running for c in cores]), cores):
        for seq, end in zip(seqs, ends):
            seq.computed = end
    for pools in zip(*(list(c.cache.states.recurrent) + list(c.cache.states.conv) for c in cores)):
        for a, b in zip(cores[0].running, cores[1].running):
            torch.testing.assert_close(pools[0][a.slot], pools[1][b.slot], rtol=1e-4, atol=1e-5)
    for pools in zip(*(c.cache.latents.tensors for c in cores)):
        for a, b, end in zip(cores[0].running, cores[1].running, ends):
            flat = [pool[seq.blocks].reshape(-1, pool.shape[-1])[:end] for pool, seq in zip(pools, (a, b))]
            torch.testing.assert_close(flat[0], flat[1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="prefills 4 at a time"):
        cores[0].runner.prefill_many(cores[0].running * 2, ends * 2)


def test_a_step_prefills_as_many_sequences_as_fit_the_chunk(serve_model, serve_tokenizer, monkeypatch):
    # prefill_chunk 64 padded tokens: prompts of 20 tokens go three to a forward (3 x 20 <= 64 < 4 x 20), and the
    # engine's greedy tokens are those of one sequence at a time.
    outputs = []
    for rows in (None, 1):
        config = EngineConfig(memory_bytes=48 * 2**20, max_running=8, checkpoints=0, prefill_chunk=64, max_context=512)
        core = EngineCore(serve_model, serve_tokenizer, config)
        if rows is not None:
            monkeypatch.setattr(ModelRunner, "prefill_rows", property(lambda self: rows))
        calls = []
        many = core.runner.prefill_many
        core.runner.prefill_many = lambda seqs, ends: calls.append(len(seqs)) or many(seqs, ends)
        events = {}
        for i, prompt in enumerate(prompts(7, 20, seed=21)):
            core.add(GenerationRequest(f"r{i}", prompt[:20], SamplingParams(max_tokens=6, temperature=0.0)),
                     lambda e: events.setdefault(e.request_id, []).append(e.token_id))
        while core.has_work():
            core.step()
        outputs.append(events)
        assert calls == ([3, 3, 1] if rows is None else [1] * 7)
    assert outputs[0] == outputs[1]
