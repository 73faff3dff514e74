"""The serving engine against the plain model: same greedy tokens, prefix hits that skip work,
admission control, aborts, and no leaked cache."""

import asyncio

import pytest
import torch

from kimik3.serve.engine import LLMEngine
from kimik3.serve.memory import EngineConfig
from kimik3.serve.router import ReplicaRouter
from kimik3.serve.types import AdmissionRejected, GenerationRequest, RequestTooLong, SamplingParams

GREEDY = dict(temperature=0.0)


def make_engine(model, tokenizer, **overrides) -> LLMEngine:
    settings = dict(memory_bytes=64 * 2**20, hash_block=16, physical_block=192, max_running=8,
                    checkpoints=16, prefill_chunk=64, max_context=1024)
    settings.update(overrides)
    return LLMEngine(model, tokenizer, EngineConfig(**settings), model_name="tiny-test")


def reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), n, temperature=0.0)
    return out[0, len(prompt):].tolist()


def prompts(count, length, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length + 7 * i,), generator=g).tolist() for i in range(count)]


def assert_no_leak(engine: LLMEngine):
    core = engine.core
    with engine._lock:
        core.prefix_cache.clear()
        assert not core.running and not core.waiting
        assert core.cache.allocator.num_used == 0, "MLA blocks leaked"
        assert core.cache.states.num_free == core.cache.states.num_slots, "KDA slots leaked"


class Counting:
    """Counts the tokens the model is asked to compute."""

    def __init__(self, model):
        self.tokens = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.tokens += args[0].numel()


def test_ragged_batched_decode_matches_single_sequence_generation(serve_model, serve_tokenizer):
    engine = make_engine(serve_model, serve_tokenizer, checkpoints=0)
    try:
        batch = prompts(5, 23)
        results = {}

        def run(i):
            results[i] = engine.complete(batch[i], SamplingParams(max_tokens=12, **GREEDY), request_id=f"r{i}")

        import threading
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, prompt in enumerate(batch):
            tokens, final = results[i]
            assert final.finish_reason == "length" and final.usage.completion_tokens == 12
            assert tokens == reference(serve_model, prompt, 12), f"request {i} diverged"
        assert_no_leak(engine)
    finally:
        engine.close()


def test_prefix_cache_keeps_greedy_outputs_and_skips_the_cached_prefix(serve_model, serve_tokenizer):
    """A multi-turn session: each turn's prompt extends the last prompt + reply. With the cache the
    outputs are identical, later turns report cached tokens, and they compute fewer tokens."""
    system = prompts(1, 70, seed=3)[0]
    turns = prompts(4, 20, seed=4)
    outputs, cached, computed = {}, {}, {}
    for mode, checkpoints in (("off", 0), ("on", 16)):
        engine = make_engine(serve_model, serve_tokenizer, checkpoints=checkpoints)
        counter = Counting(serve_model)
        try:
            history = list(system)
            outputs[mode], cached[mode] = [], []
            for i, user in enumerate(turns):
                history += user
                request = GenerationRequest(f"{mode}{i}", list(history), SamplingParams(max_tokens=9, **GREEDY),
                                            boundary_hints=[len(system), len(history)])
                tokens = []
                for event in engine.generate_blocking(request):
                    if event.token_id is not None:
                        tokens.append(event.token_id)
                    final = event
                outputs[mode].append(tokens)
                cached[mode].append(final.usage.cached_tokens)
                history += tokens
            computed[mode] = counter.tokens
            assert_no_leak(engine)
        finally:
            counter.handle.remove()
            engine.close()
    assert outputs["on"] == outputs["off"]
    assert cached["off"] == [0, 0, 0, 0]
    assert all(c > 0 for c in cached["on"][1:]), cached["on"]
    assert all(c % 16 == 0 for c in cached["on"])
    assert computed["on"] == computed["off"] - sum(cached["on"])


def test_a_hit_inside_a_physical_block_recomputes_nothing_before_it(serve_model, serve_tokenizer):
    """The seed's token-2560 example scaled down (hash block 16, physical block 192): a prompt
    sharing the first 80 tokens restores at 80, mid-block, and computes only what follows."""
    engine = make_engine(serve_model, serve_tokenizer)
    counter = Counting(serve_model)
    try:
        shared = prompts(1, 80, seed=5)[0]
        first = shared + prompts(1, 40, seed=6)[0]
        second = shared + prompts(1, 33, seed=7)[0]
        request = GenerationRequest("a", first, SamplingParams(max_tokens=2, **GREEDY), boundary_hints=[80])
        list(engine.generate_blocking(request))
        before = counter.tokens
        tokens, final = engine.complete(second, SamplingParams(max_tokens=4, **GREEDY), request_id="b")
        assert final.usage.cached_tokens == 80
        assert 80 % 192 != 0
        # prefill computes len(second) - 80 tokens, then 3 decode steps of one token
        assert counter.tokens - before == len(second) - 80 + 3
        assert tokens == reference(serve_model, second, 4)
        assert_no_leak(engine)
    finally:
        counter.handle.remove()
        engine.close()


