"""`kimik3 serve` as a user runs it: a subprocess on a run directory, answered by the openai client."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from kimik3.cli import resolve_run


def write_run(directory: Path, model, tokenizer) -> Path:
    model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def test_resolve_run_defaults_to_the_newest_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="kimik3 train"):
        resolve_run(None)
    for name in ("tiny-1", "tiny-2"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "model.safetensors").write_bytes(b"")
        time.sleep(0.01)
    (tmp_path / "runs" / "unfinished").mkdir()
    assert resolve_run(None) == Path("runs/tiny-2")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_run("runs/nope")


def test_kimik3_serve_answers_the_openai_client(tmp_path, serve_model, serve_tokenizer):
    run = write_run(tmp_path / "run", serve_model, serve_tokenizer)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "serve", "--run", str(run), "--port", str(port),
                             "--api-key", "sk-cli", "--memory-mb", "32", "--replicas", "2", "--max-waiting", "0",
                             "--max-request-bytes", "20000", "--served-model-name", "k3-test"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-cli", max_retries=0, timeout=30)
        deadline = time.monotonic() + 90
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "kimik3 serve did not come up"
                time.sleep(0.3)
        assert [m.id for m in models.data] == ["k3-test"]  # --served-model-name, not the directory's name
        reply = client.chat.completions.create(model="k3-test", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1        # an idle server with no queue still serves
        with pytest.raises(openai.APIStatusError) as too_big:
            client.completions.create(model="k3-test", prompt="x" * 30_000, max_tokens=1)
        assert too_big.value.status_code == 413 and too_big.value.body["code"] == "request_too_large"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
