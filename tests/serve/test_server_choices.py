"""n choices, log-probabilities and ignore_eos on both endpoints, against ``FakeEngine`` over loopback HTTP."""

import dataclasses
import json

import openai
import pytest

from tests.serve.http_server import KEY, httpx
from tests.serve.test_server import CHAT, COMPLETION, MODEL, assert_openai_error, echo, wait_for

from kimik3.serve import chat
from kimik3.serve.fake_engine import FakeEngine, fake_logprobs
from kimik3.serve.openai_protocol import MAX_CHOICES, NO_LOGPROB, Shape, TokenStrings
from kimik3.serve.types import TokenEvent, Usage

OOV = 10_000   # added to every token id by OutOfVocabEngine: far past the tiny tokenizer's 320


def events(srv, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response; asserts it ends with ``[DONE]``."""
    with httpx.stream("POST", srv.url + path, json=body | {"stream": True}, timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""], raw[-300:]
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-2]]


class VariedEngine(FakeEngine):
    """Choice 1 meets ``<|endoftext|>`` after two tokens; choice 2 may write only two tokens."""

    async def generate(self, request):
        index = int(request.request_id.rsplit("-", 1)[1])
        if index == 1:
            request = dataclasses.replace(request, prompt_ids=request.prompt_ids[:2] + [self.eos_token_id])
        elif index == 2:
            request = dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=2))
        async for event in super().generate(request):
            yield event


class OutOfVocabEngine(FakeEngine):
    """Reports token ids the tokenizer does not have (as a model with a larger vocabulary may)."""

    async def generate(self, request):
        async for event in super().generate(request):
            if event.token_id is not None:
                event.token_id += OOV
                event.top_logprobs = [(t + OOV, lp) for t, lp in event.top_logprobs or []]
            yield event


class FailingChoiceEngine(FakeEngine):
    """Choice 1 fails after two tokens, the way the engine reports a failure of one request."""

    async def generate(self, request):
        tokens, inner = 0, super().generate(request)
        try:
            async for event in inner:
                if request.request_id.endswith("-1") and tokens == 2:
                    yield dataclasses.replace(event, token_id=None, text="", finished=True, finish_reason="error",
                                              error="non-finite logits")
                    return
                tokens += event.token_id is not None
                yield event
        finally:
            await inner.aclose()


# -- n -----------------------------------------------------------------------------------------------------
def test_n_choices_completion(serve):
    srv = serve(VariedEngine())
    resp = srv.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=6, n=3)
    ids = srv.engine.tokenizer.encode("Hello world").ids
    assert [r.request_id for r in srv.engine.requests] == [f"{resp.id}-{i}" for i in range(3)]
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.finish_reason for c in resp.choices] == ["length", "stop", "length"]
    assert [c.text for c in resp.choices] == [echo(srv.engine, ids, 6), echo(srv.engine, ids, 2),
                                              echo(srv.engine, ids, 2)]
    assert all(c.logprobs is None for c in resp.choices)
    # The prompt counted once, the completions summed (6 + 3 with the end-of-text token + 2).
    u = resp.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), 11, len(ids) + 11)
    assert u.cost_usd == pytest.approx(Usage(len(ids), 11, 0).cost_usd)


def test_n_choices_chat(serve):
    srv = serve()
    messages = CHAT["messages"]
    resp = srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)
    ids, _ = chat.render_ids(srv.engine.tokenizer, messages)
    assert [(c.index, c.message.content, c.finish_reason) for c in resp.choices] == \
        [(i, echo(srv.engine, ids, 4), "length") for i in range(2)]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 8)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0   # the first choice's


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_stream(serve, path):
    srv = serve(VariedEngine(token_delay=0.01))
    is_chat = "chat" in path
    body = (CHAT if is_chat else COMPLETION) | {"max_tokens": 8, "n": 3, "stream_options": {"include_usage": True}}
    chunks = events(srv, path, body)
    assert len({c["id"] for c in chunks}) == 1
    *choice_chunks, last = chunks
    assert last["choices"] == [] and all(c["usage"] is None for c in choice_chunks)
    assert all(len(c["choices"]) == 1 for c in choice_chunks)
    order = [c["choices"][0]["index"] for c in choice_chunks]
    if is_chat:   # a role chunk per choice first
        assert order[:3] == [0, 1, 2]
        assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in choice_chunks[:3])
    prompt = srv.engine.requests[0].prompt_ids
    texts, finishes = {}, {}
    for position, c in enumerate(choice_chunks):
        choice = c["choices"][0]
        i = choice["index"]
        assert i not in finishes, "a chunk after the choice's finish"
        texts[i] = texts.get(i, "") + (choice["delta"].get("content", "") if is_chat else choice["text"])
        if choice["finish_reason"]:
            finishes[i] = (choice["finish_reason"], position)
    assert {i: reason for i, (reason, _) in finishes.items()} == {0: "length", 1: "stop", 2: "length"}
    assert finishes[2][1] < finishes[0][1]   # each choice finishes on its own: the two-token one first
    assert texts == {0: echo(srv.engine, prompt, 8), 1: echo(srv.engine, prompt, 2), 2: echo(srv.engine, prompt, 2)}
    assert (last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]) == (len(prompt), 8 + 3 + 2)


def test_seeds_per_choice(serve):
    srv = serve()
    assert srv.post("/v1/completions", COMPLETION | {"n": 3, "seed": 7}).status_code == 200
    assert [r.params.seed for r in srv.engine.requests] == [7, 8, 9]
    assert srv.post("/v1/chat/completions", CHAT | {"n": 2}).status_code == 200
    assert [r.params.seed for r in srv.engine.requests[3:]] == [None, None]   # independent draws
    assert srv.post("/v1/completions", COMPLETION | {"n": 2, "seed": 2**63 - 1}).status_code == 200
    assert [r.params.seed for r in srv.engine.requests[5:]] == [2**63 - 1, -2**63]   # wraps in 64 bits
    assert srv.post("/v1/completions", COMPLETION | {"seed": 5}).status_code == 200
    assert srv.engine.requests[-1].params.seed == 5 and "-" not in srv.engine.requests[-1].request_id[5:]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", COMPLETION | {"n": 0}, "n"),
    ("/v1/completions", COMPLETION | {"n": -1}, "n"),
    ("/v1/completions", COMPLETION | {"n": MAX_CHOICES + 1}, "n"),
    ("/v1/chat/completions", CHAT | {"n": 10**6}, "n"),
    ("/v1/chat/completions", CHAT | {"n": "2"}, "n"),
    ("/v1/completions", COMPLETION | {"best_of": 2}, "best_of"),
    ("/v1/completions", COMPLETION | {"n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", COMPLETION | {"logprobs": -1}, "logprobs"),
    ("/v1/completions", COMPLETION | {"logprobs": True}, "logprobs"),
    ("/v1/completions", COMPLETION | {"top_logprobs": 2}, "top_logprobs"),   # chat's field
    ("/v1/chat/completions", CHAT | {"top_logprobs": 2}, "top_logprobs"),    # without logprobs: true
    ("/v1/chat/completions", CHAT | {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", CHAT | {"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_choices_and_logprobs_are_400s(serve, path, body, param):
    srv = serve()
    error = assert_openai_error(srv.post(path, body), 400)
    assert error["param"] == param, error
    if param == "n":
        assert "n must be" in error["message"] or "'n'" in error["message"]
    assert srv.engine.requests == []


def test_off_values_are_accepted(serve):
    srv = serve()
    for path, body in [("/v1/completions", COMPLETION | {"n": 1, "best_of": 1, "logprobs": None}),
                       ("/v1/completions", COMPLETION | {"n": 2, "best_of": 2}),
                       ("/v1/chat/completions", CHAT | {"logprobs": False, "top_logprobs": 0}),
                       ("/v1/chat/completions", CHAT | {"top_logprobs": None, "ignore_eos": False})]:
        response = srv.post(path, body)
        assert response.status_code == 200, response.text
        assert all(choice["logprobs"] is None for choice in response.json()["choices"])
        assert srv.engine.requests[-1].params.logprobs is None


def test_n_beyond_capacity_is_a_clean_429(serve):
    srv = serve(FakeEngine(capacity=1, queue_limit=1, token_delay=0.01))
    error = assert_openai_error(srv.post("/v1/completions", COMPLETION | {"n": 3, "stream": True}), 429, "requests")
    assert error["code"] == "rate_limit_exceeded"
    wait_for(lambda: srv.engine.allocated == 0 and srv.engine.stats().running + srv.engine.stats().waiting == 0)
    assert srv.post("/v1/completions", COMPLETION | {"n": 2}).status_code == 200


# -- logprobs --------------------------------------------------------------------------------------------
def expected_logprobs(engine: FakeEngine, ids: list[int], top_n: int) -> list[tuple[float, list[tuple[int, float]]]]:
    return [fake_logprobs(token, top_n, engine.tokenizer.get_vocab_size()) for token in ids]


def test_completion_logprobs(serve):
    srv = serve()
    resp = srv.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=5, logprobs=2)
    assert srv.engine.requests[-1].params.logprobs == 2
    prompt = srv.engine.requests[-1].prompt_ids
    out = [prompt[i % len(prompt)] for i in range(5)]
    strings = TokenStrings(srv.engine.tokenizer)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [strings.get(t)[0] for t in out] and "".join(lp.tokens) == resp.choices[0].text
    expected = expected_logprobs(srv.engine, out, 2)
    assert lp.token_logprobs == pytest.approx([logprob for logprob, _ in expected])
    assert lp.top_logprobs == [{strings.get(t)[0]: v for t, v in top} for _, top in expected]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # logprobs 0: the tokens' own log-probabilities, no alternatives.
    resp = srv.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=3, logprobs=0, n=2)
    for choice in resp.choices:
        assert len(choice.logprobs.tokens) == 3 and choice.logprobs.top_logprobs == [{}, {}, {}]


def test_chat_logprobs(serve):
    srv = serve()
    resp = srv.client().chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4, logprobs=True,
                                                top_logprobs=3)
    assert srv.engine.requests[-1].params.logprobs == 3
    prompt = srv.engine.requests[-1].prompt_ids
    out = [prompt[i % len(prompt)] for i in range(4)]
    strings = TokenStrings(srv.engine.tokenizer)
    content = resp.choices[0].logprobs.content
    assert [entry.token for entry in content] == [strings.get(t)[0] for t in out]
    assert "".join(entry.token for entry in content) == resp.choices[0].message.content
    for entry, token, (logprob, top) in zip(content, out, expected_logprobs(srv.engine, out, 3), strict=True):
        assert entry.bytes == list(entry.token.encode()) and entry.logprob == pytest.approx(logprob)
        assert [(alt.token, alt.logprob, alt.bytes) for alt in entry.top_logprobs] == \
            [(strings.get(t)[0], pytest.approx(v), strings.get(t)[1]) for t, v in top]
        assert entry.top_logprobs[0].token == entry.token
    # logprobs without top_logprobs: no alternatives.
    resp = srv.client().chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2, logprobs=True)
    assert srv.engine.requests[-1].params.logprobs == 0
    assert [entry.top_logprobs for entry in resp.choices[0].logprobs.content] == [[], []]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_logprobs_follow_tokens_not_text(serve, path):
    """Multi-byte characters hold text back for a token or more: every token's entry still comes, in order, in the
    chunk that carries its text (or the finish chunk), and the entries' bytes join to the text exactly."""
    srv = serve()
    is_chat = "chat" in path
    text = "héllo wörld 😀 ✓"
    body = ({"model": MODEL, "messages": [{"role": "user", "content": text}], "logprobs": True, "top_logprobs": 1}
            if is_chat else {"model": MODEL, "prompt": text, "logprobs": 1}) | {"max_tokens": 40, "n": 2}
    chunks = events(srv, path, body)
    prompt = srv.engine.requests[-1].prompt_ids
    out = [prompt[i % len(prompt)] for i in range(40)]
    strings = TokenStrings(srv.engine.tokenizer)
    assert any(strings.get(t)[0].endswith("\ufffd") for t in out)   # the test does hold text back
    for index in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        full, tokens, raw = "", [], b""
        for choice in mine:
            piece = choice["delta"].get("content", "") if is_chat else choice["text"]
            full += piece
            lp = choice["logprobs"]
            assert lp is not None or not piece, "text without the entries of its tokens"
            if lp is None:
                continue
            if is_chat:
                tokens += [entry["token"] for entry in lp["content"]]
                raw += b"".join(bytes(entry["bytes"]) for entry in lp["content"])
                assert all(len(entry["top_logprobs"]) == 1 for entry in lp["content"])
                assert raw.decode(errors="ignore").startswith(full)   # the text never runs ahead of its tokens
            else:
                assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
                    == len(lp["text_offset"]) > 0
                tokens += lp["tokens"]
        assert tokens == [strings.get(t)[0] for t in out]
        assert full == echo(srv.engine, prompt, 40)
        if is_chat:
            assert raw.decode(errors="replace") == full
        else:   # text offsets run on across chunks
            offsets = [o for choice in mine if choice["logprobs"] for o in choice["logprobs"]["text_offset"]]
            assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_vocabulary_ids_render_empty(serve, path, stream):
    srv = serve(OutOfVocabEngine())
    body = (CHAT | {"logprobs": True, "top_logprobs": 2}) if "chat" in path else COMPLETION | {"logprobs": 2}
    if stream:
        chunks = events(srv, path, body)
        entries = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    else:
        response = srv.post(path, body)
        assert response.status_code == 200, response.text
        entries = [response.json()["choices"][0]["logprobs"]]
    if "chat" in path:
        content = [entry for lp in entries for entry in lp["content"]]
        assert len(content) == 4 and all(e["token"] == "" and e["bytes"] == [] for e in content)
        assert all([alt["token"] for alt in e["top_logprobs"]] == ["", ""] for e in content)
    else:
        assert [t for lp in entries for t in lp["tokens"]] == [""] * 4
        assert all(list(top) == [""] for lp in entries for top in lp["top_logprobs"])


def test_token_strings():
    engine = FakeEngine()
    strings = TokenStrings(engine.tokenizer)
    for token_id in (engine.tokenizer.get_vocab_size(), 10**6, -1, 2**70):
        assert strings.get(token_id) == ("", [])
    text = "naïve 😀 <|endoftext|>!"
    ids = engine.tokenizer.encode(text).ids
    assert b"".join(bytes(strings.get(t)[1]) for t in ids) == text.encode()
    assert strings.get(engine.eos_token_id) == ("<|endoftext|>", list(b"<|endoftext|>"))


def test_shape_of_edge_cases():
    """A choice ended before any token has empty log-probabilities; -inf and NaN become OpenAI's -9999 (JSON has no
    infinity)."""
    strings = TokenStrings(FakeEngine().tokenizer)
    for kind, empty in [("completions", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}),
                        ("chat", {"content": []})]:
        shape = Shape(kind, "id", MODEL, 2, 5, 1, strings)
        shape.add(0, TokenEvent("id-0", None, "", True, "abort", Usage(5, 0, 3)))
        assert not shape.done
        shape.add(1, TokenEvent("id-1", 65, "b", logprob=float("-inf"), top_logprobs=[(65, float("nan"))]))
        shape.add(1, TokenEvent("id-1", 66, "c", True, "length", None, logprob=-0.5, top_logprobs=[(66, -0.5)]))
        body = shape.full()
        assert shape.done and body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
        assert body["choices"][0]["logprobs"] == empty and body["choices"][0]["finish_reason"] == "abort"
        second = body["choices"][1]["logprobs"]
        if kind == "chat":
            assert [(e["logprob"], e["top_logprobs"][0]["logprob"]) for e in second["content"]] == \
                [(NO_LOGPROB, NO_LOGPROB), (-0.5, -0.5)]
        else:
            assert second["token_logprobs"] == [NO_LOGPROB, -0.5] and second["text_offset"] == [0, 1]
        json.dumps(body, allow_nan=False)


