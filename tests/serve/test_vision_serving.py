"""Images through the serving engine and the HTTP server, on a tiny random multimodal K3 (fp32 CPU).

The prefix cache must stay exact: the placeholder ids of two different images are identical, so only the image
digests folded into the block hashes keep a request from restoring a state computed over another image."""

import dataclasses

import pytest
import torch

from kimik3.serve.images import ImageLimits, ImageRule, prepare_image
from kimik3.serve.types import GenerationRequest, SamplingParams
from tests.serve.vision_helpers import GREEDY, data_url, encoded, pixels, vl_engine, vl_model, vl_tokenizer

BEGIN, END, PAD = 509, 510, 511
SYSTEM = list(range(10, 30))     # 20 text tokens before the image: block 0 (hash block 16) is text only
QUESTION = list(range(30, 36))


@pytest.fixture(scope="module")
def vl():
    model, tokenizer = vl_model(), vl_tokenizer()
    rule = ImageRule.of(model.config)
    assert rule.image_token_id == PAD
    # 84 x 112 pixels: 6 x 8 patches, 3 x 4 = 12 image tokens at positions 21..32 of the prompt
    images = [prepare_image(pixels(84, 112, seed=s), rule) for s in (1, 2)]
    return model, tokenizer, images


def prompt(image) -> list[int]:
    return SYSTEM + [BEGIN] + [PAD] * image.num_tokens + [END] + QUESTION


def run(engine, image, rid: str, max_tokens: int = 4):
    """(tokens, the top-20 log-probabilities of each step, usage) of one greedy request."""
    request = GenerationRequest(rid, prompt(image), SamplingParams(max_tokens=max_tokens, logprobs=20, **GREEDY),
                                boundary_hints=[len(SYSTEM)], images=[image])
    events = list(engine.generate_blocking(request))
    assert events[-1].finish_reason == "length", events[-1].error
    tokens = [e.token_id for e in events if e.token_id is not None]
    return tokens, [dict(e.top_logprobs) for e in events if e.top_logprobs is not None], events[-1].usage


def close(a: list[dict], b: list[dict], tol: float) -> bool:
    return all(x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) <= tol for x, y in zip(a, b))


def uncached(model, tokenizer, image, rid):
    engine = vl_engine(model, tokenizer, checkpoints=0)
    try:
        return run(engine, image, rid)
    finally:
        engine.close()


def reference(model, image, n: int) -> list[int]:
    """Greedy tokens by full forwards of the model's own multimodal path (no cache)."""
    ids = prompt(image)
    grid = torch.tensor([image.grid])
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), pixel_values=image.pixel_values, image_grid_hw=grid).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[-n:]


def test_different_images_never_share_cache_and_the_same_image_reuses_it(vl):
    model, tokenizer, (a, b) = vl
    base = {name: uncached(model, tokenizer, image, name) for name, image in (("a", a), ("b", b))}
    assert base["a"][0] == reference(model, a, 4) and base["b"][0] == reference(model, b, 4)
    assert not close(base["a"][1], base["b"][1], 1e-3), "the images must change the output for this test to mean much"
    engine = vl_engine(model, tokenizer)
    encodes = []
    hook = model.vision_tower.register_forward_hook(lambda *_: encodes.append(1))
    try:
        first = run(engine, a, "a1")
        other = run(engine, b, "b1")      # the same text, another image
        again = run(engine, a, "a2")      # the first image again
        stats = engine.stats()
    finally:
        hook.remove()
        engine.close()
    # The other image restores only the text before it (the system prompt's checkpoint at 16), never a state
    # computed over the first image (the prompt tail at 32 lies inside the image's placeholders 21..32).
    assert other[2].cached_tokens == 16
    assert other[0] == base["b"][0] and close(other[1], base["b"][1], 1e-4)
    assert not close(other[1], first[1], 1e-3)
    # The same image hits the checkpoint at 32 (inside its placeholders: the last one is recomputed from the
    # image's own embedding) and gives the uncached run's tokens.
    assert again[2].cached_tokens == 32 and stats.prefix_hits == 2
    assert again[0] == first[0] == base["a"][0] and close(again[1], base["a"][1], 1e-4)
    assert [u.image_tokens for u in (first[2], other[2], again[2])] == [12, 12, 12]
    assert first[2].prompt_tokens == len(prompt(a)) == 40
    assert len(encodes) == 3   # each request encoded its image once


def test_a_chunk_boundary_inside_the_image_takes_the_slice_it_needs(vl):
    model, tokenizer, (a, _) = vl
    base = uncached(model, tokenizer, a, "whole")
    engine = vl_engine(model, tokenizer, prefill_chunk=8, checkpoints=0)   # chunks 16-24, 24-32, 32-40 cut 21..32
    encodes, chunks = [], []
    hooks = [model.vision_tower.register_forward_hook(lambda *_: encodes.append(1)),
             model.layers[0].register_forward_pre_hook(lambda _, args: chunks.append(args[0].shape[1]))]
    try:
        tokens, logprobs, usage = run(engine, a, "chunked")
    finally:
        for hook in hooks:
            hook.remove()
        engine.close()
    assert chunks[:5] == [8] * 5 and len(encodes) == 1
    assert tokens == base[0] and close(logprobs, base[1], 1e-4) and usage.image_tokens == 12


