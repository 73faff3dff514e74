"""The real engine (tiny random K3) behind the HTTP server, driven by the official openai client."""

import asyncio

import openai

from kimik3.serve.engine import LLMEngine
from kimik3.serve.memory import EngineConfig
from tests.serve.http_server import KEY


def real_engine(model, tokenizer, **overrides) -> LLMEngine:
    settings = dict(memory_bytes=32 * 2**20, max_running=16, max_waiting=32, checkpoints=16,
                    prefill_chunk=64, max_context=1024)
    settings.update(overrides)
    return LLMEngine(model, tokenizer, EngineConfig(**settings), model_name="tiny", eos_token_id=0)


def test_openai_client_multi_turn_chat_hits_the_prefix_cache(serve, serve_model, serve_tokenizer):
    engine = real_engine(serve_model, serve_tokenizer)
    try:
        client = serve(engine).client()
        messages = [{"role": "system", "content": "You are a careful assistant. " * 8},
                    {"role": "user", "content": "Explain the hybrid cache of K3 in one line."}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        assert first.usage.prompt_tokens > 48 and first.usage.completion_tokens >= 1
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And the prefix cache?"}]
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        # the system prompt and the first turn come from the cache: at least the first hash blocks
        assert usage.prompt_tokens_details.cached_tokens >= 48
        assert usage.prompt_tokens_details.cached_tokens % 16 == 0
        plain = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, temperature=0)
        assert plain.choices[0].finish_reason in ("length", "stop")
        stats = engine.stats()
        assert stats.prefix_hits >= 1 and stats.cost_usd > 0
    finally:
        engine.close()


def test_64_concurrent_streams_on_the_real_engine_complete_or_get_429_and_leak_nothing(
        serve, serve_model, serve_tokenizer):
    engine = real_engine(serve_model, serve_tokenizer, max_running=8, max_waiting=16)
    server = serve(engine)
    outcomes: list[str] = []

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        try:
            stream = await client.completions.create(model="tiny", prompt=f"request {i}: " + "x" * (i % 7),
                                                     max_tokens=4, temperature=0, stream=True)
            finish = [c.choices[0].finish_reason async for c in stream if c.choices]
            outcomes.append("done" if finish[-1] in ("length", "stop") else f"bad {finish}")
        except openai.RateLimitError:
            outcomes.append("429")

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        await asyncio.gather(*(one(client, i) for i in range(64)))
        await client.close()

    try:
        asyncio.run(run())
        assert len(outcomes) == 64 and set(outcomes) <= {"done", "429"}, outcomes
        assert outcomes.count("done") >= 8
        core = engine.core
        with engine._lock:
            assert not core.running and not core.waiting
            core.prefix_cache.clear()
            assert core.cache.allocator.num_used == 0 and core.cache.states.num_free == core.cache.states.num_slots
        again = server.client().completions.create(model="tiny", prompt="still there?", max_tokens=2)
        assert again.usage.completion_tokens >= 1
    finally:
        engine.close()
