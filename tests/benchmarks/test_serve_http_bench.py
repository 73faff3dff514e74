"""benchmarks/serve_http.py (the HTTP serving benchmark, graphs vs --enforce-eager) and
benchmarks/make_serve_run.py (the random-weight run it serves), end to end on CPU at a small scale.

The end-to-end tests start real `kimik3 serve` subprocesses on the tiny preset and drive them with the
openai client, as the benchmark does on the H200; the others check the pieces that need no server:
the padded vocabulary, the cache budget the benchmark gives the servers, and its statistics.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the benchmark drives the servers with the openai client (pip install openai)")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("serve_http")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return load("make_serve_run").make_run(tmp_path_factory.mktemp("serve-run") / "tiny", preset="tiny",
                                           device="cpu", seed=0)


def test_the_padded_tokenizer_streams_every_id_as_text():
    from kimik3.train.data import Document
    from kimik3.train.tokenizer import train_tokenizer

    make = load("make_serve_run")
    text = (BENCHMARKS / "serve_http.py").read_text()
    bpe = train_tokenizer([Document(f"p{i}", text[i:i + 2000]) for i in range(0, len(text), 2000)], 300)
    padded = make.pad_vocabulary(bpe, 2000)
    assert padded.get_vocab_size() == 2000
    assert all(padded.decode([i]) for i in range(300, 2000))      # no id of the model's streams as nothing
    assert bpe.decode([1500]) == ""                              # what the bare BPE does with it
    sample = "def main(argv):\n    return 0  # ab abc\n"
    assert padded.encode(sample).ids == bpe.encode(sample).ids    # encoding text is unchanged


def test_the_servers_get_a_cache_that_holds_every_sequence_at_once(bench):
    from kimik3.config import K3Config
    from kimik3.serve.memory import EngineConfig, plan_cache
    from kimik3.model.k3 import default_dtype

    config = K3Config.preset("debug")
    args = bench.default_server_args(config, "cuda", [1, 16, 64], 768, [])
    assert args[:4] == ["--device", "cuda", "--max-running", "64"]
    layout = plan_cache(config, EngineConfig(memory_bytes=int(float(args[5]) * 2**20), max_running=64),
                        default_dtype("cuda"))
    assert layout.num_blocks >= (64 + 64) * math.ceil(768 / 192)   # running sequences + checkpoints
    # what the user passes wins, and is not repeated
    assert bench.default_server_args(config, "cuda", [64], 768, ["--memory-mb", "5000", "--device", "cuda:1"]) \
        == ["--max-running", "64"]


def test_statistics_and_ratios(bench):
    fast = [bench.RequestResult(start=0.0, token_times=[0.1, 0.2, 0.3, 0.4], last_choice=0.4, end=0.45, tokens=4,
                                finish_reason="length")]
    slow = [bench.RequestResult(start=0.0, token_times=[0.2, 0.5, 0.8, 1.1], last_choice=1.1, end=1.2, tokens=4,
                                finish_reason="length"), bench.RequestResult(start=0.0, error="APIError: boom")]
    a, b = bench.summarise(fast, 0.5, 4), bench.summarise(slow, 1.0, 4)
    assert a["output_tok_s"] == pytest.approx(8.0) and a["ttft_p50_ms"] == pytest.approx(100.0)
    assert a["tpot_p50_ms"] == pytest.approx(100.0) and b["tpot_p50_ms"] == pytest.approx(300.0)
    assert b["failed"] == 1 and b["errors"] == ["APIError: boom"] and a["short_requests"] == 0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and bench.percentile([], 50) is None
    servers = {"graphs": {"levels": [{"concurrency": 1, **a}]}, "eager": {"levels": [{"concurrency": 1, **b}]}}
    rows = bench.build_rows([(1, [[1]] * 2, [])], ["graphs", "eager"], servers)
    assert rows[0]["ratio"]["output_tok_s"] == pytest.approx(2.0)
    assert rows[0]["ratio"]["tpot_p50_ms"] == pytest.approx(1 / 3)
    table = bench.markdown({"servers": servers, "levels": rows, "ratio_name": "graphs/eager"})
    assert "| 1 | | **graphs/eager** | 2.00x |" in table


def run_bench(bench, run: Path, tmp_path: Path, peer_args: str) -> dict:
    out = tmp_path / "serve_http.json"
    rc = bench.main(["--run", str(run), "--device", "cpu", "--levels", "1,2", "--prompt-len", "16", "--max-tokens",
                     "4", "--requests", "3", "--warmup-tokens", "2", "--peer-args", peer_args, "--timeout", "120",
                     "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, {label: entry["error"] for label, entry in report["servers"].items()}
    assert [row["concurrency"] for row in report["levels"]] == [1, 2]
    return report


def check_level(measured: dict) -> None:
    assert measured["requests"] == 3 and measured["failed"] == 0
    assert measured["output_tokens"] == 3 * 4 and measured["short_requests"] == 0     # ignore_eos: 4 tokens each
    assert measured["streamed_tokens"] == 3 * 4                                       # one chunk per token
    for key in (*METRICS, "wall_s", "ttft_mean_ms", "tpot_mean_ms", "e2e_p50_ms"):
        assert measured[key] > 0, key


def test_the_benchmark_end_to_end_on_cpu(bench, tiny_run, tmp_path):
    start = time.monotonic()
    report = run_bench(bench, tiny_run, tmp_path, peer_args="")
    assert list(report["servers"]) == ["graphs"] and report["servers"]["graphs"]["startup_s"] > 0
    for row in report["levels"]:
        check_level(row["graphs"])
        assert "ratio" not in row
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_the_benchmark_with_a_peer_reports_ratios(bench, tiny_run, tmp_path):
    # The peer is the same server (an option at its default value): what is checked is the plumbing.
    report = run_bench(bench, tiny_run, tmp_path, peer_args="--max-waiting 128")
    assert report["servers"]["eager"]["args"][-2:] == ["--max-waiting", "128"]
    for row in report["levels"]:
        check_level(row["graphs"])
        check_level(row["eager"])
        assert all(row["ratio"][key] > 0 for key in METRICS)


def test_a_server_that_does_not_start_is_reported(bench, tmp_path):
    from kimik3.config import K3Config
    from kimik3.train.data import Document
    from kimik3.train.tokenizer import train_tokenizer

    run = tmp_path / "run"   # no weights: the server fails on its arguments before it loads anything
    run.mkdir()
    (run / "config.json").write_text(K3Config.preset("tiny").to_json())
    train_tokenizer([Document("d", "def f(x):\n    return x\n" * 50)], 300).save(str(run / "tokenizer.json"))
    rc = bench.main(["--run", str(run), "--device", "cpu", "--levels", "1", "--prompt-len", "16",
                     "--max-tokens", "4", "--peer-args=", "--server-args=--no-such-option",
                     "--log-dir", str(tmp_path), "--json", str(tmp_path / "out.json")])
    assert rc == 1
    error = json.loads((tmp_path / "out.json").read_text())["servers"]["graphs"]["error"]
    assert "exited with status 2" in error and "--no-such-option" in error


def test_the_serve_run_has_the_chat_role_tokens_and_fills_the_vocabulary(tiny_run):
    from kimik3.config import K3Config
    from kimik3.tokenizer import ROLE_TOKENS, has_role_tokens, load_tokenizer, read_tokenizer_config

    tokenizer = load_tokenizer(tiny_run / "tokenizer.json")
    vocab = K3Config.preset("tiny").vocab_size
    assert has_role_tokens(tokenizer) and tokenizer.get_vocab_size() == vocab
    assert sorted(tokenizer.token_to_id(t) for t in ROLE_TOKENS) == list(range(1, 1 + len(ROLE_TOKENS)))
    assert "chat_template" in read_tokenizer_config(tiny_run)
