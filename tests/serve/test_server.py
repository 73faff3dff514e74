"""The OpenAI-compatible server against ``FakeEngine``, over real loopback HTTP with the official client."""

import asyncio
import json
import time
from collections.abc import Callable

import openai
import pytest

from tests.serve.http_server import KEY, httpx

from kimik3.serve import chat
from kimik3.serve.fake_engine import FakeEngine
from kimik3.serve.types import RequestTooLong, Usage

MODEL = "fake-k3"


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def echo(engine: FakeEngine, ids: list[int], n: int) -> str:
    """What FakeEngine generates for a prompt: its tokens again, in a loop."""
    return engine.tokenizer.decode([ids[i % len(ids)] for i in range(n)])


# -- happy paths with the official client ----------------------------------------------------------------
def test_completion(serve):
    srv = serve()
    resp = srv.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=5, user="u1")
    ids = srv.engine.tokenizer.encode("Hello world").ids
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == MODEL
    assert resp.choices[0].text == echo(srv.engine, ids, 5)
    assert resp.choices[0].finish_reason == "length"
    u = resp.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 5, len(ids) + 5)
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.cost_usd == pytest.approx(Usage(len(ids), 5, 0).cost_usd)
    # The same prompt again is served from the (fake) prefix cache.
    again = srv.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=5)
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert again.id != resp.id


def test_completion_token_ids_stop_and_eos(serve):
    srv = serve()
    client = srv.client()
    resp = client.completions.create(model=MODEL, prompt=[70, 71, 72], max_tokens=4, seed=3, temperature=0.0,
                                     top_p=0.5, extra_body={"top_k": 5})
    assert resp.choices[0].text == srv.engine.tokenizer.decode([70, 71, 72, 70])
    params = srv.engine.requests[-1].params
    assert (params.max_tokens, params.seed, params.temperature, params.top_p, params.top_k) == (4, 3, 0.0, 0.5, 5)
    eos = srv.engine.eos_token_id
    resp = client.completions.create(model=MODEL, prompt=[70, 71, eos], max_tokens=10)
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == 3
    resp = client.completions.create(model=MODEL, prompt="abc abc abc", max_tokens=30, stop=["c a"])
    assert resp.choices[0].text == "ab" and resp.choices[0].finish_reason == "stop"
    assert srv.engine.requests[-1].params.stop == ["c a"]


def test_completion_stream_with_usage(serve):
    srv = serve(FakeEngine(token_delay=0.001))
    chunks = list(srv.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=7, stream=True,
                                                  stream_options={"include_usage": True}))
    ids = srv.engine.tokenizer.encode("Hello world").ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo(srv.engine, ids, 7)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing(serve):
    srv = serve()
    with httpx.stream("POST", srv.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"


def test_chat_completion_and_stream(serve):
    srv = serve()
    client = srv.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6)
    ids, hints = chat.render_ids(srv.engine.tokenizer, messages)
    request = srv.engine.requests[-1]
    assert request.prompt_ids == ids and request.boundary_hints == hints
    assert chat.CHAT_STOP in request.params.stop
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == echo(srv.engine, ids, 6)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 6

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0   # second time: prefix reused
    assert chunks[-1].usage.cost_usd < resp.usage.cost_usd


def test_chat_default_max_tokens_fills_the_context(serve):
    srv = serve(FakeEngine(max_context=64))
    client = srv.client()
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    ids, _ = chat.render_ids(srv.engine.tokenizer, [{"role": "user", "content": "Hi"}])
    assert resp.usage.completion_tokens == 64 - len(ids) and resp.choices[0].finish_reason == "length"


def test_models_and_health(serve):
    srv = serve()
    client = srv.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


# -- errors ----------------------------------------------------------------------------------------------
def assert_openai_error(resp: httpx.Response, status: int, type_: str = "invalid_request_error") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    return error


