"""HTTP serving benchmark of `kimik3 serve`, run as vLLM's ``benchmark_serving`` runs one, against a peer.

What it measures. Each server configuration is started as its own ``kimik3 serve`` subprocess on a free
loopback port: the main one (``--server-args``; by default the server's own default, CUDA graphs) and
the peer, the same command plus ``--peer-args`` (default ``--enforce-eager``: the same server without
CUDA graphs, the baseline vLLM users know). After ``/health`` answers and a warm-up, for each
concurrency level the official ``openai`` client (``AsyncOpenAI``) sends streaming ``/v1/completions``
requests, keeping exactly ``concurrency`` of them in flight: each prompt is a list of ``--prompt-len``
random token ids (the same prompts for both servers), ``max_tokens=--max-tokens``, temperature 0 and
``extra_body={"ignore_eos": True}``, so that every request produces exactly ``--max-tokens`` tokens as
in vLLM's random-dataset runs. Per request, from the client's side:

  - TTFT: request sent -> first chunk carrying text (the first token);
  - TPOT: (last token chunk - first token chunk) / (output tokens - 1);
  - output tokens: the streamed token chunks, checked against ``usage.completion_tokens``
    (``stream_options.include_usage``); the usage count is the one used (a chunk can hold more than
    one token when text is held back for an incomplete UTF-8 character).

Per level: output tokens/s (all output tokens / wall time of the level), TTFT and TPOT p50/p99 (plus
means, ITL and end-to-end latency in the JSON), and the ratio main/peer of each. It prints a markdown
table and writes everything to ``--json``.

Server settings. Unless ``--server-args`` sets them, the servers get ``--max-running`` = the highest
level and a ``--memory-mb`` computed from the run's config the way ``kimik3/serve/memory.py`` splits
it: one KDA slot per running sequence and per prefix checkpoint (+1), and MLA blocks for every running
sequence and checkpoint at ``prompt-len + max-tokens`` tokens (never fewer than one full-context
sequence, which the engine requires), plus 25% (1,182 MiB for ``debug`` at 64 x 768 tokens). Both
servers get the same explicit cache, instead of the share of the GPU that ``kimik3 serve`` takes by
default (``--gpu-memory-utilization``; passing that in ``--server-args`` drops the ``--memory-mb``).

On the H200 (no network; the run is made there, see benchmarks/make_serve_run.py)::

    pip install --no-index --no-deps .whl/*.whl        # the wheels below, carried in .whl/
    PYTHONPATH=. python benchmarks/make_serve_run.py --out runs/debug-random --preset debug
    PYTHONPATH=. python benchmarks/serve_http.py --run runs/debug-random --json serve_http.json

The wheels: the ``openai`` client and the server's [serve] extra. The H200's torch 2.11 image (Python 3.12)
has anyio 4.15, idna 3.19, h11, typing_extensions 4.16, annotated-doc, click, certifi, tqdm, numpy,
safetensors, tokenizers and prometheus_client, and lacks the first 14 below (openai 3.x talks HTTP
through ``httpx2``/``httpcore2``/``truststore``, not ``httpx``; fastapi 0.165 imports ``opentelemetry``);
the last 5 make the set complete for a bare torch venv (with ``--no-deps`` nothing else is pulled in) and
are what was installed there with the 14. Made where there is network, for the target's Python::

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        openai==3.60.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \\
        pydantic==2.13.4 pydantic_core==2.46.4 typing_inspection==0.4.2 annotated_types==0.7.0 \\
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 opentelemetry_api==1.45.2 \\
        anyio==4.16.0 typing_extensions==4.16.0 idna==3.20 h11==0.16.0 annotated_doc==0.0.7

(19 wheels, 6.0 MiB; the 14 alone 5.7 MiB. A bare venv also needs click, certifi, tqdm, numpy,
safetensors, tokenizers and prometheus_client.)

Ctrl-C or an error stops the servers (their whole process group). A server that does not come up
has its log's tail printed; a peer that fails (e.g. a server without ``--enforce-eager``) is reported
and the main configuration's results are still written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # run from a checkout that is not installed

METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
HEADROOM = 1.25                  # on top of the computed cache budget


# -- statistics ---------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default (and vLLM) computes it."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ms(value: float | None) -> float | None:
    return None if value is None else 1e3 * value


# -- server settings ----------------------------------------------------------------------------------
def server_option_parser() -> argparse.ArgumentParser:
    """The `kimik3 serve` options this script reads or defaults (the rest pass through untouched)."""
    parser = argparse.ArgumentParser(add_help=False)
    for name in ("--memory-mb", "--gpu-memory-utilization", "--max-running", "--physical-block", "--checkpoints",
                 "--device", "--api-key", "--port", "--host", "--run"):
        parser.add_argument(name)
    return parser


def cache_memory_mb(config, device: str, max_running: int, seq_tokens: int, checkpoints: int = 64,
                    physical_block: int = 192) -> int:
    """The ``--memory-mb`` that holds ``max_running`` sequences of ``seq_tokens`` tokens at once, with every
    prefix checkpoint holding as many blocks as a sequence, split as ``kimik3.serve.memory.plan_cache`` does."""
    from kimik3.model.k3 import default_dtype
    from kimik3.serve.paged_cache import LatentPool, StatePool

    dtype = default_dtype(device)
    block = LatentPool.block_bytes(len(config.mla_layer_indices), physical_block, config.mla.cache_width, dtype)
    slot = StatePool.slot_bytes(config, dtype)
    slots = max_running + checkpoints + 1
    per_seq = -(-seq_tokens // physical_block)
    blocks = max((max_running + checkpoints) * per_seq, -(-config.max_seq_len // physical_block))
    return math.ceil(HEADROOM * (slots * slot + blocks * block) / 2**20)


def default_server_args(config, device: str, levels: list[int], seq_tokens: int, user_args: list[str]) -> list[str]:
    """The options this benchmark adds unless ``user_args`` set them: device, max-running, and a memory
    budget (``--memory-mb``, unless ``--memory-mb`` or ``--gpu-memory-utilization`` is given: the same
    explicit cache for both servers, rather than whatever share of the GPU each would take)."""
    given, _ = server_option_parser().parse_known_args(user_args)
    args = [] if given.device else ["--device", device]
    max_running = int(given.max_running) if given.max_running else max(levels)
    if not given.max_running:
        args += ["--max-running", str(max_running)]
    if not given.memory_mb and not given.gpu_memory_utilization:
        memory = cache_memory_mb(config, given.device or device, max_running, seq_tokens,
                                 int(given.checkpoints) if given.checkpoints else 64,
                                 int(given.physical_block) if given.physical_block else 192)
        args += ["--memory-mb", str(memory)]
    return args


# -- the server process -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    pass


class Server:
    """``kimik3 serve`` in its own process group, its stdout and stderr in a log file."""

    def __init__(self, label: str, run: str, args: list[str], log_dir: Path):
        self.label = label
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "kimik3", "serve", "--run", run, "--host", "127.0.0.1",
                        "--port", str(self.port), *args]
        self.log_path = log_dir / f"server-{label}.log"
        self.proc: subprocess.Popen | None = None
        self.api_key = server_option_parser().parse_known_args(args)[0].api_key

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        print(f"[{self.label}] {shlex.join(self.command)}\n[{self.label}] log: {self.log_path}", flush=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)   # its own group: stopped as one

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def wait_healthy(self, timeout: float) -> float:
        """Poll ``/health`` until it answers ``{"status": "ok"}``; the seconds it took."""
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(f"[{self.label}] the server exited with status {self.proc.returncode} before "
                                   f"it was healthy; the end of its log ({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as reply:
                    if json.loads(reply.read()).get("status") == "ok":
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            if time.monotonic() - start > timeout:
                raise ServerFailed(f"[{self.label}] /health did not answer within {timeout:.0f} s; the end of its "
                                   f"log ({self.log_path}):\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to the server's process group (uvicorn shuts down), SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


# -- the clients --------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    start: float
    token_times: list[float] = field(default_factory=list)   # arrival of each chunk carrying text
    last_choice: float | None = None                          # arrival of the last chunk with a choice
    end: float | None = None
    tokens: int = 0                                           # usage.completion_tokens
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        first = self.token_times[0] if self.token_times else self.last_choice
        return None if first is None else first - self.start

    @property
    def tpot(self) -> float | None:
        if len(self.token_times) < 2 or self.tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    result = RequestResult(start=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                result.last_choice = now
                choice = chunk.choices[0]
                if choice.text:
                    result.token_times.append(now)
                result.finish_reason = choice.finish_reason or result.finish_reason
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
        result.end = time.perf_counter()
        if result.tokens == 0:   # a server that sends no usage: count the streamed chunks
            result.tokens = len(result.token_times)
    except Exception as err:   # one failed request is counted, the level goes on
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_level(client, model: str, prompts: list[list[int]], concurrency: int,
                    max_tokens: int) -> tuple[list[RequestResult], float]:
    """``prompts`` through ``concurrency`` workers (exactly that many in flight); results and wall seconds."""
    pending = list(reversed(prompts))
    results: list[RequestResult] = []

    async def worker() -> None:
        while pending:
            results.append(await one_request(client, model, pending.pop(), max_tokens))

    begin = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - begin


def summarise(results: list[RequestResult], wall: float, max_tokens: int) -> dict:
    done = [r for r in results if r.error is None]
    ttft = [r.ttft for r in done if r.ttft is not None]
    tpot = [r.tpot for r in done if r.tpot is not None]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.end - r.start for r in done]
    tokens = sum(r.tokens for r in done)
    return {
        "requests": len(results), "failed": len(results) - len(done), "wall_s": wall,
        "output_tokens": tokens, "output_tok_s": tokens / wall if wall > 0 else None,
        "request_per_s": len(done) / wall if wall > 0 else None,
        "ttft_mean_ms": ms(mean(ttft)), "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "tpot_mean_ms": ms(mean(tpot)), "tpot_p50_ms": ms(percentile(tpot, 50)),
        "tpot_p99_ms": ms(percentile(tpot, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)), "itl_p99_ms": ms(percentile(itl, 99)),
        "e2e_p50_ms": ms(percentile(e2e, 50)), "e2e_p99_ms": ms(percentile(e2e, 99)),
        # ignore_eos should make every request produce exactly max_tokens; chunks should match tokens.
        "short_requests": sum(r.tokens != max_tokens for r in done),
        "streamed_tokens": sum(len(r.token_times) for r in done),
        "chunk_mismatch_requests": sum(len(r.token_times) != r.tokens for r in done),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def bench_server(server: Server, levels: list[tuple[int, list[list[int]], list[list[int]]]],
                       max_tokens: int, warmup_tokens: int, request_timeout: float) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=server.api_key or "EMPTY", max_retries=0,
                                timeout=request_timeout)
    try:
        model = (await client.models.list()).data[0].id
        rows = []
        for concurrency, prompts, warm in levels:
            if warm:   # the level's batch shapes once, so lazily built graphs or kernels are not timed
                warm_results, _ = await run_level(client, model, warm, concurrency, warmup_tokens)
                failed = [r.error for r in warm_results if r.error]
                if failed:
                    raise ServerFailed(f"[{server.label}] warm-up requests failed: {failed[0]}")
                short = [r.tokens for r in warm_results if r.tokens != warmup_tokens]
                if short:
                    print(f"[{server.label}] warning: warm-up requests returned {short} tokens, not {warmup_tokens}: "
                          "is ignore_eos honoured?", flush=True)
            results, wall = await run_level(client, model, prompts, concurrency, max_tokens)
            row = summarise(results, wall, max_tokens)
            rows.append({"concurrency": concurrency, **row})
            print(f"[{server.label}] c={concurrency}: {row['output_tok_s'] or 0:.1f} tok/s, TTFT p50 "
                  f"{row['ttft_p50_ms'] or 0:.1f} ms, TPOT p50 {row['tpot_p50_ms'] or 0:.2f} ms; {row['failed']} "
                  f"failed, {row['short_requests']} not {max_tokens} tokens long, {row['chunk_mismatch_requests']} "
                  "with fewer token chunks than usage tokens", flush=True)
            if server.proc.poll() is not None:
                raise ServerFailed(f"[{server.label}] the server died; the end of its log:\n{server.log_tail()}")
        return rows
    finally:
        await client.close()


# -- report -------------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(report: dict) -> str:
    labels = [label for label in report["servers"] if report["servers"][label]["levels"]]
    lines = ["| concurrency | requests | server | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
             "| TPOT p99 (ms) |", "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in report["levels"]:
        for label in labels:
            m = row.get(label)
            if m is None:
                continue
            lines.append(f"| {row['concurrency']} | {m['requests']} | {label} | {fmt(m['output_tok_s'])} | "
                         f"{fmt(m['ttft_p50_ms'])} | {fmt(m['ttft_p99_ms'])} | {fmt(m['tpot_p50_ms'], 2)} | "
                         f"{fmt(m['tpot_p99_ms'], 2)} |")
        if row.get("ratio"):
            r = row["ratio"]
            cells = " | ".join(f"{fmt(r[k], 2)}x" if r[k] is not None else "-" for k in METRICS)
            lines.append(f"| {row['concurrency']} | | **{report['ratio_name']}** | {cells} |")
    return "\n".join(lines)


def build_rows(levels: list[tuple], labels: list[str], servers: dict) -> list[dict]:
    """One row per level: each server's metrics under its label and, with two servers that both
    measured it, ``ratio``: first / second for each of ``METRICS``."""
    rows = []
    for i, (concurrency, prompts, _) in enumerate(levels):
        row: dict = {"concurrency": concurrency, "requests": len(prompts)}
        for label in labels:
            if i < len(servers[label]["levels"]):
                row[label] = servers[label]["levels"][i]
        if len(labels) == 2 and all(label in row for label in labels):
            row["ratio"] = {k: ratio(row[labels[0]][k], row[labels[1]][k]) for k in METRICS}
        rows.append(row)
    return rows


def make_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    """Random token ids in [1, vocab): id 0 is <|endoftext|>."""
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--levels must be positive integers, got {text!r}")
    return levels


def on_sigterm(*_) -> None:
    raise KeyboardInterrupt


def run_server(label: str, server_args: list[str], run: str, levels: list[tuple], args: argparse.Namespace,
               log_dir: Path, report: dict) -> None:
    """Start one configuration, measure every level, stop it (whatever happens); into ``report["servers"]``."""
    server = Server(label, run, server_args, log_dir)
    entry = {"command": server.command, "args": server_args, "startup_s": None, "error": None, "levels": []}
    report["servers"][label] = entry
    try:
        server.start()
        entry["startup_s"] = server.wait_healthy(args.timeout)
        entry["startup_log"] = [line for line in server.log_tail(200).splitlines()
                                if line.startswith(("serving ", "each replica:"))]
        print(f"[{label}] healthy after {entry['startup_s']:.1f} s", *entry["startup_log"], sep="\n  ", flush=True)
        entry["levels"] = asyncio.run(bench_server(server, levels, args.max_tokens, args.warmup_tokens,
                                                   args.request_timeout))
    except Exception as err:   # recorded; the other configuration is still measured
        entry["error"] = str(err) if isinstance(err, ServerFailed) else f"{type(err).__name__}: {err}"
        print(entry["error"], file=sys.stderr, flush=True)
        if not isinstance(err, ServerFailed):
            print(f"[{label}] the end of the server's log ({server.log_path}):\n{server.log_tail()}",
                  file=sys.stderr, flush=True)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run directory (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--levels", type=parse_levels, default=[1, 16, 64], help="concurrency levels (default 1,16,64)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (ignore_eos)")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default: max(2 x concurrency, 8))")
    parser.add_argument("--server-args", default="", help="extra `kimik3 serve` arguments, for both servers "
                        "(one string; write --server-args=--option when it is a single option)")
    parser.add_argument("--peer-args", default="--enforce-eager",
                        help="what the peer adds to the main server's arguments; --peer-args= (empty): no peer")
    parser.add_argument("--label", default="graphs", help="the main configuration's name in the report")
    parser.add_argument("--peer-label", default="eager", help="the peer's name in the report")
    parser.add_argument("--device", default=None, help="--device of the servers (default: cuda when present)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a server may take to become healthy")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="before each level, `concurrency` requests of this many tokens (0: no warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    try:
        import openai  # noqa: F401
    except ImportError:
        print("serve_http: the 'openai' package is missing: pip install openai, or install the wheels this "
              "script's docstring lists (pip install --no-index --no-deps .whl/*.whl)", file=sys.stderr)
        return 2
    from kimik3.config import K3Config
    from kimik3.tokenizer import load_tokenizer

    run = Path(args.run)
    config = K3Config.from_json(run / "config.json")
    vocab = min(load_tokenizer(run / "tokenizer.json").get_vocab_size(), config.vocab_size)
    seq_tokens = args.prompt_len + args.max_tokens
    if seq_tokens > config.max_seq_len:
        parser.error(f"--prompt-len + --max-tokens = {seq_tokens} exceeds the model's context {config.max_seq_len}")
    if args.prompt_len < 1 or args.max_tokens < 1:
        parser.error("--prompt-len and --max-tokens must be >= 1")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    rng = random.Random(args.seed)
    levels = []
    for concurrency in args.levels:
        count = args.requests or max(2 * concurrency, 8)
        warm = make_prompts(rng, concurrency, args.prompt_len, vocab) if args.warmup_tokens > 0 else []
        levels.append((concurrency, make_prompts(rng, count, args.prompt_len, vocab), warm))

    user_args = shlex.split(args.server_args)
    base = default_server_args(config, args.device, args.levels, seq_tokens, user_args) + user_args
    configs = [(args.label, base)]
    if args.peer_args.strip():
        configs.append((args.peer_label, base + shlex.split(args.peer_args)))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_http-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{run}: preset {config.name}, prompt {args.prompt_len} random ids in [1, {vocab}), {args.max_tokens} "
          f"output tokens (ignore_eos), temperature 0, levels {args.levels}", flush=True)

    report = {"run": str(run), "preset": config.name, "device": args.device, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "levels_requested": args.levels, "seed": args.seed,
              "ratio_name": f"{args.label}/{args.peer_label}", "servers": {}, "levels": []}
    try:   # a killed benchmark still stops its servers (only the main thread may set a handler)
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:
        previous = None
    try:
        for label, server_args in configs:
            run_server(label, server_args, str(run), levels, args, log_dir, report)
            if args.json:   # what is measured so far survives an interrupted run
                Path(args.json).write_text(json.dumps(report, indent=2))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    report["levels"] = build_rows(levels, [label for label, _ in configs], report["servers"])
    print()
    print(markdown(report))
    if any("ratio" in row for row in report["levels"]):
        print(f"\nratio = {report['ratio_name']}: above 1 is better for tok/s, below 1 for TTFT and TPOT")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    failed = [label for label, entry in report["servers"].items() if entry["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
