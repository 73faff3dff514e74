"""Serving latency and throughput on the tiny model: TTFT, TPOT, ITL (p50/p99), tokens/s at
concurrency 1, 8 and 32, measured end to end through the HTTP server with streaming clients.

Each server runs in its own process (as `kimik3 serve` does); the clients (the official
``openai`` async client) run in this one. The peer, measured in the same run on the same
requests: the same server with the engine limited to one sequence at a time (``max_running=1``),
i.e. serving without continuous batching, which is where serving a research model usually starts.

    python benchmarks/serve.py                      # random-weight tiny model (no run needed)
    python benchmarks/serve.py --run runs/tiny-...  # a trained run
    python benchmarks/serve.py --json out.json

Output lengths are fixed (``max_tokens``) so both servers produce the same number of tokens:
requests whose model samples EOS early are not counted in TPOT.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import multiprocessing as mp
import socket
import threading
import time
from pathlib import Path

import openai
import torch

from kimik3.config import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.serve.engine import LLMEngine
from kimik3.serve.memory import EngineConfig


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def random_tiny():
    """The tiny preset with random weights and a byte-level BPE trained on our own sources."""
    import kimik3
    from kimik3.train.data import Document
    from kimik3.tokenizer import EOS
    from kimik3.train.tokenizer import train_tokenizer

    config = K3Config.preset("tiny")
    text = "".join(inspect.getsource(m) for m in (kimik3.model.k3, kimik3.serve.scheduler, kimik3.serve.engine))
    tokenizer = train_tokenizer([Document(f"p{i}", text[i:i + 4000]) for i in range(0, len(text), 4000)],
                                config.vocab_size)
    model = K3ForCausalLM(config, device="cpu", dtype=torch.float32, seed=0).eval()
    return model, tokenizer, tokenizer.token_to_id(EOS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_child(port: int, run: str | None, max_running: int, threads: int, prefill_chunk: int, ready) -> None:
    """The server process: engine + HTTP, as `kimik3 serve` runs it."""
    import uvicorn

    from kimik3.serve.server import create_app

    if threads:
        torch.set_num_threads(threads)
    if run:
        engine = LLMEngine.from_run(run, EngineConfig(checkpoints=0, max_running=max_running, prefill_chunk=prefill_chunk))
    else:
        model, tokenizer, _ = random_tiny()
        # No EOS: every request produces exactly max_tokens, whatever the server.
        engine = LLMEngine(model, tokenizer, EngineConfig(checkpoints=0, max_running=max_running, prefill_chunk=prefill_chunk),
                           model_name="tiny-random")
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))

    def announce():
        while not server.started:
            time.sleep(0.05)
        ready.put((engine.model_name, min(engine.core.model.config.vocab_size, engine.tokenizer.get_vocab_size())))

    threading.Thread(target=announce, daemon=True).start()
    server.run()


class ServerProcess:
    """A server in its own process, so that the clients' Python never shares its interpreter lock."""

    def __init__(self, run: str | None, max_running: int, threads: int, prefill_chunk: int = 512):
        ctx = mp.get_context("spawn")
        self.port = free_port()
        ready = ctx.Queue()
        self.process = ctx.Process(target=_server_child, args=(self.port, run, max_running, threads, prefill_chunk, ready), daemon=True)
        self.process.start()
        self.model_name, self.vocab = ready.get(timeout=300)
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(30)


async def one_stream(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, model: str) -> dict:
    """One streaming request: chunk arrival times and the token count the server reports.

    A chunk can carry several tokens (text is held back while a UTF-8 character or a possible
    stop string is incomplete), so per-token figures use the usage count, not the chunk count."""
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"start": start, "arrivals": arrivals, "end": time.perf_counter(), "tokens": tokens}


async def run_clients(base: str, prompts: list[list[int]], concurrency: int, max_tokens: int, model: str) -> list[dict]:
    """``concurrency`` streaming clients (the official ``openai`` client) working through ``prompts``."""
    queue = list(prompts)
    results: list[dict] = []
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)

    async def worker():
        while queue:
            results.append(await one_stream(client, queue.pop(), max_tokens, model))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return results


def summarise(results: list[dict], wall: float) -> dict:
    """TTFT: request sent -> first chunk; TPOT: (last chunk - first chunk) / (tokens - 1);
    ITL: gaps between chunks as the client sees them; throughput: output tokens / wall time."""
    ttft = [r["arrivals"][0] - r["start"] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) / (r["tokens"] - 1) for r in results
            if r["arrivals"] and r["tokens"] > 1]
    return {"requests": len(results), "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
            "tokens_per_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall}


def measure(server: ServerProcess, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    asyncio.run(run_clients(server.base, prompts[:2], 1, 4, server.model_name))   # warm-up
    begin = time.perf_counter()
    results = asyncio.run(run_clients(server.base, prompts, concurrency, max_tokens, server.model_name))
    return summarise(results, time.perf_counter() - begin)


def describe(name: str, r: dict) -> str:
    return (f"{name}: {r['tokens_per_s']:6.1f} tok/s, TTFT p50/p99 {r['ttft_p50_ms']:6.0f}/{r['ttft_p99_ms']:6.0f} ms, "
            f"TPOT p50/p99 {r['tpot_p50_ms']:5.1f}/{r['tpot_p99_ms']:5.1f} ms, "
            f"ITL p50/p99 {r['itl_p50_ms']:5.1f}/{r['itl_p99_ms']:5.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a trained run (default: random-weight tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: max(16, 2 x concurrency))")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads in the server (0: torch's default)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="engine tokens per prefill forward")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    levels = []
    generator = torch.Generator().manual_seed(0)
    servers = [("ours", 64)] + ([] if args.no_peer else [("peer", 1)])
    results: dict[str, list[dict]] = {}
    for name, max_running in servers:
        server = ServerProcess(args.run, max_running, args.threads, args.prefill_chunk)
        try:
            if not levels:
                for concurrency in args.concurrency:
                    count = args.requests or max(16, 2 * concurrency)
                    levels.append((concurrency, [torch.randint(1, server.vocab, (args.prompt_len,),
                                                               generator=generator).tolist() for _ in range(count)]))
                print(f"prompt {args.prompt_len} tokens, {args.max_tokens} output tokens, prefix cache off; "
                      f"ours: continuous batching (max_running 64); peer: the same server one request at a time "
                      f"(max_running 1, no batching)", flush=True)
            results[name] = [measure(server, prompts, c, args.max_tokens) for c, prompts in levels]
        finally:
            server.stop()
    rows = []
    for i, (concurrency, prompts) in enumerate(levels):
        row = {"concurrency": concurrency, "requests": len(prompts), **{k: v[i] for k, v in results.items()}}
        line = f"c={concurrency:3d} n={len(prompts):3d} | " + describe("ours", row["ours"])
        if "peer" in row:
            row["throughput_ratio"] = row["ours"]["tokens_per_s"] / row["peer"]["tokens_per_s"]
            line += " | " + describe("peer", row["peer"]) + f" | throughput x{row['throughput_ratio']:.2f}"
        rows.append(row)
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
