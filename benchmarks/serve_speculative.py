"""Speculative decoding in the serving engine: decode speed with the run's draft proposing K tokens a step, against
the same engine without speculation, in the same process.

    python benchmarks/serve_speculative.py --run runs/tiny-spec [--device cuda] [--batches 1,16] [--tokens 1,2,3,4]

The run needs a draft (``kimik3 train-draft --run DIR``). Prompts are held-out text: kimik3's own source files
(a `kimik3 train` run learns from Python's standard library), cut into ``--prompt-len``-token windows. For every
batch B and every K (0 = no speculation, the peer), a fresh engine core is built (with CUDA graphs unless
``--enforce-eager``), warmed on one request, then rounds of B concurrent greedy requests (``ignore_eos``,
``--max-tokens`` new tokens, new prompts each round, ``--requests`` in all) run to the end. Decode tokens/s counts
the tokens emitted in steps that ran no prefill chunk, over those steps' wall time. Reported per (B, K): tokens/s,
the ratio to K = 0, tokens emitted per sequence and verification, per chain position k the share of verifications
that accepted drafts 1..k and that share over the one through k - 1 (position k's rate given the earlier ones), the
draft's share of the step time, and whether every request's tokens equal the K = 0 tokens (greedy speculation is
lossless in exact arithmetic; in bf16 a differently shaped forward can flip a near-tie argmax, so only an fp32
run exits with an error when a request differs). ``--profile`` adds, per K, the kernels of five mid-decode steps
of one request (batch 1; on the CPU, the aten operators): launches and kernel time a step, the kernels whose time
a step differs most from K = 0's, to read off where a speculative step's extra time goes, and on CUDA a step's
wall time split into kernels, their gaps and the device's idle time.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import device_timeline, kernel_rows  # noqa: E402

from kimik3.model.draft import EagleDraft  # noqa: E402
from kimik3.model.k3 import K3ForCausalLM  # noqa: E402
from kimik3.serve.memory import EngineConfig  # noqa: E402
from kimik3.serve.scheduler import EngineCore  # noqa: E402
from kimik3.serve.types import GenerationRequest, SamplingParams  # noqa: E402
from kimik3.tokenizer import EOS, load_tokenizer  # noqa: E402


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from kimik3's source files (not in a `kimik3 train` run's data)."""
    import kimik3

    ids: list[int] = []
    for path in sorted(Path(kimik3.__file__).parent.rglob("*.py")):
        ids.extend(tokenizer.encode(path.read_text()).ids)
        if len(ids) >= count * length * 2:
            break
    if len(ids) < count * length:
        raise ValueError(f"not enough held-out text for {count} prompts of {length} tokens")
    stride = len(ids) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


