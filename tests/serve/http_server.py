"""A uvicorn server on a free loopback port, in a thread, for tests that speak real HTTP."""

import socket
import threading
import time

import openai
import uvicorn

try:
    import httpx
except ImportError:  # some environments ship the renamed fork the openai client depends on
    import httpx2 as httpx

from kimik3.serve.server import create_app
from kimik3.serve.types import EngineLike

KEY = "sk-test"


class Server:
    def __init__(self, engine: EngineLike, api_key: str | None, **app_options) -> None:
        self.engine = engine
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(engine, api_key, **app_options), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def client(self, key: str | None = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kw)

    def post(self, path: str, body=None, key: str | None = KEY, timeout: float = 10) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if isinstance(body, bytes):
            headers["Content-Type"] = "application/json"
            return httpx.post(self.url + path, content=body, headers=headers, timeout=timeout)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
