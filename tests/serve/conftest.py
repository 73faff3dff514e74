"""A small random K3 (the tiny preset with a 512-token vocabulary) and a byte-level BPE to match."""

import dataclasses
import inspect
from collections.abc import Callable, Iterator

import pytest
import torch

from kimik3.config import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.serve.fake_engine import FakeEngine
from kimik3.train.data import Document
from kimik3.train.tokenizer import train_tokenizer

VOCAB = 512


@pytest.fixture(scope="session")
def serve_tokenizer():
    import kimik3

    text = inspect.getsource(kimik3.model.k3) + inspect.getsource(kimik3.serve.types)
    docs = [Document(f"part{i}", text[i:i + 2000]) for i in range(0, len(text), 2000)]
    return train_tokenizer(docs, VOCAB)


@pytest.fixture(scope="session")
def serve_model():
    config = dataclasses.replace(K3Config.preset("tiny"), vocab_size=VOCAB, max_seq_len=2048)
    torch.manual_seed(0)
    return K3ForCausalLM(config, device="cpu", dtype=torch.float32, seed=0).eval()


@pytest.fixture
def serve() -> Iterator[Callable[..., object]]:
    # Imported here: the HTTP stack (openai, uvicorn) is only needed by the tests that start a server.
    from tests.serve.http_server import KEY, Server

    servers = []

    def start(engine: FakeEngine | None = None, api_key: str | None = KEY, **app_options):
        servers.append(Server(engine or FakeEngine(), api_key, **app_options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
