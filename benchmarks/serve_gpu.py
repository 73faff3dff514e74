"""The serving engine on one GPU, step by step: decode with CUDA graphs against the same engine eager, prefill,
and whether the two give the same greedy tokens.

    python benchmarks/serve_gpu.py                      # debug preset, random bf16 weights, on cuda
    python benchmarks/serve_gpu.py --json out.json --profile

What it measures (the engine core driven directly, no HTTP; ``benchmarks/serve_http.py`` does HTTP):
- decode: B sequences (128-token prompts, ``ignore_eos``) are prefilled, then ``--steps`` engine steps are
  timed, each one decode forward + sampling + streaming for every sequence: ms per step and output tokens/s, at
  every batch of ``--batches``, with CUDA graphs (the default) and with ``enforce_eager`` (the peer);
- prefill: one ``--prefill-len``-token prompt, from submission to its first token, at each ``--prefill-chunk``,
  with the full chunks replayed as piecewise CUDA graphs (the default) and with ``enforce_eager`` (the peer);
- correctness: greedy tokens of a mixed workload (staggered arrivals, so prefill chunks share steps with
  decode; a repeated prompt, so the prefix cache restores it) must be identical with graphs and eagerly;
- ``--profile``: the CUDA kernels of one decode step at batch 1 (graphs and eager) and of one prefill, by time
  and by launch count.
The memory floor of a decode step (bytes of weights and cache it must read at 4.2 TB/s) is printed beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import kernel_rows, print_kernels  # noqa: E402
from make_serve_run import make_run  # noqa: E402

from kimik3.model.k3 import K3ForCausalLM  # noqa: E402
from kimik3.tokenizer import EOS, load_tokenizer  # noqa: E402
from kimik3.serve.memory import EngineConfig  # noqa: E402
from kimik3.serve.scheduler import EngineCore  # noqa: E402
from kimik3.serve.types import GenerationRequest, SamplingParams  # noqa: E402

HBM_BYTES_PER_S = 4.2e12


def active_weight_bytes(model) -> int:
    """Bytes of the weights one decode token reads (every routed expert counted at top_k / num_experts)."""
    cfg = model.config
    total = 0
    for name, param in model.named_parameters():
        if name.startswith("mtp."):
            continue
        nbytes = param.numel() * param.element_size()
        if ".experts." in name:
            nbytes = nbytes * cfg.moe.top_k // cfg.moe.num_experts
        total += nbytes
    return total


def floor_ms(model, core: EngineCore, batch: int, context: int) -> float:
    """Weights (experts: those a batch of this size touches, at most all) + KDA states read and written + latents."""
    cfg = model.config
    weights = active_weight_bytes(model)
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    hit = min(1.0, batch * cfg.moe.top_k / cfg.moe.num_experts)
    weights += int(expert * (hit - cfg.moe.top_k / cfg.moe.num_experts))
    state = 2 * batch * core.layout.slot_bytes
    latents = batch * context * len(cfg.mla_layer_indices) * cfg.mla.cache_width * 2
    return (weights + state + latents) / HBM_BYTES_PER_S * 1e3


def drive(core: EngineCore, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}

    def sink_for(rid):
        return lambda event: tokens[rid].append(event.token_id) if event.token_id is not None else None

    for request in requests:
        core.add(request, sink_for(request.request_id))
    while core.has_work():
        core.step()
    return tokens


def make_core(model, tokenizer, eos, eager: bool, max_running: int, prefill_chunk: int = 512,
              checkpoints: int = 0, max_context: int = 4096) -> EngineCore:
    config = EngineConfig(gpu_memory_utilization=0.3, max_running=max_running, checkpoints=checkpoints,
                          prefill_chunk=prefill_chunk, max_context=max_context, max_waiting=4096, enforce_eager=eager)
    return EngineCore(model, tokenizer, config, eos)


def decode_rate(core: EngineCore, batch: int, steps: int, prompt_len: int, seed: int) -> float:
    """ms per decode step with ``batch`` sequences running (after their prefill)."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(1, 4000, (prompt_len,), generator=g).tolist()
        core.add(GenerationRequest(f"d{i}", prompt, params), lambda event: None)
    while any(seq.prefilling for seq in core.running) or core.waiting:
        core.step()
    for _ in range(3):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    for seq in list(core.running):
        core.abort(seq.request.request_id)
    return elapsed