def run_case(model, draft, tokenizer, eos, prompts, K: int, args) -> dict:
    config = EngineConfig(memory_bytes=args.memory_mb * 2**20, max_running=max(args.batches), checkpoints=0,
                          max_context=args.prompt_len + args.max_tokens + 64, enforce_eager=args.enforce_eager,
                          speculative_tokens=K)
    core = EngineCore(model, tokenizer, config, eos, draft if K else None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}

    def drive(requests):
        for request in requests:
            tokens[request.request_id] = []
            core.add(request, lambda e, rid=request.request_id: tokens[rid].append(e.token_id)
                     if e.token_id is not None else None)
        decode_time = decode_tokens = 0.0
        while core.has_work():
            prefilling = any(seq.prefilling for seq in core.running) or bool(core.waiting)
            before = sum(len(v) for v in tokens.values())
            start = time.perf_counter()
            core.step()
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            if not prefilling:
                decode_time += time.perf_counter() - start
                decode_tokens += sum(len(v) for v in tokens.values()) - before
        return decode_tokens / decode_time if decode_time else 0.0

    drive([GenerationRequest("warm", prompts[0], SamplingParams(max_tokens=16, temperature=0.0,
                                                                ignore_eos=True))])
    speculator = core.runner.speculator
    if speculator is not None:   # count the timed requests only
        speculator.stats = type(speculator.stats)(K)
    rows = {}
    for batch in args.batches:
        if speculator is not None:
            speculator.stats = type(speculator.stats)(K)
        rates = []
        rounds = max(1, args.requests // batch)
        for r in range(rounds):   # rounds of `batch` concurrent requests, each round on new prompts
            ids = range(r * batch, (r + 1) * batch)
            rates.append(drive([GenerationRequest(f"b{batch}-{i}", prompts[i], params) for i in ids]))
        rate = len(rates) / sum(1 / x for x in rates)   # the same tokens each round: the harmonic mean
        row = {"tokens_per_s": rate, "outputs": {f"{i}": tokens[f"b{batch}-{i}"] for i in range(rounds * batch)}}
        if speculator is not None:
            stats = speculator.stats
            row.update(mean_emitted=stats.mean_emitted, acceptance=stats.acceptance, draft_share=stats.draft_share)
        rows[batch] = row
    if args.profile:
        rows["profile"] = profile_steps(core, prompts[0], args.max_tokens)
    core = None   # the engine's pools and graphs go before the next case's
    gc.collect()
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def profile_steps(core: EngineCore, prompt: list[int], max_tokens: int, steps: int = 5) -> dict:
    """The kernels of ``steps`` decode steps of one greedy request alone, after its prefill and three more steps
    (``harness.kernel_rows``, per step), and on CUDA where the steps' wall time goes (``harness.device_timeline``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = core.runner.device.type == "cuda"
    core.add(GenerationRequest("profile", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True)), lambda event: None)
    while core.waiting or any(seq.prefilling for seq in core.running):
        core.step()
    for _ in range(3):
        core.step()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    if not core.has_work():
        raise RuntimeError(f"the profiled request ended within {steps + 3} steps: raise --max-tokens")
    core.abort("profile")
    table = kernel_rows(prof, steps)
    if cuda:
        table["timeline"] = device_timeline(prof, steps, wall_s)
    return table


def print_profiles(results: dict, top: int = 20) -> None:
    """Launches and kernel time a step per K, then the ``top`` kernels whose time a step differs most from K = 0's."""
    ks = [K for K in results if "profile" in results[K]]
    print("\nkernels a step at batch 1 (one request, five mid-decode steps): "
          + "; ".join(f"K = {K}: {results[K]['profile']['launches']} launches, "
                      f"{results[K]['profile']['us'] / 1e3:.3f} ms" for K in ks))
    for K in ks:
        line = results[K]["profile"].get("timeline")
        if line:
            print(f"  K = {K}, a step: wall {line['wall_us']:.0f} us = kernels and copies {line['busy_us']:.0f} + "
                  f"{line['short_gaps']:.0f} gaps under 5 us {line['short_gaps_us']:.0f} + {line['long_gaps']:.1f} "
                  f"longer gaps {line['long_gaps_us']:.0f} + before the first kernel and after the last "
                  f"{line['wall_us'] - line['span_us']:.0f}")
    times = {K: {name: us for name, us, _ in results[K]["profile"]["all"]} for K in ks}
    names = {name for K in ks for name in times[K]}
    spread = sorted(names, key=lambda n: -max(abs(times[K].get(n, 0.0) - times[0].get(n, 0.0)) for K in ks))
    print("| kernel | " + " | ".join(f"K = {K} us" for K in ks) + " |\n|---|" + "---:|" * len(ks))
    for name in spread[:top]:
        print(f"| {name} | " + " | ".join(f"{times[K].get(name, 0.0):.1f}" for K in ks) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a run with a draft (kimik3 train-draft)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,16", help="concurrent requests (default 1,16)")
    parser.add_argument("--tokens", default="1,2,3,4", help="drafted tokens per step K to try (default 1,2,3,4)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    parser.add_argument("--requests", type=int, default=8,
                        help="requests per batch size at least: rounds of B concurrent ones (default 8)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="the model's dtype (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--memory-mb", type=int, default=512, help="the engine's cache budget")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (both sides)")
    parser.add_argument("--profile", action="store_true",
                        help="per K, the kernels of five decode steps of one request (see the module notes)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.tokens.split(",")]
    run = Path(args.run)
    model = K3ForCausalLM.from_pretrained(run, device=args.device,
                                          dtype=getattr(torch, args.dtype) if args.dtype else None).eval()
    draft = EagleDraft.load(run, model)
    tokenizer = load_tokenizer(run / "tokenizer.json", vocab_size=model.config.vocab_size)
    eos = tokenizer.token_to_id(EOS)
    prompts = held_out_prompts(tokenizer, max(max(1, args.requests // b) * b for b in args.batches),
                               args.prompt_len)
    meta = json.loads((run / "draft.json").read_text())
    vocab = meta.get("vocab")
    print(f"{run}: {model.config.name}, {args.device}, draft trained with loss {meta.get('loss', '?')}, "
          f"{'the target head' if vocab is None else f'its own head over {vocab:,} ids'}; "
          f"{args.prompt_len}-token prompts, {args.max_tokens} new tokens, greedy"
          f"{', eager' if args.enforce_eager else ''}, {model.dtype}", flush=True)
    results = {0: run_case(model, draft, tokenizer, eos, prompts, 0, args)}
    for K in ks:
        results[K] = run_case(model, draft, tokenizer, eos, prompts, K, args)
    print("\n| batch | K | decode tok/s | vs K=0 | tokens / verification | accepted through position k "
          "| given k - 1 | draft share | requests with the K=0 tokens |")
    print("|---:|---:|---:|---:|---:|---|---|---:|---|")
    report = []
    for batch in args.batches:
        base = results[0][batch]
        for K in [0] + ks:
            row = results[K][batch]
            matching = sum(row["outputs"][i] == base["outputs"][i] for i in base["outputs"])
            same = f"{matching}/{len(base['outputs'])}"
            through = row.get("acceptance", [])
            accept = ", ".join(f"{a:.2f}" for a in through)
            given = ", ".join(f"{a / b:.2f}" if b else "-" for a, b in zip(through, [1.0] + through[:-1]))
            print(f"| {batch} | {K} | {row['tokens_per_s']:,.1f} | {row['tokens_per_s'] / base['tokens_per_s']:.2f}x "
                  f"| {row.get('mean_emitted', 1.0):.2f} | {accept or '-'} | {given or '-'} | "
                  f"{row.get('draft_share', 0.0):.2f} | {same} |")
            report.append({"batch": batch, "K": K, "tokens_per_s": row["tokens_per_s"],
                           "ratio": row["tokens_per_s"] / base["tokens_per_s"],
                           "mean_emitted": row.get("mean_emitted", 1.0), "acceptance": row.get("acceptance", []),
                           "draft_share": row.get("draft_share", 0.0), "same_tokens": same,
                           "all_same": matching == len(base["outputs"])})
    profiles = {}
    if args.profile:
        print_profiles(results)
        profiles = {K: results[K]["profile"] for K in results}
    if args.json:
        Path(args.json).write_text(json.dumps({"run": str(run), "device": args.device, "rows": report,
                                               "profiles": profiles}, indent=1))
    if model.dtype == torch.float32 and not all(r["all_same"] for r in report):
        print("FAIL: in fp32 greedy speculation must give the K = 0 tokens for every request", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
