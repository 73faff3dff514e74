"""A tiny multimodal K3 (``tiny-vl``, 512-token vocabulary, random weights, fp32 CPU), a BPE with the media tokens
to match, and PNG/JPEG data URLs, for the vision serving tests."""

import base64
import dataclasses
import inspect
import io

import numpy as np
import torch
from PIL import Image

from kimik3.config import K3Config
from kimik3.model.vision import K3VLForCausalLM
from kimik3.serve.engine import LLMEngine
from kimik3.serve.memory import EngineConfig
from kimik3.tokenizer import MEDIA_BEGIN, MEDIA_END, MEDIA_PAD, add_media_tokens
from kimik3.train.data import Document
from kimik3.train.tokenizer import train_tokenizer

VOCAB = 512
GREEDY = dict(temperature=0.0)


def vl_tokenizer():
    """A byte-level BPE of VOCAB - 3 entries, then the media tokens: ``<|media_pad|>`` is VOCAB - 1, the tiny-vl
    model's placeholder id."""
    import kimik3

    text = inspect.getsource(kimik3.serve.types)
    tokenizer = train_tokenizer([Document(f"p{i}", text[i:i + 2000]) for i in range(0, len(text), 2000)], VOCAB - 3)
    media = add_media_tokens(tokenizer, VOCAB)
    assert media[MEDIA_PAD] == VOCAB - 1 and media[MEDIA_BEGIN] == VOCAB - 3 and media[MEDIA_END] == VOCAB - 2
    return tokenizer


def vl_model():
    config = dataclasses.replace(K3Config.preset("tiny-vl"), vocab_size=VOCAB, max_seq_len=1024)
    return K3VLForCausalLM(config, device="cpu", dtype=torch.float32, seed=0).eval()


def vl_engine(model, tokenizer, **overrides) -> LLMEngine:
    settings = dict(memory_bytes=32 * 2**20, hash_block=16, physical_block=64, max_running=4, checkpoints=16,
                    prefill_chunk=64, max_context=512)
    settings.update(overrides)
    return LLMEngine(model, tokenizer, EngineConfig(**settings), model_name="tiny-vl-test")


def pixels(height: int, width: int, seed: int) -> np.ndarray:
    """A random RGB image with a smooth gradient (so JPEG keeps it recognisable)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, 3) + rng.uniform(-2, 2, 3) * (x[..., None] + y[..., None])
    return np.clip(base + rng.normal(0, 6, (height, width, 3)), 0, 255).astype(np.uint8)


def encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