def prefill_rate(core: EngineCore, length: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 4000, (length,), generator=g).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Warm with a prompt of the same length (other tokens: no prefix-cache hit), so that per-shape set-up (cuDNN's
    # attention plans, Triton specialisations) is not timed.
    warm = torch.randint(4000, 8000, (length,), generator=g).tolist()
    drive(core, [GenerationRequest("warm", warm, params)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    drive(core, [GenerationRequest("p", prompt, params)])
    torch.cuda.synchronize()
    return length / (time.perf_counter() - start)


def correctness(model, tokenizer, eos) -> dict:
    """Greedy tokens of a mixed workload with graphs and eagerly, prefix cache on."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 4000, (n,), generator=g).tolist() for n in (5, 37, 130, 200, 64, 300, 17, 91)]
    prompts.append(list(prompts[3]))     # a resend: restored from the prefix cache
    results = {}
    for eager in (False, True):
        core = make_core(model, tokenizer, eos, eager, max_running=8, prefill_chunk=64, checkpoints=16)
        tokens: dict[str, list[int]] = {}
        for wave in (prompts[:3], prompts[3:6], prompts[6:]):   # later waves arrive while earlier ones decode
            requests = [GenerationRequest(f"r{len(tokens) + i}", p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                                   ignore_eos=True))
                        for i, p in enumerate(wave)]
            for r in requests:
                tokens[r.request_id] = []
                core.add(r, lambda e, rid=r.request_id: tokens[rid].append(e.token_id) if e.token_id is not None
                         else None)
            for _ in range(6):
                if core.has_work():
                    core.step()
        while core.has_work():
            core.step()
        results["eager" if eager else "graphs"] = (tokens, core.prefix_cache.stats.hits)
        del core
        gc.collect()   # the engine core holds reference cycles (its prefix cache calls back into it)
        torch.cuda.empty_cache()
    graphs, eager = results["graphs"][0], results["eager"][0]
    same = sum(graphs[k] == eager[k] for k in graphs)
    return {"requests": len(graphs), "identical": same, "prefix_hits_graphs": results["graphs"][1],
            "prefix_hits_eager": results["eager"][1],
            "first_difference": next(({"request": k, "graphs": graphs[k], "eager": eager[k]} for k in graphs
                                      if graphs[k] != eager[k]), None)}


def replay_ms(core: EngineCore, bucket: int, reps: int = 50) -> float:
    """The decode graph alone (no host work around it): ms per replay."""
    graph = core.runner.graphs[bucket][0]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def profile_step(core: EngineCore, prompt_len: int) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 4000, (prompt_len,), generator=g).tolist()
    core.add(GenerationRequest("prof", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)),
             lambda event: None)
    for _ in range(8):
        core.step()
    start = time.perf_counter()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    print(f"step without the profiler: {(time.perf_counter() - start) / 5 * 1e3:.2f} ms")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            core.step()
        torch.cuda.synchronize()
    host = sorted(((e.key[:80], e.cpu_time_total / 5) for e in prof.key_averages()
                   if e.device_type.name == "CPU"), key=lambda r: -r[1])[:12]
    print("host (CPU) ops by total time per step, us: " + "; ".join(f"{k} {t:.0f}" for k, t in host))
    calls = sorted(((e.key[:60], e.count // 5) for e in prof.key_averages()
                    if e.device_type.name == "CPU" and e.key.startswith("aten::")), key=lambda r: -r[1])[:30]
    print("aten ops by calls per step: " + "; ".join(f"{k} {n}" for k, n in calls))
    core.abort("prof")
    return kernel_rows(prof, 5)


def profile_prefill(core: EngineCore, length: int) -> dict:
    """The CUDA kernels of one ``length``-token prefill (one chunk when the engine's chunk allows)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    drive(core, [GenerationRequest("warm", torch.randint(1, 4000, (length,), generator=g).tolist(), params)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        drive(core, [GenerationRequest("p", torch.randint(1, 4000, (length,), generator=g).tolist(), params)])
        torch.cuda.synchronize()
    table = kernel_rows(prof, 1)
    # Where the prefill waits on the GPU (each wait stops the host from running ahead).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            drive(core, [GenerationRequest("s", torch.randint(1, 4000, (length,), generator=g).tolist(), params)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    table["host_syncs"] = [str(w.message)[:160] + f" ({Path(w.filename).name}:{w.lineno})" for w in caught]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a run directory (default: a random-weight debug run made in a temp dir)")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--prefill-chunk", default="512,2048,8192")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: decode,prefill,check")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("serve_gpu.py needs a CUDA GPU")
    skip = set(filter(None, args.skip.split(",")))
    run = Path(args.run) if args.run else make_run(Path(tempfile.mkdtemp()) / "debug", preset="debug", device="cuda")
    model = K3ForCausalLM.from_pretrained(run, device="cuda")
    tokenizer = load_tokenizer(run / "tokenizer.json")
    eos = tokenizer.token_to_id(EOS)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": model.config.name,
                 "active_weight_gb": active_weight_bytes(model) / 1e9}
    print(f"# {out['device']}, torch {out['torch']}, preset {out['preset']}: {out['active_weight_gb']:.3f} GB of "
          "weights read per decode token", flush=True)

    if "check" not in skip:
        out["correctness"] = correctness(model, tokenizer, eos)
        print(f"correctness: {out['correctness']}", flush=True)

    if "decode" not in skip:
        batches = [int(b) for b in args.batches.split(",")]
        out["decode"] = []
        print("| batch | graphs ms/step | eager ms/step | speed-up | graphs tok/s | eager tok/s | floor ms |")
        print("|---|---|---|---|---|---|---|")
        for batch in batches:
            row = {"batch": batch}
            for eager in (False, True):
                core = make_core(model, tokenizer, eos, eager, max_running=batch)
                ms = decode_rate(core, batch, args.steps if batch < 128 or not eager else args.steps // 2,
                                 args.prompt_len, seed=batch)
                row["eager_ms" if eager else "graphs_ms"] = ms
                if not eager:
                    row["floor_ms"] = floor_ms(model, core, batch, args.prompt_len + args.steps)
                    row["capture_s"] = core.runner.capture_seconds
                del core
                gc.collect()
                torch.cuda.empty_cache()
            row["speedup"] = row["eager_ms"] / row["graphs_ms"]
            out["decode"].append(row)
            print(f"| {batch} | {row['graphs_ms']:.3f} | {row['eager_ms']:.3f} | {row['speedup']:.1f}x | "
                  f"{batch / row['graphs_ms'] * 1e3:,.0f} | {batch / row['eager_ms'] * 1e3:,.0f} | "
                  f"{row['floor_ms']:.3f} |", flush=True)

    if "prefill" not in skip:
        out["prefill"] = []
        for chunk in (int(c) for c in args.prefill_chunk.split(",")):
            row = {"tokens": args.prefill_len, "chunk": chunk}
            for eager in (False, True):
                core = make_core(model, tokenizer, eos, eager=eager, max_running=1, prefill_chunk=chunk,
                                 max_context=args.prefill_len + 8)
                row["eager_tokens_per_s" if eager else "tokens_per_s"] = prefill_rate(core, args.prefill_len, seed=11)
                del core
                gc.collect()
                torch.cuda.empty_cache()
            out["prefill"].append(row)
            print(f"prefill {args.prefill_len} tokens, chunk {chunk}: {row['tokens_per_s']:,.0f} tokens/s with "
                  f"piecewise graphs, {row['eager_tokens_per_s']:,.0f} eager "
                  f"({row['tokens_per_s'] / row['eager_tokens_per_s']:.2f}x)", flush=True)

    if args.profile:
        for eager in (False, True):
            kind = "eager" if eager else "graphs"
            core = make_core(model, tokenizer, eos, eager=eager, max_running=64)
            if not eager:
                out["replay_ms"] = {b: replay_ms(core, b) for b in (1, 64)}
                print(f"graph replay alone, ms: {out['replay_ms']}")
            out[f"profile_{kind}_b1"] = profile_step(core, args.prompt_len)
            print_kernels(f"{kind} decode step, batch 1", out[f"profile_{kind}_b1"])
            del core
            gc.collect()
            torch.cuda.empty_cache()
        core = make_core(model, tokenizer, eos, eager=False, max_running=1, prefill_chunk=args.prefill_len,
                         max_context=args.prefill_len + 8)
        out["profile_prefill"] = profile_prefill(core, args.prefill_len)
        print_kernels(f"prefill of {args.prefill_len} tokens, one chunk", out["profile_prefill"])
        del core
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
