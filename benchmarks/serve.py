"""Serving latency and throughput on the tiny model: TTFT, TPOT, ITL (p50/p99), tokens/s at
concurrency 1, 8 and 32, measured end to end through the HTTP server with streaming clients.

The peer, measured in the same run on the same requests: one-request-at-a-time serving with the
model's own ``generate`` (a static cache per request, no continuous batching, no prefix cache),
which is what serving a research model usually starts as. Clients are the same threads; the peer
server takes them one by one.

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
    from kimik3.train.tokenizer import EOS, train_tokenizer

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


def start_server(engine) -> tuple[str, object]:
    import uvicorn

    from kimik3.serve.server import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


async def one_stream(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, model: str) -> dict:
    start = time.perf_counter()
    arrivals: list[float] = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None:
            arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals, "end": time.perf_counter()}


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


def summarise(results: list[dict], tokens_out: int, wall: float) -> dict:
    ttft = [r["arrivals"][0] - r["start"] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tpot = [(r["end"] - r["arrivals"][0]) / (len(r["arrivals"]) - 1) for r in results if len(r["arrivals"]) > 1]
    return {"requests": len(results), "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99),
            "itl_p50_ms": 1e3 * percentile(itl, 0.5), "itl_p99_ms": 1e3 * percentile(itl, 0.99),
            "tokens_per_s": tokens_out / wall, "wall_s": wall}


def peer_sequential(model: K3ForCausalLM, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """``model.generate`` behind a lock: clients in threads, served one at a time."""
    lock = threading.Lock()
    results: list[dict] = []
    queue = list(prompts)

    def client():
        while True:
            try:
                prompt = queue.pop()          # atomic under the GIL
            except IndexError:
                return
            start = time.perf_counter()
            arrivals: list[float] = []
            with lock:
                model.generate(torch.tensor([prompt]), max_tokens, temperature=0.0,
                               on_token=lambda _: arrivals.append(time.perf_counter()))
            results.append({"start": start, "arrivals": arrivals, "end": time.perf_counter()})

    begin = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begin
    return summarise(results, sum(len(r["arrivals"]) for r in results), wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a trained run (default: random-weight tiny model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=0, help="requests per level (default: max(16, 2 x concurrency))")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.run:
        engine = LLMEngine.from_run(args.run, EngineConfig(checkpoints=0))
        model = engine.core.model
    else:
        model, tokenizer, _ = random_tiny()
        # No EOS: every request produces exactly max_tokens, for both servers.
        engine = LLMEngine(model, tokenizer, EngineConfig(checkpoints=0, max_running=64), model_name="tiny-random")
    vocab = min(model.config.vocab_size, engine.tokenizer.get_vocab_size())
    base, server = start_server(engine)
    print(f"server at {base}; torch threads {torch.get_num_threads()}; prompt {args.prompt_len} tokens, "
          f"{args.max_tokens} output tokens; prefix cache off (distinct random prompts)")

    rows = []
    generator = torch.Generator().manual_seed(0)
    for concurrency in args.concurrency:
        count = args.requests or max(16, 2 * concurrency)
        prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(count)]
        asyncio.run(run_clients(base, prompts[:min(2, count)], 1, 4, engine.model_name))   # warm-up
        begin = time.perf_counter()
        results = asyncio.run(run_clients(base, prompts, concurrency, args.max_tokens, engine.model_name))
        wall = time.perf_counter() - begin
        ours = summarise(results, sum(len(r["arrivals"]) for r in results), wall)
        row = {"concurrency": concurrency, "ours": ours}
        if not args.no_peer:
            row["peer"] = peer_sequential(model, prompts, concurrency, args.max_tokens)
            row["throughput_ratio"] = ours["tokens_per_s"] / row["peer"]["tokens_per_s"]
        rows.append(row)
        line = (f"c={concurrency:3d} n={count:3d} | ours: {ours['tokens_per_s']:7.1f} tok/s, TTFT p50/p99 "
                f"{ours['ttft_p50_ms']:7.1f}/{ours['ttft_p99_ms']:7.1f} ms, TPOT p50/p99 {ours['tpot_p50_ms']:6.1f}/"
                f"{ours['tpot_p99_ms']:6.1f} ms, ITL p50/p99 {ours['itl_p50_ms']:6.1f}/{ours['itl_p99_ms']:6.1f} ms")
        if "peer" in row:
            peer = row["peer"]
            line += (f" | peer: {peer['tokens_per_s']:7.1f} tok/s, TTFT p50/p99 {peer['ttft_p50_ms']:7.1f}/"
                     f"{peer['ttft_p99_ms']:7.1f} ms | throughput x{row['throughput_ratio']:.2f}")
        print(line, flush=True)
    server.should_exit = True
    engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