def test_the_engine_checks_images_against_the_prompt(vl, serve_model, serve_tokenizer):
    model, tokenizer, (a, b) = vl
    engine = vl_engine(model, tokenizer)
    try:
        for ids, images, message in (
                (prompt(a), [a, b], "holds 12 image placeholders .* take 24"),
                (prompt(a)[:-8] + QUESTION, [a], "holds 11 image placeholders"),
                (SYSTEM + [PAD] * 6 + [1] + [PAD] * 6, [a], "not consecutive")):
            with pytest.raises(ValueError, match=message):
                engine.submit(GenerationRequest("x", ids, SamplingParams(), images=images), lambda e: None)
        odd = dataclasses.replace(a, grid=(6, 6))
        with pytest.raises(ValueError, match="not prepared for this model's tower"):
            engine.submit(GenerationRequest("x", prompt(a), SamplingParams(), images=[odd]), lambda e: None)
    finally:
        engine.close()
    from tests.serve.test_engine import make_engine

    text_only = make_engine(serve_model, serve_tokenizer)
    try:
        assert text_only.image_rule is None
        with pytest.raises(ValueError, match="this model has no vision tower"):
            text_only.submit(GenerationRequest("x", prompt(a), SamplingParams(), images=[a]), lambda e: None)
    finally:
        text_only.close()


# -- over HTTP ------------------------------------------------------------------------------------------------
def _chat(url: str, text: str = "What is this?") -> dict:
    return {"model": "tiny-vl-test", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": "You look at images."},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": text}]}]}


@pytest.fixture(scope="module")
def vl_server(vl):
    from tests.serve.http_server import KEY, Server

    model, tokenizer, _ = vl
    engine = vl_engine(model, tokenizer)
    server = Server(engine, KEY, image_limits=ImageLimits(max_bytes=40_000, max_pixels=300 * 300, max_images=2))
    yield server
    server.stop()
    engine.close()


def test_chat_with_an_image_counts_it_in_usage_and_reuses_the_cache(vl_server, vl):
    model, tokenizer, _ = vl
    rgb = pixels(84, 112, seed=3)
    body = _chat(data_url(encoded(rgb)))
    first = vl_server.post("/v1/chat/completions", body)
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert usage["prompt_tokens_details"]["image_tokens"] == 12 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    again = vl_server.post("/v1/chat/completions", body).json()
    assert again["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    # The prompt the engine saw: the template's, with the image's media tokens where the part was.
    from kimik3.serve.chat import ChatEncoder

    ids, _ = ChatEncoder(tokenizer).encode(_chat_messages(body), image_tokens=[12])
    assert usage["prompt_tokens"] == len(ids) and ids.count(PAD) == 12
    start = ids.index(BEGIN)
    assert ids[start:start + 14] == [BEGIN] + [PAD] * 12 + [END]
    # JPEG is accepted too.
    jpeg = vl_server.post("/v1/chat/completions", _chat(data_url(encoded(rgb, "JPEG"), "image/jpeg")))
    assert jpeg.status_code == 200 and jpeg.json()["usage"]["prompt_tokens_details"]["image_tokens"] == 12


def _chat_messages(body):
    from kimik3.serve.chat import parse_messages

    return parse_messages(body["messages"])


def test_bad_images_get_a_400_naming_the_part(vl_server):
    png = encoded(pixels(64, 64, seed=4))
    big = encoded(pixels(400, 400, seed=5), "JPEG")
    cases = [
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "only image/png and image/jpeg"),
        (data_url(png[:len(png) // 2]), "truncated or corrupt"),
        (data_url(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(8) + b"\x08\x02\x00\x00\x00"), "zero size"),
        (data_url(b"<html>not an image</html>"), "neither a PNG nor a JPEG"),
        (data_url(big, "image/jpeg"), "400 x 400 = 160,000 pixels, more than this server's limit of 90,000"),
        (data_url(png * 30), "larger than this server's limit of 40,000 bytes"),
    ]
    for url, message in cases:
        response = vl_server.post("/v1/chat/completions", _chat(url))
        assert response.status_code == 400, (message, response.text)
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        assert error["param"] == "messages[1].content[0].image_url"
    three = _chat(data_url(png))
    three["messages"][1]["content"] *= 3
    response = vl_server.post("/v1/chat/completions", three)
    assert response.status_code == 400 and "at most 2" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages[1].content[4].image_url"
    assert vl_server.post("/v1/chat/completions", _chat(data_url(png))).status_code == 200   # still serving


def test_a_text_only_model_refuses_image_parts(serve):
    server = serve()   # the fake engine: no vision tower
    response = server.post("/v1/chat/completions", _chat(data_url(encoded(pixels(8, 8, seed=6)))) | {"model": "fake-k3"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "this model has no vision tower" in error["message"]
    assert error["param"] == "messages[1].content[0].image_url"
