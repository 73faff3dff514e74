"""Images of chat requests before the engine: data URLs decoded and refused for each kind of bad input, the
training preprocessing reused, the chat template's layout, and the prefix cache's image-aware block keys."""

import struct
import zlib

import numpy as np
import pytest
import torch

from kimik3.model.vision.tokens import num_image_tokens, preprocess_image
from kimik3.serve.chat import ChatEncoder, ImagePart, parse_messages
from kimik3.serve.images import (ImageError, ImageLimits, ImageRule, decode_data_url, decode_image, load_image_url,
                                 prepare_image)
from kimik3.serve.multimodal import MediaSpan, MediaTokens, media_spans
from kimik3.serve.prefix_cache import BlockHasher
from tests.serve.vision_helpers import data_url, encoded, pixels, vl_tokenizer

RULE = ImageRule(patch_size=14, merge_size=2, max_tokens=16_384, image_token_id=511)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` RGB pixels (its data is a few bytes)."""
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + _png_chunk(b"IEND", b""))


def _jpeg_header(width: int, height: int) -> bytes:
    """A JPEG whose frame header claims ``width`` x ``height`` pixels (a real 8 x 8 one, its size rewritten)."""
    data = bytearray(encoded(pixels(8, 8, seed=0), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("JPEG", "image/jpg")])
def test_png_and_jpeg_data_urls_become_the_training_patches(fmt, mime):
    rgb = pixels(50, 90, seed=1)
    prepared = load_image_url(data_url(encoded(rgb, fmt), mime), RULE)
    decoded = decode_image(encoded(rgb, fmt))
    if fmt == "PNG":
        assert np.array_equal(decoded, rgb)          # lossless: the very pixels
    else:
        assert decoded.shape == rgb.shape and np.abs(decoded.astype(int) - rgb).mean() < 8
    patches, grid = preprocess_image(torch.from_numpy(decoded))   # training's own function
    assert prepared.grid == grid == (4, 8)
    assert torch.equal(prepared.pixel_values, patches)
    assert prepared.num_tokens == num_image_tokens(50, 90) == 2 * 4


def test_alpha_and_palette_images_are_converted_to_rgb():
    from PIL import Image
    import io

    rgba = np.concatenate([pixels(30, 30, seed=2), np.full((30, 30, 1), 7, np.uint8)], axis=2)
    out = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(out, "PNG")
    assert np.array_equal(decode_image(out.getvalue()), rgba[..., :3])
    out = io.BytesIO()
    Image.fromarray(pixels(20, 20, seed=3)).convert("P").save(out, "PNG")
    assert decode_image(out.getvalue()).shape == (20, 20, 3)


def test_the_digest_names_the_pixels():
    a, b = pixels(40, 40, seed=4), pixels(40, 40, seed=4)
    assert prepare_image(a, RULE).digest == prepare_image(b, RULE).digest
    b[0, 0, 0] ^= 1
    assert prepare_image(a, RULE).digest != prepare_image(b, RULE).digest
    assert prepare_image(a[:, :20], RULE).digest != prepare_image(a[:20], RULE).digest == prepare_image(
        np.ascontiguousarray(a[:20]), RULE).digest


BAD_URLS = [
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("HTTP://example.com/cat.png", "remote image URLs are not fetched"),
    ("ftp://example.com/cat.png", "must be a data URL"),
    ("/tmp/cat.png", "must be a data URL"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "unsupported image type 'image/gif'"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported image type 'text/plain'"),
    ("data:image/png,rawbytes", "must be base64-encoded"),
    ("data:image/png;base64,not base64!", "not valid base64"),
    ("data:image/png;base64,", "the image is empty"),
    (12, "must be a string"),
]


@pytest.mark.parametrize("url, message", BAD_URLS)
def test_bad_urls_are_refused_with_what_is_wrong(url, message):
    with pytest.raises(ImageError, match=message):
        load_image_url(url, RULE)


def test_bad_files_are_refused_with_what_is_wrong():
    png = encoded(pixels(64, 64, seed=5))
    cases = [
        (png[:len(png) // 2], "truncated or corrupt"),
        (encoded(pixels(64, 64, seed=5), "JPEG")[:-200], "truncated or corrupt"),
        (_png_header(0, 10), "zero size"),
        (_png_header(10, 0), "zero size"),
        (_png_header(30_000, 30_000), "more than this server's limit of 50,000,000"),   # a bomb, never inflated
        (_png_header(200_000, 200_000), "more than this server's limit of 50,000,000"),
        (_jpeg_header(20_000, 20_000), "more pixels than this server's limit of 50,000,000"),   # past Pillow's bound
        (_jpeg_header(8_000, 8_000), "more than this server's limit of 50,000,000"),
        (encoded(pixels(8, 8, seed=6), "GIF"), "neither a PNG nor a JPEG"),
        (encoded(pixels(8, 8, seed=6), "BMP"), "neither a PNG nor a JPEG"),
        (b"hello, world", "neither a PNG nor a JPEG"),
    ]
    for data, message in cases:
        with pytest.raises(ImageError, match=message):
            load_image_url(data_url(data), RULE)


def test_limits_bound_the_bytes_and_pixels():
    png = encoded(pixels(64, 64, seed=7))
    assert load_image_url(data_url(png), RULE, ImageLimits(max_bytes=len(png))).grid == (6, 6)
    with pytest.raises(ImageError, match=f"limit of {len(png) - 1:,} bytes"):
        decode_data_url(data_url(png), ImageLimits(max_bytes=len(png) - 1))
    with pytest.raises(ImageError, match="limit of 1,000 bytes"):   # refused from the URL's length, undecoded
        decode_data_url("data:image/png;base64," + "A" * 8000, ImageLimits(max_bytes=1000))
    with pytest.raises(ImageError, match="64 x 64 = 4,096 pixels, more than this server's limit of 4,095"):
        load_image_url(data_url(png), RULE, ImageLimits(max_pixels=4095))
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


def test_a_large_image_is_resized_to_the_token_budget():
    rule = ImageRule(14, 2, max_tokens=16, image_token_id=511)
    prepared = prepare_image(pixels(300, 200, seed=8), rule)
    assert prepared.num_tokens <= 16 and prepared.num_tokens == num_image_tokens(300, 200, max_tokens=16)


# -- the chat template ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(vl_tokenizer())


def test_image_parts_become_media_tokens_in_place(encoder):
    url = "data:image/png;base64,AAAA"
    messages = parse_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": " and "}, {"type": "image_url", "image_url": url},
                                     {"type": "text", "text": "what now?"}]}])
    assert messages[1].content == "Look:  and what now?"
    assert messages[1].images == [ImagePart(url, "messages[1].content[1].image_url"),
                                  ImagePart(url, "messages[1].content[3].image_url")]
    ids, hints = encoder.encode(messages, image_tokens=[3, 2])
    begin, pad, end = encoder.media_ids
    assert (begin, pad, end) == (509, 511, 510)
    system_ids, _ = encoder.encode(messages[:1], add_generation_prompt=False)
    text = encoder._encode
    user_before, user_after = encoder._pieces["user"]
    expected = (system_ids + user_before + text("Look: ") + [begin, pad, pad, pad, end] + text(" and ")
                + [begin, pad, pad, end] + text("what now?") + user_after)
    assert ids == expected + encoder._generation_prompt
    assert hints == [len(system_ids), len(expected)]
    assert media_spans(ids, [_Img(3), _Img(2)], pad) == (MediaSpan(ids.index(pad), 3, b"3"),
                                                         MediaSpan(len(expected) - len(user_after)
                                                                   - len(text("what now?")) - 3, 2, b"2"))
    # A message of text parts only is encoded exactly as its joined text.
    plain = parse_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert plain[0].parts == () and encoder.encode(plain) == encoder.encode([{"role": "user", "content": "ab"}])


class _Img:
    def __init__(self, n):
        self.num_tokens, self.digest = n, str(n).encode()


def test_bad_image_parts_are_refused(encoder):
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: image parts are accepted in user messages"):
        parse_messages([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: an image part is"):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"uri": "x"}}]}])
    with pytest.raises(ValueError, match="only text parts .* and image parts"):
        parse_messages([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    messages = parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="token count is missing"):
        encoder.encode(messages)
    text_only = ChatEncoder(_text_tokenizer())
    with pytest.raises(ValueError, match="this tokenizer has no media tokens"):
        text_only.encode(messages, image_tokens=[4])


def _text_tokenizer():
    from kimik3.train.data import Document
    from kimik3.train.tokenizer import train_tokenizer

    return train_tokenizer([Document("a", "some text to learn a few merges from " * 20)], 300)


# -- prefix-cache keys --------------------------------------------------------------------------------------
def test_media_spans_match_placeholders_to_images():
    ids = [1, 2, 9, 9, 9, 3, 9, 9, 4]
    assert media_spans(ids, [_Img(3), _Img(2)], 9) == (MediaSpan(2, 3, b"3"), MediaSpan(6, 2, b"2"))
    with pytest.raises(ValueError, match="holds 5 image placeholders .* take 4"):
        media_spans(ids, [_Img(2), _Img(2)], 9)
    with pytest.raises(ValueError, match="image 0's 4 placeholders are not consecutive"):
        media_spans(ids, [_Img(4), _Img(1)], 9)


def test_block_hashes_name_the_image_from_its_first_block_on():
    hasher = BlockHasher(4)
    ids = [5, 6, 7, 8, 1, 1, 9, 9, 9, 9, 9, 9, 2, 3, 4, 5, 6, 7]   # the image: positions 6..11
    plain = hasher(list(ids))
    a = hasher(MediaTokens(ids, [MediaSpan(6, 6, b"a" * 32)]))
    b = hasher(MediaTokens(ids, [MediaSpan(6, 6, b"b" * 32)]))
    assert len(plain) == len(a) == len(b) == 4
    assert a[0] == b[0] == plain[0]                                      # the block before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))                     # the image's blocks and every later one
    assert all(x != y for x, y in zip(a[1:], plain[1:]))
    assert a == hasher(MediaTokens(ids, [MediaSpan(6, 6, b"a" * 32)]))   # the same image: the same keys
    assert hasher(MediaTokens(ids, [])) == plain                         # no images: the text hashes


def test_media_tokens_grow_and_slice_with_their_spans():
    tokens = MediaTokens([1, 9, 9, 9, 2], [MediaSpan(1, 3, b"d")])
    tokens.append(7)
    assert tokens == [1, 9, 9, 9, 2, 7] and tokens.spans == (MediaSpan(1, 3, b"d"),)
    assert tokens[:3].spans == (MediaSpan(1, 2, b"d"),) and tokens[:1].spans == ()
    assert tokens[:3].block_key(0, 2) == tokens.block_key(0, 2)        # a prefix keys its blocks alike
    assert type(tokens[2:]) is list and tokens[-1] == 7
    assert tokens.block_key(0, 4) == b"d" + (0).to_bytes(8, "little")
    assert tokens.block_key(1, 2) == b"d" + (1).to_bytes(8, "little")   # positions 2..3: image tokens 1..2
    assert MediaTokens([0] * 8, [MediaSpan(1, 5, b"d")]).block_key(1, 4) == b"d" + (3).to_bytes(8, "little")
    assert tokens.block_key(2, 2) == b""                               # positions 4..5: text