# -- ignore_eos ------------------------------------------------------------------------------------------
def test_ignore_eos(serve):
    srv = serve()
    eos = srv.engine.eos_token_id
    body = {"model": MODEL, "prompt": [70, 71, eos], "max_tokens": 10}
    assert srv.post("/v1/completions", body).json()["choices"][0]["finish_reason"] == "stop"
    response = srv.post("/v1/completions", body | {"ignore_eos": True}).json()
    assert response["choices"][0]["finish_reason"] == "length" and response["usage"]["completion_tokens"] == 10
    assert srv.engine.requests[-1].params.ignore_eos
    resp = srv.client().chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3,
                                                extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and srv.engine.requests[-1].params.ignore_eos


def test_min_tokens(serve):
    """``min_tokens`` (vLLM's extension) holds the end back: the echo passes the EOS at token 3 and stops at the
    next one, token 6; more than max_tokens is the client's error, naming the field."""
    srv = serve()
    eos = srv.engine.eos_token_id
    body = {"model": MODEL, "prompt": [70, 71, eos], "max_tokens": 10}
    response = srv.post("/v1/completions", body | {"min_tokens": 4}).json()
    assert response["choices"][0]["finish_reason"] == "stop" and response["usage"]["completion_tokens"] == 6
    assert srv.engine.requests[-1].params.min_tokens == 4
    error = srv.post("/v1/completions", body | {"min_tokens": 11})
    assert error.status_code == 400 and "min_tokens" in error.json()["error"]["message"]