def test_auth(serve):
    srv = serve()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert assert_openai_error(srv.post("/v1/completions", body, key=None), 401)["code"] == "invalid_api_key"
    assert_openai_error(srv.post("/v1/completions", body, key="sk-wrong"), 401)
    assert_openai_error(httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_openai_error(srv.post("/v1/completions", b"{not json", key=None), 401)  # auth before parsing
    with pytest.raises(openai.AuthenticationError):
        srv.client(key="sk-wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert srv.post("/v1/completions", body).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200


def test_no_key_configured_accepts_anything(serve):
    srv = serve(api_key=None)
    assert srv.post("/v1/completions", {"model": MODEL, "prompt": "Hi"}, key=None).status_code == 200


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{\"model\": ", None),                       # malformed JSON
    ("/v1/completions", b"[1, 2]", None),                             # not an object
    ("/v1/completions", {"prompt": "Hi"}, "model"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", COMPLETION | {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", COMPLETION | {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", COMPLETION | {"max_tokens": -3}, "max_tokens"),
    ("/v1/completions", COMPLETION | {"temperature": 2.5}, "temperature"),
    ("/v1/completions", COMPLETION | {"temperature": "hot"}, "temperature"),
    ("/v1/completions", COMPLETION | {"top_p": 0}, "top_p"),
    ("/v1/completions", COMPLETION | {"top_k": -1}, "top_k"),
    ("/v1/completions", COMPLETION | {"stream": "yes"}, "stream"),
    ("/v1/completions", COMPLETION | {"stop": [1]}, "stop"),
    ("/v1/completions", COMPLETION | {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", COMPLETION | {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": [[1, 2], [3]]}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": 42}, "prompt"),
    ("/v1/completions", COMPLETION | {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", COMPLETION | {"n": 17}, "n"),
    ("/v1/completions", COMPLETION | {"logprobs": 21}, "logprobs"),
    ("/v1/completions", COMPLETION | {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", COMPLETION | {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", CHAT | {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/chat/completions", CHAT | {"min_p": 1.5}, "min_p"),
    ("/v1/completions", COMPLETION | {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", COMPLETION | {"prompt": "x" * 600}, "prompt"),
    ("/v1/completions", COMPLETION | {"max_tokens": 600}, "prompt"),
    ("/v1/chat/completions", CHAT | {"messages": []}, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", CHAT | {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", CHAT | {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 10_000}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
])
def test_bad_input_is_a_400_in_openai_shape(serve, path, body, param):
    srv = serve()
    error = assert_openai_error(srv.post(path, body), 400)
    assert error["param"] == param
    assert srv.engine.requests == []   # refused before reaching the engine


def test_context_error_code(serve):
    srv = serve()
    error = assert_openai_error(srv.post("/v1/completions", COMPLETION | {"max_tokens": 600}), 400)
    assert error["code"] == "context_length_exceeded" and "512" in error["message"]


def test_unknown_model_is_404(serve):
    srv = serve()
    error = assert_openai_error(srv.post("/v1/chat/completions", CHAT | {"model": "gpt-4o"}), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        srv.client().completions.create(model="gpt-4o", prompt="x")
    assert_openai_error(httpx.get(srv.url + "/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"}), 404)


class TooLongEngine(FakeEngine):
    """Refuses every request as too long, the way a real engine's own check would."""

    async def generate(self, request):
        raise RequestTooLong("the engine's own limit")
        yield  # an async generator, raising on the first __anext__ like the contract says


@pytest.mark.parametrize("stream", [False, True])
def test_engine_request_too_long_is_a_400_before_any_stream(serve, stream):
    srv = serve(TooLongEngine())
    error = assert_openai_error(srv.post("/v1/completions", COMPLETION | {"stream": stream}), 400)
    assert error["code"] == "context_length_exceeded"


def test_admission_rejected_is_a_429(serve):
    srv = serve(FakeEngine(capacity=1, queue_limit=0, token_delay=0.01))
    body = COMPLETION | {"max_tokens": 300, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as held:
        lines = held.iter_lines()    # keep a reference: a dropped iterator closes the connection
        next(lines)                  # the only slot is now taken
        for stream in (False, True):
            error = assert_openai_error(srv.post("/v1/completions", COMPLETION | {"stream": stream}), 429, "requests")
            assert error["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            srv.client().chat.completions.create(model=MODEL, messages=CHAT["messages"], stream=True)
    wait_for(lambda: srv.engine.allocated == 0)
    assert srv.engine.stats().rejected == 3
    assert 'kimik3_requests_finished_total{endpoint="completions",finish_reason="rejected"} 2.0' in \
        httpx.get(srv.url + "/metrics").text


def test_metrics(serve):
    srv = serve()
    client = srv.client()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    list(client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4, stream=True))
    srv.post("/v1/completions", COMPLETION | {"max_tokens": 0})
    text = httpx.get(srv.url + "/metrics").text
    for name in ["kimik3_time_to_first_token_seconds_bucket", "kimik3_inter_token_latency_seconds_bucket",
                 "kimik3_e2e_request_latency_seconds_bucket", "kimik3_http_requests_total",
                 "kimik3_requests_finished_total", "kimik3_prompt_tokens_total", "kimik3_completion_tokens_total",
                 "kimik3_cached_prompt_tokens_total", "kimik3_engine_running", "kimik3_engine_waiting",
                 "kimik3_engine_cache_usage_ratio", "kimik3_engine_cache_blocks_used",
                 "kimik3_engine_cache_blocks_total", "kimik3_engine_checkpoints_used",
                 "kimik3_engine_checkpoints_total", "kimik3_engine_prefix_queries_total",
                 "kimik3_engine_prefix_hits_total", "kimik3_engine_cached_prompt_tokens_total",
                 "kimik3_engine_cost_usd_total", "kimik3_engine_rejected_total"]:
        assert name in text, name
    assert 'kimik3_time_to_first_token_seconds_count{endpoint="completions"} 3.0' in text
    assert 'kimik3_e2e_request_latency_seconds_count{endpoint="completions"} 3.0' in text
    assert 'kimik3_e2e_request_latency_seconds_count{endpoint="chat"} 1.0' in text
    assert 'kimik3_inter_token_latency_seconds_count{endpoint="completions"} 9.0' in text   # 3 x (4 - 1)
    assert 'kimik3_completion_tokens_total{endpoint="completions"} 12.0' in text
    assert 'kimik3_http_requests_total{route="/v1/completions",status="200"} 3.0' in text
    assert 'kimik3_http_requests_total{route="/v1/completions",status="400"} 1.0' in text
    assert 'kimik3_requests_finished_total{endpoint="completions",finish_reason="length"} 3.0' in text
    assert "kimik3_engine_prefix_hits_total 2.0" in text


# -- disconnects and load --------------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees(serve):
    srv = serve(FakeEngine(token_delay=0.01))
    body = COMPLETION | {"max_tokens": 400, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=COMPLETION | {"max_tokens": 60, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as other:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as leaving:
            lines = leaving.iter_lines()
            next(lines), next(lines)
            rid = srv.engine.requests[-1].request_id
        # The client is gone: the server aborts it long before its 400 tokens.
        wait_for(lambda: rid in srv.engine.ended_early)
        assert rid in srv.engine.abort_calls
        text = other.read().decode()
    assert text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in text
    wait_for(lambda: srv.engine.allocated == 0)
    assert srv.engine.stats().running == 0
    assert 'finish_reason="abort"} 1.0' in httpx.get(srv.url + "/metrics").text


def test_disconnect_while_queued_or_not_streaming(serve):
    srv = serve(FakeEngine(capacity=1, queue_limit=4, token_delay=0.01))
    with httpx.stream("POST", srv.url + "/v1/completions", json=COMPLETION | {"max_tokens": 400, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as holder:
        lines = holder.iter_lines()
        next(lines)
        for stream in (True, False):   # queued behind the holder, then the client gives up
            with pytest.raises(httpx.ReadTimeout):
                srv.post("/v1/completions", COMPLETION | {"max_tokens": 50, "stream": stream}, timeout=0.3)
            rid = srv.engine.requests[-1].request_id
            wait_for(lambda: rid in srv.engine.ended_early)
            assert srv.engine.stats().waiting == 0
    wait_for(lambda: srv.engine.allocated == 0 and srv.engine.stats().running == 0)
    # A non-streaming request that disconnects mid-generation is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        srv.post("/v1/completions", COMPLETION | {"max_tokens": 400}, timeout=0.3)
    rid = srv.engine.requests[-1].request_id
    wait_for(lambda: rid in srv.engine.ended_early and srv.engine.allocated == 0)
    assert srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason


def test_load_64_streams_complete_or_get_a_clean_429(serve):
    engine = FakeEngine(capacity=16, queue_limit=32, token_delay=0.002)
    srv = serve(engine)
    prompt_ids = engine.tokenizer.encode("Hello world").ids
    expected = echo(engine, prompt_ids, 8)

    async def one(client: openai.AsyncOpenAI) -> str:
        try:
            stream = await client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True})
        except openai.RateLimitError as err:
            assert err.status_code == 429 and err.body["code"] == "rate_limit_exceeded"
            return "rejected"
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == 8
        return "completed"

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=30) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(64)]
            # Hold generation until all 64 reached the engine: 16 run, 32 queue, 16 are refused.
            while (s := engine.stats()).running + s.waiting + s.rejected < 64:
                await asyncio.sleep(0.01)
            engine.paused = False
            return await asyncio.gather(*tasks)

    engine.paused = True
    outcomes = asyncio.run(main())
    assert (outcomes.count("completed"), outcomes.count("rejected")) == (48, 16)
    assert engine.stats().rejected == 16 and engine.peak_running == 16
    wait_for(lambda: engine.allocated == 0)
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)
    assert httpx.get(srv.url + "/health").status_code == 200
    assert srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_penalties_reach_the_engine(serve):
    """presence / frequency (OpenAI) and repetition_penalty / min_p (vLLM's) are passed to the engine's sampling
    parameters, not dropped."""
    srv = serve()
    body = COMPLETION | {"presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.3, "min_p": 0.1}
    assert srv.post("/v1/completions", body).status_code == 200
    params = srv.engine.requests[-1].params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == \
        (0.5, -0.25, 1.3, 0.1)
