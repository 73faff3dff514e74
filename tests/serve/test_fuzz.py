"""A bounded fuzz of the HTTP server over the real engine: a few hundred generated malformed or
awkward requests (wrong types, out-of-range values, broken encodings, odd sizes), then a normal
request must still be served exactly and /health must tell the truth.

Every request goes to a server on the loopback address that this test starts itself; the loop is
bounded in count and time."""

import json
import random
import time

import pytest

from kimik3.serve.engine import LLMEngine
from kimik3.serve.memory import EngineConfig
from tests.serve.http_server import KEY, Server, httpx
from tests.serve.test_engine import assert_no_leak, reference

REQUESTS = 300
TIME_LIMIT_S = 240
MODEL = "fuzz-k3"

# Values of every JSON type and of the ranges parsers and samplers trip on.
HOSTILE = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -2**63 - 1, 10**400, 1e-300, 5e-324, -0.0, 1e308,
           float("nan"), float("inf"), float("-inf"), 0.5, 2.0000001, "", "5", "\u0000", "\ud800", "\udfff x",
           "\U0001F600" * 50, "é" * 300, "x" * 70_000, [], [None], [1, "2"], [[1]], [-1], [10**9], {}, {"a": 1},
           [0] * 97, list(range(40)), "<|endoftext|>" * 20]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "user", "logprobs", "presence_penalty", "logit_bias",
          "tools", "echo", "suffix", "best_of"]


def nest(depth: int) -> str:
    return "[" * depth + "]" * depth


def generate(rng: random.Random, i: int) -> tuple[str, dict[str, bytes], bytes]:
    """One request: (path, headers, body bytes)."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    headers = {"Authorization": f"Bearer {KEY}".encode(), "Content-Type": b"application/json"}
    base = ({"model": MODEL, "prompt": "def f(x):", "max_tokens": 4} if path.endswith("/completions")
            and "chat" not in path else
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    kind = i % 10
    if kind == 0:                                    # raw bytes: broken JSON, encodings, nesting
        body = rng.choice([b"", b"{", b"null", b"[]", b'{"model": 1', b"\xff\xfe\x00{", b'{"a":"\xed\xa0\x80"}',
                           nest(5000).encode(), nest(800).encode(), b'{"model":"' + b"\x80" * 100 + b'"}',
                           json.dumps(base).encode()[:-3], b'{"prompt": NaN, "model": "x"}'])
        return path, headers, body
    if kind == 1:                                    # headers: wrong content type, lying length, bad auth
        variant = rng.randrange(4)
        if variant == 0:
            headers["Content-Type"] = b"text/plain"
        elif variant == 1:
            headers["Authorization"] = rng.choice([b"", b"Bearer", "Bearer \u00e9".encode(), b"Bearer \xff\xfe",
                                                   b"Basic " + KEY.encode(), b"Bearer " + KEY.encode() * 3])
        elif variant == 2:
            path = rng.choice(["/v1/nowhere", "/v1/models/%ED%A0%80", "/v1//completions", "/" + "a" * 3000])
        return path, headers, json.dumps(base).encode()
    body = dict(base)
    for _ in range(rng.randint(1, 3)):               # mutate a few fields with hostile values
        body[rng.choice(FIELDS)] = rng.choice(HOSTILE)
    if kind == 2 and "messages" in body:
        body["messages"] = rng.choice([[{"role": "user"}], [{"role": "system", "content": None}],
                                       [{"role": "user", "content": [{"type": "image_url"}]}],
                                       [{"role": "tool", "content": "x"}], [{"content": "x"}] * 3,
                                       [{"role": "user", "content": rng.choice(HOSTILE)}]])
    return path, headers, json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def fuzz_engine(serve_model, serve_tokenizer):
    config = EngineConfig(memory_bytes=32 * 2**20, max_running=4, checkpoints=4, max_waiting=8, prefill_chunk=64,
                          max_context=96)
    engine = LLMEngine(serve_model, serve_tokenizer, config, model_name=MODEL,
                       eos_token_id=serve_tokenizer.token_to_id("<|endoftext|>"))
    yield engine
    engine.close()


def test_hundreds_of_malformed_requests_leave_the_server_serving(fuzz_engine, serve_model):
    server = Server(fuzz_engine, KEY)
    rng = random.Random(20261203)
    statuses: dict[int, int] = {}
    started = time.monotonic()
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(REQUESTS):
                assert time.monotonic() - started < TIME_LIMIT_S, f"the fuzz ran past {TIME_LIMIT_S} s at request {i}"
                path, headers, body = generate(rng, i)
                response = client.post(server.url + path, content=body, headers=headers)
                status = response.status_code
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, f"request {i} ({path}, {body[:200]!r}) got {status}: {response.text[:300]}"
                if status != 200:
                    error = response.json()["error"]
                    assert isinstance(error["message"], str) and error["message"], (i, response.text[:300])
        assert statuses.get(200, 0) > 10 and sum(n for s, n in statuses.items() if s >= 400) > REQUESTS // 2, statuses

        # Still serving, exactly, and /health says so.
        prompt = [5, 17, 200, 3, 99, 41, 250, 7]
        response = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0},
                              headers={"Authorization": f"Bearer {KEY}"})
        assert response.status_code == 200
        expected = fuzz_engine.tokenizer.decode(reference(serve_model, prompt, 6)).rstrip("\ufffd")  # as flushed
        assert response.json()["choices"][0]["text"] == expected
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert fuzz_engine.health() is None
        deadline = time.monotonic() + 10
        while fuzz_engine.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_no_leak(fuzz_engine)
    finally:
        server.stop()