def test_admission_waits_for_memory_and_refuses_past_the_queue_limit(serve_model, serve_tokenizer):
    # Room for about two 200-token requests' blocks at a time: the rest wait, then run.
    engine = make_engine(serve_model, serve_tokenizer, memory_bytes=8 * 2**20, max_running=2, checkpoints=0,
                         max_waiting=3, max_context=400)
    try:
        with pytest.raises(RequestTooLong, match="exceeds the context"):
            engine.submit(GenerationRequest("long", [1] * 399, SamplingParams(max_tokens=2)), lambda e: None)
        events = []
        with engine._lock:     # hold the worker so that no step runs while we queue
            # The fourth overflows the queue of 3, so admission is tried: two start (max_running=2)
            # and two are left waiting; one more fills the queue; the sixth cannot start: 429.
            for i in range(5):
                engine.core.add(GenerationRequest(f"q{i}", prompts(1, 150, seed=i)[0],
                                                  SamplingParams(max_tokens=3, **GREEDY)), events.append)
            assert len(engine.core.running) == 2 and len(engine.core.waiting) == 3
            with pytest.raises(AdmissionRejected, match="waiting"):
                engine.core.add(GenerationRequest("q5", [1, 2, 3], SamplingParams(max_tokens=3)), events.append)
            engine._lock.notify_all()
        deadline = 200
        while sum(e.finished for e in events) < 5 and deadline:
            asyncio.run(asyncio.sleep(0.05))
            deadline -= 1
        assert sum(e.finished for e in events) == 5
        assert engine.stats().rejected == 1
        assert_no_leak(engine)
    finally:
        engine.close()


def test_abort_and_closed_stream_free_the_cache(serve_model, serve_tokenizer):
    engine = make_engine(serve_model, serve_tokenizer)

    async def consume_two_then_leave():
        stream = engine.generate(GenerationRequest("gone", prompts(1, 40)[0], SamplingParams(max_tokens=500)))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()
        return seen

    try:
        assert asyncio.run(consume_two_then_leave()) == 2
        for _ in range(100):
            if not engine.core.has_work():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert_no_leak(engine)
    finally:
        engine.close()


