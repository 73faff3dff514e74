"""Careless and hostile clients: no request takes the engine or the server down, each failure stays
with the request that caused it, and /health tells the truth."""

import json
import socket
import threading
import time

import pytest
import torch

from kimik3.model.sampling import GREEDY_BELOW, sample_next_token
from kimik3.serve import engine as engine_module
from kimik3.serve.fake_engine import FakeEngine
from kimik3.serve.model_runner import ModelRunner
from kimik3.serve.scheduler import BROKEN_AFTER, EngineCore
from kimik3.serve.server import max_token_chars, serve as serve_forever
from kimik3.serve.types import (AdmissionRejected, EngineUnavailable, GenerationRequest, SamplingParams,
                                TokenEvent, Usage)
from tests.serve.http_server import KEY, httpx
from tests.serve.test_engine import GREEDY, assert_no_leak, make_engine, prompts, reference

MODEL = "fake-k3"
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def openai_error(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def run_together(engine, requests: list[GenerationRequest]) -> dict[str, list[TokenEvent]]:
    """Submit every request while the worker is held, so they share steps; wait for all to end."""
    events: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    done = threading.Semaphore(0)

    def sink_for(rid):
        def sink(event):
            events[rid].append(event)
            if event.finished:
                done.release()
        return sink

    with engine._lock:
        for request in requests:
            engine.core.add(request, sink_for(request.request_id))
        engine._lock.notify_all()
    for _ in requests:
        assert done.acquire(timeout=60), "a request never finished"
    return events


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


# -- sampling ----------------------------------------------------------------------------------------------
def test_temperatures_below_the_greedy_cut_take_the_argmax():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 20
    for temperature in (0.0, 1e-300, 5e-324, GREEDY_BELOW / 2):
        assert torch.equal(sample_next_token(logits, temperature), logits.argmax(-1))
    # Just above the cut the softmax of logits / T must not overflow into NaN.
    sampled = sample_next_token(logits, GREEDY_BELOW, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampled, logits.argmax(-1))
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            sample_next_token(logits, bad)


def test_a_tiny_temperature_is_served_greedily_and_the_engine_goes_on(serve_model, serve_tokenizer):
    engine = make_engine(serve_model, serve_tokenizer)
    try:
        prompt = prompts(1, 20)[0]
        tokens, final = engine.complete(prompt, SamplingParams(max_tokens=6, temperature=1e-300))
        assert final.finish_reason == "length" and tokens == reference(serve_model, prompt, 6)
        tokens, _ = engine.complete(prompt, SamplingParams(max_tokens=6, **GREEDY))
        assert tokens == reference(serve_model, prompt, 6) and engine.health() is None
    finally:
        engine.close()


# -- the engine: a failure stays with its request ----------------------------------------------------------
def test_a_request_that_fails_mid_decode_ends_alone(serve_model, serve_tokenizer, monkeypatch):
    engine = make_engine(serve_model, serve_tokenizer)
    accept = EngineCore._accept

    def flaky(self, seq, sampled):
        if seq.request.request_id == "bad" and seq.generated == 2:
            raise RuntimeError("sampler exploded")
        accept(self, seq, sampled)

    monkeypatch.setattr(EngineCore, "_accept", flaky)
    try:
        good_prompt, bad_prompt = prompts(2, 30, seed=3)
        events = run_together(engine, [
            GenerationRequest("good", good_prompt, SamplingParams(max_tokens=8, **GREEDY)),
            GenerationRequest("bad", bad_prompt, SamplingParams(max_tokens=8, **GREEDY))])
        bad = events["bad"][-1]
        assert bad.finished and bad.finish_reason == "error" and "sampler exploded" in bad.error
        assert len(tokens_of(events["bad"])) == 2
        assert events["good"][-1].finish_reason == "length"
        assert tokens_of(events["good"]) == reference(serve_model, good_prompt, 8)
        assert engine.health() is None
        assert engine.complete(good_prompt, SamplingParams(max_tokens=3, **GREEDY))[1].finish_reason == "length"
        assert_no_leak(engine)
    finally:
        engine.close()


def test_a_broken_forward_rebuilds_the_engine_then_gives_up(serve_model, serve_tokenizer, monkeypatch):
    """Forwards that keep failing: every request gets its error; after BROKEN_AFTER in a row the core
    is rebuilt (and serves again once the forward works); past MAX_RESTARTS rebuilds it gives up."""
    engine = make_engine(serve_model, serve_tokenizer)
    forward, broken = ModelRunner._forward, {"left": BROKEN_AFTER}

    def failing(self, *args):
        if broken["left"] > 0:
            broken["left"] -= 1
            raise RuntimeError("device lost")
        return forward(self, *args)

    monkeypatch.setattr(ModelRunner, "_forward", failing)
    try:
        prompt = prompts(1, 20, seed=5)[0]
        first_core = engine.core
        for i in range(BROKEN_AFTER):
            tokens, final = engine.complete(prompt, SamplingParams(max_tokens=3), request_id=f"f{i}")
            assert (tokens, final.finish_reason) == ([], "error") and "device lost" in final.error
        deadline = time.monotonic() + 10
        while engine.core is first_core and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.core is not first_core and engine.health() is None      # rebuilt, serving
        tokens, final = engine.complete(prompt, SamplingParams(max_tokens=4, **GREEDY))
        assert final.finish_reason == "length" and tokens == reference(serve_model, prompt, 4)

        broken["left"] = 10**9                                                 # now it never recovers
        for i in range(BROKEN_AFTER * engine_module.MAX_RESTARTS):
            assert engine.complete(prompt, SamplingParams(max_tokens=3), request_id=f"g{i}")[1].finish_reason == "error"
        deadline = time.monotonic() + 10
        while engine.health() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "device lost" in engine.health()
        with pytest.raises(EngineUnavailable, match="device lost"):
            engine.complete(prompt, SamplingParams(max_tokens=3))
    finally:
        engine.close()


def test_a_client_whose_event_loop_is_gone_does_not_stop_the_engine(serve_model, serve_tokenizer):
    engine = make_engine(serve_model, serve_tokenizer)
    try:
        def dead_sink(event):
            raise RuntimeError("Event loop is closed")

        prompt = prompts(1, 20, seed=6)[0]
        engine.submit(GenerationRequest("orphan", prompt, SamplingParams(max_tokens=50)), dead_sink)
        events = run_together(engine, [GenerationRequest("alive", prompt, SamplingParams(max_tokens=4, **GREEDY))])
        assert events["alive"][-1].finish_reason == "length"
        assert tokens_of(events["alive"]) == reference(serve_model, prompt, 4)
        deadline = time.monotonic() + 10
        while engine.core.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.health() is None
        assert_no_leak(engine)
    finally:
        engine.close()


# -- admission ---------------------------------------------------------------------------------------------
def test_no_queue_still_serves_what_can_start_now(serve_model, serve_tokenizer):
    engine = make_engine(serve_model, serve_tokenizer, max_waiting=0, max_running=1)
    try:
        prompt = prompts(1, 20, seed=7)[0]
        assert engine.complete(prompt, SamplingParams(max_tokens=2, **GREEDY))[1].finish_reason == "length"
        with engine._lock:    # hold the worker: the first request holds the only running place
            engine.core.add(GenerationRequest("a", prompt, SamplingParams(max_tokens=2)), lambda e: None)
            with pytest.raises(AdmissionRejected):
                engine.core.add(GenerationRequest("b", prompt, SamplingParams(max_tokens=2)), lambda e: None)
            engine._lock.notify_all()
    finally:
        engine.close()


@pytest.mark.parametrize("seed", [2**63, 2**64, -2**63 - 1])
def test_seeds_outside_64_bits_are_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


# -- the prefix cache --------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["ours", "vllm"])
def test_a_resend_hits_after_the_pool_filled_with_other_traffic(serve_model, serve_tokenizer, policy):
    """With every checkpoint slot taken by unrelated requests, a prompt's tail checkpoint must outlive
    the decode checkpoints of its own request, so the identical resend restores it."""
    engine = make_engine(serve_model, serve_tokenizer, checkpoints=3, prefix_policy=policy)
    try:
        for i, other in enumerate(prompts(3, 40, seed=11)):
            engine.complete(other, SamplingParams(max_tokens=20, **GREEDY), request_id=f"other{i}")
        assert len(engine.core.prefix_cache) == 3
        prompt = prompts(1, 70, seed=12)[0]
        tail = (len(prompt) - 1) // 16 * 16
        first = engine.complete(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=1))[1]
        again = engine.complete(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=2))[1]
        third = engine.complete(prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=3))[1]
        assert first.usage.cached_tokens == 0
        assert again.usage.cached_tokens == tail and third.usage.cached_tokens == tail
        assert all(cp.pins == 0 for cp in engine.core.prefix_cache.checkpoints())   # pins end with requests
        assert_no_leak(engine)
    finally:
        engine.close()