# -- failures and disconnects ----------------------------------------------------------------------------
def test_one_choice_failing_ends_the_request(serve):
    srv = serve(FailingChoiceEngine(token_delay=0.01))
    error = assert_openai_error(srv.post("/v1/completions", COMPLETION | {"n": 3, "max_tokens": 50}), 500,
                                "server_error")
    assert "non-finite logits" in error["message"]
    rids = [r.request_id for r in srv.engine.requests]
    wait_for(lambda: {rids[0], rids[2]} <= set(srv.engine.ended_early) and srv.engine.allocated == 0)
    chunks = events(srv, "/v1/chat/completions", CHAT | {"n": 3, "max_tokens": 50})
    assert "non-finite logits" in chunks[-1]["error"]["message"]
    assert not any(c.get("choices") and c["choices"][0]["finish_reason"] for c in chunks[:-1])
    rids = [r.request_id for r in srv.engine.requests[3:]]
    wait_for(lambda: {rids[0], rids[2]} <= set(srv.engine.abort_calls) and srv.engine.allocated == 0)
    with pytest.raises(openai.APIError):
        list(srv.client().completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=50, stream=True))


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_every_choice(serve, stream):
    srv = serve(FakeEngine(token_delay=0.01))
    body = COMPLETION | {"max_tokens": 400, "n": 3, "stream": stream}
    if stream:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as leaving:
            lines = leaving.iter_lines()
            next(lines), next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            srv.post("/v1/completions", body, timeout=0.3)
    rids = [r.request_id for r in srv.engine.requests]
    assert len(rids) == 3
    wait_for(lambda: set(rids) <= set(srv.engine.ended_early) and srv.engine.allocated == 0)
    assert set(rids) <= set(srv.engine.abort_calls)
    assert srv.engine.stats().running == 0
    assert 'finish_reason="abort"} 3.0' in httpx.get(srv.url + "/metrics").text