def test_sampling_with_a_seed_is_reproducible_and_stop_strings_end_the_stream(serve_model, serve_tokenizer):
    engine = make_engine(serve_model, serve_tokenizer)
    try:
        prompt = prompts(1, 30)[0]
        params = dict(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=11)
        a, _ = engine.complete(prompt, SamplingParams(**params), request_id="s1")
        b, _ = engine.complete(prompt, SamplingParams(**params), request_id="s2")
        assert a == b
        text = serve_tokenizer.decode(a)
        stop = text[len(text) // 2: len(text) // 2 + 2]
        if stop.strip() and "\ufffd" not in stop:
            request = GenerationRequest("s3", prompt, SamplingParams(**params, stop=[stop]))
            streamed = "".join(e.text for e in engine.generate_blocking(request))
            assert streamed == text[:text.index(stop)]
    finally:
        engine.close()


def test_router_sends_a_session_back_to_the_replica_holding_its_prefix(serve_model, serve_tokenizer, monkeypatch):
    replicas = [make_engine(serve_model, serve_tokenizer) for _ in range(2)]
    router = ReplicaRouter(replicas, slack=2)
    try:
        history = prompts(1, 60, seed=9)[0]
        request = GenerationRequest("warm", history, SamplingParams(max_tokens=3, **GREEDY), boundary_hints=[48])
        list(replicas[1].generate_blocking(request))            # replica 1 now holds the prefix
        follow_up = history + [5] * 20
        assert replicas[1].prefix_match(follow_up) == 48 and replicas[0].prefix_match(follow_up) == 0
        assert router.choose(follow_up) == 1 and router.affinity_hits == 1
        assert router.choose(prompts(1, 30, seed=10)[0]) == 0     # cold: the least loaded (first on ties)

        busy = replicas[1].stats()
        busy.running = 3
        monkeypatch.setattr(replicas[1], "stats", lambda: busy)
        assert router.choose(follow_up) == 0                      # overloaded holder: go elsewhere
        monkeypatch.undo()

        async def turn():
            events = [e async for e in router.generate(GenerationRequest("t", follow_up, SamplingParams(max_tokens=3)))]
            return events[-1]
        final = asyncio.run(turn())
        assert final.finished and final.usage.cached_tokens == 48 and router.routed == [0, 1]
        assert router.stats().cached_prompt_tokens == 48
    finally:
        router.close()


def test_blocks_held_by_checkpoints_are_given_back_when_requests_need_them(serve_model, serve_tokenizer):
    """A pool too small for every checkpoint's blocks: admission evicts checkpoints to make room,
    every request completes, each admitted request is counted once by the prefix cache."""
    engine = make_engine(serve_model, serve_tokenizer, memory_bytes=int(3.4 * 2**20), max_running=2, checkpoints=16,
                         max_context=600)
    try:
        total_blocks = engine.core.layout.num_blocks
        assert total_blocks < 16     # fewer than the 8 requests x 2 blocks their checkpoints would pin
        for i in range(8):   # distinct 300-token prompts, each leaving checkpoints that pin 2 blocks
            prompt = prompts(1, 300, seed=40 + i)[0]
            request = GenerationRequest(f"p{i}", prompt, SamplingParams(max_tokens=2, **GREEDY),
                                        boundary_hints=[160, 290])
            final = list(engine.generate_blocking(request))[-1]
            assert final.finish_reason == "length"
        stats = engine.stats()
        assert stats.prefix_queries == 8
        assert engine.core.prefix_cache.stats.evictions > 0
        assert stats.cache_blocks_used <= total_blocks
        assert_no_leak(engine)
    finally:
        engine.close()


def test_penalties_see_the_prompt_and_the_output_of_their_own_sequence(serve_model, serve_tokenizer, monkeypatch):
    """With penalties on, every sampled token's logits pass through ``apply_penalties`` with this sequence's prompt
    and the tokens it generated so far (greedy: the penalised argmax), and the output is what greedy sampling of those
    penalised logits gives; a request without penalties skips them."""
    from kimik3.model import sampling
    from kimik3.serve import model_runner

    seen = []

    def recording(logits, prompt_ids, output_ids, *args):
        seen.append((prompt_ids.tolist(), output_ids.tolist()))
        return sampling.apply_penalties(logits, prompt_ids, output_ids, *args)

    monkeypatch.setattr(model_runner, "apply_penalties", recording)
    engine = make_engine(serve_model, serve_tokenizer)
    try:
        prompt = prompts(1, 20)[0]
        plain, _ = engine.complete(prompt, SamplingParams(max_tokens=6, **GREEDY), request_id="p0")
        assert seen == []
        out, _ = engine.complete(prompt, SamplingParams(max_tokens=6, repetition_penalty=50.0, frequency_penalty=2.0,
                                                        **GREEDY), request_id="p1")
        assert [s[0] for s in seen] == [prompt] * len(out)
        assert [s[1] for s in seen] == [out[:i] for i in range(len(out))]
        # a strong repetition penalty keeps greedy decoding off every token it has already seen
        assert not set(out) & set(prompt) and len(set(out)) == len(out), (out, plain)
    finally:
        engine.close()


def test_stop_token_ids_end_the_output_like_eos(serve_model, serve_tokenizer):
    """A stop token (a chat template's end of turn as a special token) ends the output as EOS does: finish reason
    "stop", the token streamed but not its text, nothing generated after it."""
    engine = make_engine(serve_model, serve_tokenizer)
    try:
        prompt = prompts(1, 30, seed=4)[0]
        greedy = dict(max_tokens=12, **GREEDY)
        ids, _ = engine.complete(prompt, SamplingParams(**greedy), request_id="free")
        stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])   # the first new token from the 3rd
        events = list(engine.generate_blocking(GenerationRequest(
            "stopped", prompt, SamplingParams(**greedy, stop_token_ids=[ids[stop_at]]))))
        assert events[-1].finish_reason == "stop"
        assert [e.token_id for e in events if e.token_id is not None] == ids[:stop_at + 1]
        with pytest.raises(ValueError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=[-1])
    finally:
        engine.close()


def test_min_tokens_hold_back_the_end_tokens(serve_model, serve_tokenizer):
    """With ``min_tokens`` the stop tokens (and EOS) cannot be drawn before that many tokens: greedy decoding that
    would stop at its first token instead picks the next likeliest until the minimum, then may stop; the held-back
    rows' log-probabilities stay the raw model's."""
    engine = make_engine(serve_model, serve_tokenizer)
    try:
        prompt = prompts(1, 30, seed=5)[0]
        greedy = dict(max_tokens=10, **GREEDY)
        ids, _ = engine.complete(prompt, SamplingParams(**greedy), request_id="free")
        stop = [ids[0]]
        stopped, _ = engine.complete(prompt, SamplingParams(**greedy, stop_token_ids=stop), request_id="s0")
        assert stopped == ids[:1]
        events = list(engine.generate_blocking(GenerationRequest(
            "held", prompt, SamplingParams(**greedy, stop_token_ids=stop, min_tokens=4, logprobs=0))))
        held = [e.token_id for e in events if e.token_id is not None]
        assert len(held) >= 5 and stop[0] not in held[:4], held
        if stop[0] in held:                     # once the minimum is reached the stop token ends the output again
            assert held.index(stop[0]) == len(held) - 1 and events[-1].finish_reason == "stop"
        # the first token is the model's second choice, its raw log-probability below the (held) first choice's
        lps = [e.logprob for e in events if e.token_id is not None]
        free = list(engine.generate_blocking(GenerationRequest("free-lp", prompt, SamplingParams(**greedy,
                                                                                                logprobs=0))))
        assert held[0] != ids[0] and lps[0] < free[0].logprob
        for bad in (-1, 11, True):
            with pytest.raises(ValueError, match="min_tokens"):
                SamplingParams(max_tokens=10, min_tokens=bad)
    finally:
        engine.close()