# -- the server --------------------------------------------------------------------------------------------
class FailingEngine(FakeEngine):
    """Fails every request whose prompt contains token 66 after one token, the way the real
    engine reports a failure of one request."""

    async def generate(self, request):
        if 66 not in request.prompt_ids:
            async for event in super().generate(request):
                yield event
            return
        yield TokenEvent(request.request_id, request.prompt_ids[0], "x")
        yield TokenEvent(request.request_id, None, "", finished=True, finish_reason="error",
                         usage=Usage(len(request.prompt_ids), 1, 0), error="RuntimeError: boom")


def test_a_failed_request_is_a_500_and_the_next_one_is_served(serve):
    srv = serve(FailingEngine())
    error = openai_error(srv.post("/v1/completions", COMPLETION | {"prompt": [66, 67]}), 500)
    assert error["type"] == "server_error" and "boom" in error["message"]
    with httpx.stream("POST", srv.url + "/v1/completions", json=COMPLETION | {"prompt": [66, 67], "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200       # the first token went out before the failure
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(data[-2])["error"]["type"] == "server_error" and data[-1] == "[DONE]"
    assert srv.post("/v1/completions", COMPLETION).status_code == 200
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"
    assert 'finish_reason="error"} 2.0' in httpx.get(srv.url + "/metrics").text


def test_health_is_503_once_the_engine_cannot_serve(serve):
    srv = serve()
    assert httpx.get(srv.url + "/health").status_code == 200
    srv.engine.failure = "the engine stopped after an error: RuntimeError: device lost"
    response = httpx.get(srv.url + "/health")
    assert response.status_code == 503
    assert response.json()["status"] == "unavailable" and "device lost" in response.json()["error"]


def test_serve_exits_non_zero_when_the_engine_gives_up():
    engine = FakeEngine()
    engine.failure = "the engine stopped after an error: RuntimeError: device lost"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = []
    thread = threading.Thread(target=lambda: result.append(
        serve_forever(engine, port=port, log_level="critical", health_poll_s=0.01)), daemon=True)
    thread.start()
    thread.join(20)
    assert result == [1]


def test_an_oversized_body_is_a_413_before_it_is_read(serve):
    srv = serve(max_request_bytes=4096)
    big = COMPLETION | {"prompt": "x" * 5000}
    error = openai_error(srv.post("/v1/completions", big), 413)
    assert error["code"] == "request_too_large" and "4,096" in error["message"]

    def chunks():                      # no Content-Length: the limit counts the bytes as they arrive
        body = json.dumps(big).encode()
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    response = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=10,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert openai_error(response, 413)["code"] == "request_too_large"
    assert srv.engine.requests == []
    assert srv.post("/v1/completions", COMPLETION | {"prompt": "x" * 3000}).status_code == 400   # fits: context
    assert srv.post("/v1/completions", COMPLETION).status_code == 200


def test_the_default_body_limit_refuses_50_mb_at_once(serve):
    srv = serve()
    start = time.monotonic()
    error = openai_error(srv.post("/v1/completions", COMPLETION | {"prompt": "x" * 50_000_000}, timeout=60), 413)
    assert time.monotonic() - start < 10 and error["code"] == "request_too_large"
    assert httpx.get(srv.url + "/health").status_code == 200


class CountingTokenizer:
    """The fake engine's tokenizer, counting how often ``encode`` runs."""

    def __init__(self, inner):
        self.inner, self.encodes = inner, 0

    def encode(self, text):
        self.encodes += 1
        return self.inner.encode(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", COMPLETION),
    ("/v1/chat/completions", CHAT),
])
def test_a_prompt_too_long_for_any_tokenisation_is_refused_untokenised(serve, path, body):
    engine = FakeEngine()
    engine.tokenizer = CountingTokenizer(engine.tokenizer)
    srv = serve(engine)
    chars = max_token_chars(engine.tokenizer) * engine.max_context + 1
    big = body | ({"prompt": "y" * chars} if "prompt" in body else
                  {"messages": [{"role": "user", "content": "y" * (chars // 2)},
                                {"role": "user", "content": "z" * (chars // 2 + 1)}]})
    error = openai_error(srv.post(path, big), 400)
    assert error["code"] == "context_length_exceeded" and engine.tokenizer.encodes == 0


@pytest.mark.parametrize("body, param", [
    (COMPLETION | {"prompt": "ok \ud800"}, "prompt"),
    (COMPLETION | {"stop": ["\udfff"]}, "stop[0]"),
    (COMPLETION | {"model": "\ud800"}, "model"),
    (COMPLETION | {"user": "\udc00x"}, "user"),
    (CHAT | {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    (CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
     "messages[0].content[0].text"),
])
def test_a_lone_surrogate_is_a_400(serve, body, param):
    srv = serve()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = openai_error(srv.post(path, json.dumps(body).encode()), 400)   # ASCII JSON: "\ud800" escapes
    assert error["param"] == param and "surrogate" in error["message"]
    assert srv.engine.requests == []
    # A valid pair of surrogate escapes is one character, not an error.
    assert srv.post("/v1/completions", json.dumps(COMPLETION | {"prompt": "\U0001F600"}).encode()).status_code == 200


@pytest.mark.parametrize("seed, status", [(2**63, 400), (-2**63 - 1, 400), (2**70, 400), (2**63 - 1, 200)])
def test_seed_range_over_http(serve, seed, status):
    srv = serve()
    response = srv.post("/v1/completions", COMPLETION | {"seed": seed})
    assert response.status_code == status
    if status == 400:
        assert response.json()["error"]["param"] == "seed"


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/docs/oauth2-redirect"])
def test_the_api_description_needs_the_key_when_one_is_set(serve, path):
    srv = serve()
    assert openai_error(httpx.get(srv.url + path), 401)["code"] == "invalid_api_key"
    assert httpx.get(srv.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200