# -- the real engine -------------------------------------------------------------------------------------
def test_real_engine_choices_logprobs_and_ignore_eos(serve, serve_model, serve_tokenizer):
    """Greedy choices of the tiny random K3 agree with each other, and their log-probabilities with the model's own
    log-softmax; ignore_eos and the chat's top_logprobs reach the engine."""
    import torch

    from tests.serve.test_engine import assert_no_leak, reference
    from tests.serve.test_serve_e2e import real_engine

    engine = real_engine(serve_model, serve_tokenizer)
    try:
        srv = serve(engine)
        prompt = [5, 17, 200, 3, 99, 41, 250, 7]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2, "logprobs": 3,
                "ignore_eos": True}
        response = srv.post("/v1/completions", body, timeout=60)
        assert response.status_code == 200, response.text
        choices, usage = response.json()["choices"], response.json()["usage"]
        out = reference(serve_model, prompt, 6)
        assert usage["completion_tokens"] == 12
        assert [c["text"] for c in choices] == [serve_tokenizer.decode(out).rstrip("\ufffd")] * 2   # as flushed
        assert choices[0]["logprobs"]["tokens"] == choices[1]["logprobs"]["tokens"]
        with torch.no_grad():
            logits = serve_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
        expected = torch.log_softmax(logits, dim=-1)
        strings = TokenStrings(serve_tokenizer)
        for lp in (choice["logprobs"] for choice in choices):
            assert lp["tokens"] == [strings.get(t)[0] for t in out]
            assert lp["token_logprobs"] == pytest.approx([expected[i, t].item() for i, t in enumerate(out)], abs=1e-3)
            for top, row in zip(lp["top_logprobs"], expected, strict=True):
                assert max(top.values()) == pytest.approx(row.max().item(), abs=1e-3)
        chunks = events(srv, "/v1/chat/completions", {"model": "tiny", "messages": CHAT["messages"], "max_tokens": 5,
                                                      "temperature": 0, "logprobs": True, "top_logprobs": 2, "n": 2})
        for index in range(2):
            content = [e for c in chunks if c["choices"] and c["choices"][0]["index"] == index
                       and c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
            assert 1 <= len(content) <= 5 and all(len(e["top_logprobs"]) == 2 for e in content)
        assert engine.health() is None
        wait_for(lambda: engine.stats().running == 0, timeout=10)
        assert_no_leak(engine)
    finally:
        engine.close()
