"""A K3 training step on one GPU: time, tokens/s, MFU, peak memory and kernel count (issue 39).

    python benchmarks/train_gpu.py                              # debug preset, 4 x 4,096 tokens, on cuda
    python benchmarks/train_gpu.py --optimizer muon --json out.json
    python benchmarks/train_gpu.py --activation-checkpointing selective --find-max-seq-len --seq-len 16384
    python benchmarks/train_gpu.py --no-mtp --peer torchtitan       # and torchtitan's port, same tokens, same run
    python benchmarks/train_gpu.py --check-eager 8                  # the CUDA graph's losses against eager ones

One step = forward + backward (main and MTP losses) + optimizer step + zero_grad, on random token ids, the
model's parameters in bf16 as ``kimik3 train --device cuda`` holds them (fp32 islands as the model keeps them).
``--optimizer adamw`` is fused AdamW over every parameter (how torchtitan's parity loop trains); ``muon`` is
K3's own optimizer (per-head Muon + AdamW, ``kimik3.optim.build_param_groups``).

By default each block is compiled (``--no-compile``: eager blocks) and the step (forward, backward, optimizer) is
replayed as one CUDA graph after three eager steps (``kimik3.train.captured_step.CapturedStep``;
``--no-cuda-graph`` times it eagerly): eagerly the host issues the ~5,000 kernels of a step more slowly than the GPU
runs them. Both as ``kimik3 train --device cuda`` runs by default. ``--check-eager N`` runs N steps both ways from the
same weights on the same batches and prints the losses side by side.

MFU counts 6 x active parameters per token (``kimik3.config.params.param_counts``: routed experts at
top_k / num_experts, embedding excluded) over the GPU's dense bf16 peak (``--peak-tflops``, 989 for an H200),
attention FLOPs left out, as the issue's baseline does.

``--peer torchtitan``: then torchtitan's Kimi K3 port (``benchmarks/torchtitan_port.py``; run
``benchmarks/setup_torchtitan.sh`` first and carry ``third_party/`` and ``.whl/``) on the same token ids with the
same starting weights (ours, loaded into it) and fused AdamW, in a plain loop as its parity script builds it: one
sequence per forward (the port takes one document per call; backward after each, gradient accumulation), its
FlexAttention compiled with inductor's defaults (``--peer-compile autotune``: the port's own max-autotune, minutes
of warm-up). The port has no MTP module: ``--no-mtp`` drops ours for equal work. Reported: both, the ratio of
tokens/s, and both losses after the same steps.

``--activation-checkpointing`` (none / full / selective, ``kimik3.parallel.activation_checkpoint``) is applied to
the model before the optimizer is built. ``--find-max-seq-len``: one sequence per step (batch 1), the length
doubled from ``--seq-len`` until a step runs out of GPU memory; reports the longest that fit with its tokens/s,
and the peak memory of every length tried (default 1 warmup step and 2 timed steps per length).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed
from kimik3 import K3Config, K3ForCausalLM  # noqa: E402
from kimik3.cli import checkpoint_mode_arg  # noqa: E402
from kimik3.config.params import param_counts  # noqa: E402
from kimik3.optim.muon import build_param_groups  # noqa: E402
from kimik3.model.k3 import check_token_ids  # noqa: E402
from kimik3.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from kimik3.parallel.compile import apply_compile  # noqa: E402
from kimik3.train.captured_step import CapturedStep  # noqa: E402


def make_optimizer(model: K3ForCausalLM, kind: str, capturable: bool) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
                                 capturable=capturable)
    return build_param_groups(model, lr=1e-4, capturable=capturable)


def build_model(config: K3Config, args) -> tuple[K3ForCausalLM, torch.optim.Optimizer]:
    """The model from seed 0 on the GPU in bf16, checkpointing applied, its blocks compiled (as ``kimik3 train``
    does by default), and its optimizer."""
    model = K3ForCausalLM(config, seed=0).to("cuda").cast(torch.bfloat16).train()
    apply_activation_checkpointing(model, args.activation_checkpointing)
    if args.compile:
        apply_compile(model)
    return model, make_optimizer(model, args.optimizer, capturable=args.cuda_graph)


def step_fn(model: K3ForCausalLM, optimizer, batch: int, seq_len: int, vocab: int, device: str,
            cuda_graph: bool):
    """One training step on the next batch of random ids (a fixed generator: every run sees the same batches);
    returns the main loss. ``cuda_graph``: the step after the ids are drawn is a ``CapturedStep``."""
    gen = torch.Generator(device=device).manual_seed(0)

    def train_step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = model(inputs, labels=labels)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.main_loss.detach()

    run = train_step
    if cuda_graph:
        run = CapturedStep(train_step, optimizer, check=lambda ids, labels: check_token_ids(ids, labels, vocab))

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, seq_len + 1), device=device, generator=gen)
        return run(ids[:, :-1], ids[:, 1:])

    return step


def peer_step_fn(port, optimizer, batch: int, seq_len: int, vocab: int, device: str):
    """torchtitan's port on the token ids ``step_fn`` draws (same generator seed): one step, its main CE."""
    from torchtitan_port import port_train_loss

    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, seq_len + 1), device=device, generator=gen)
        loss = port_train_loss(port, ids[:, :-1], ids[:, 1:], backward=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def run_peer(config: K3Config, args, vocab: int) -> dict:
    """Time the port from our model's starting weights (seed 0, built again on the CPU, bf16 as ours trains)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torchtitan_port import build_port, import_port, load_ours_into_port

    port_ns = import_port(compile_mode=args.peer_compile)
    port = build_port("cuda", torch.bfloat16, init_on_device=True)
    load_ours_into_port(port, K3ForCausalLM(config, seed=0).cast(torch.bfloat16))
    optimizer = torch.optim.AdamW(port.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step = peer_step_fn(port, optimizer, args.batch, args.seq_len, vocab, "cuda")
    torch.cuda.reset_peak_memory_stats()
    seconds, losses = measure(step, args.warmup, args.steps)
    tokens = args.batch * args.seq_len
    return {"name": "torchtitan Kimi K3 port (PR 4025)", "commit": port_ns.commit, "compile": args.peer_compile,
            "ms_per_step": seconds * 1e3, "tokens_per_s": tokens / seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses}


def profile_step(step, trace: str | None = None) -> dict:
    """One step under the profiler: kernel count and total kernel time, the step's wall time, the host calls that
    wait for the GPU, and the 30 kernels that take longest (a chrome trace to ``trace`` if given)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - start) * 1e3   # until the host has issued everything
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    if trace:
        prof.export_chrome_trace(trace)
    rows, syncs = [], {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA":
            us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
            if us:
                rows.append((event.key[:90], us / 1e3, event.count))
        elif event.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                           "aten::_local_scalar_dense", "aten::nonzero"):
            syncs[event.key] = event.count
    rows.sort(key=lambda r: -r[1])
    return {"kernels": sum(r[2] for r in rows), "kernel_ms": sum(r[1] for r in rows), "wall_ms": wall_ms,
            "host_ms": host_ms, "host_calls_that_may_sync": syncs, "top": rows[:30]}


def measure(step, warmup: int, steps: int) -> tuple[float, list[float]]:
    """Seconds per step over ``steps`` timed steps after ``warmup`` ones, and the losses (first and last)."""
    losses = []
    for _ in range(warmup):
        losses.append(float(step()))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    losses.append(float(loss))
    return seconds, losses


def find_max_seq_len(model: K3ForCausalLM, optimizer, args, vocab: int) -> dict:
    """Batch 1, the length doubled from ``args.seq_len`` until a step runs out of memory (or passes
    ``args.seq_len_limit``): every length tried, with its peak memory, and the longest that fit."""
    tried, best = [], None
    seq_len = args.seq_len
    while seq_len <= args.seq_len_limit:
        torch.cuda.reset_peak_memory_stats()
        print(f"  seq_len {seq_len:,}: ...", end="", flush=True)
        # Eager: each length would capture a graph of its own, and a capture that runs out of memory leaves
        # its private pool behind.
        step = step_fn(model, optimizer, 1, seq_len, vocab, "cuda", cuda_graph=False)
        try:
            seconds, losses = measure(step, args.warmup, args.steps)
            row = {"seq_len": seq_len, "fits": True, "ms_per_step": seconds * 1e3, "tokens_per_s": seq_len / seconds,
                   "losses": losses}
        except RuntimeError as error:   # torch.OutOfMemoryError, or a library's failed allocation (cuBLAS)
            message = str(error).split("\n")[0]
            out_of_memory = isinstance(error, torch.OutOfMemoryError) or "out of memory" in message.lower() \
                or "ALLOC_FAILED" in message
            row = {"seq_len": seq_len, "fits": False, "out_of_memory": out_of_memory}
            if not out_of_memory:   # another failure at this length: reported, and the search stops
                row["error"] = message[:500]
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        tried.append(row)
        if "error" in row:   # the device may be unusable now: no more calls on it
            print(f" failed: {row['error']}", flush=True)
            break
        # Out of the except block: the traceback no longer holds the failed step's tensors.
        del step
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if not row["fits"]:
            print(f" out of memory (peak {row['peak_memory_gib']:.1f} GiB before it)", flush=True)
            break
        best = row
        print(f" fits: {row['ms_per_step']:.0f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, peak "
              f"{row['peak_memory_gib']:.1f} GiB", flush=True)
        seq_len *= 2
    return {"tried": tried, "max_seq_len": best["seq_len"] if best else None,
            "max_seq_len_tokens_per_s": best["tokens_per_s"] if best else None,
            "max_seq_len_peak_memory_gib": best["peak_memory_gib"] if best else None}


def check_against_eager(config: K3Config, args) -> dict:
    """``args.check_eager`` steps eagerly, eagerly again, then with the step captured, each from seed 0's weights
    on the same batches: the main losses step by step. Eager training of the debug preset on a GPU is not bitwise
    reproducible (atomic accumulations, cuDNN's attention backward among them), so the graph is judged against the
    eager runs' own spread: it passes when its largest difference from the first eager run is at most twice that
    spread plus ``--check-tolerance``."""
    runs = {}
    for name, graphed in (("eager", False), ("eager_again", False), ("cuda_graph", True)):
        model, optimizer = build_model(config, args)
        step = step_fn(model, optimizer, args.batch, args.seq_len, config.vocab_size, "cuda", graphed)
        runs[name] = [float(step()) for _ in range(args.check_eager)]
        del model, optimizer, step
        gc.collect()
        torch.cuda.empty_cache()
    spread = max(abs(a - b) for a, b in zip(runs["eager"], runs["eager_again"], strict=True))
    diffs = [abs(a - b) for a, b in zip(runs["eager"], runs["cuda_graph"], strict=True)]
    bound = 2 * spread + args.check_tolerance
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
           "optimizer": args.optimizer, "batch": args.batch, "seq_len": args.seq_len, "steps": args.check_eager,
           **runs, "abs_diff": diffs, "max_abs_diff": max(diffs), "eager_spread": spread, "bound": bound,
           "pass": max(diffs) <= bound}
    print(f"{args.check_eager} steps, {args.optimizer}, {args.batch} x {args.seq_len} tokens, from the same "
          f"weights on the same batches (the graph's first 3 steps are its eager warm-up):")
    for index, row in enumerate(zip(runs["eager"], runs["eager_again"], runs["cuda_graph"], strict=True)):
        print(f"  step {index}: eager {row[0]:.6f}  eager again {row[1]:.6f}  CUDA graph {row[2]:.6f}")
    print(f"largest |graph - eager| {out['max_abs_diff']:.2e}; eager's own spread {spread:.2e}; bound "
          f"{bound:.2e}: {'PASS' if out['pass'] else 'FAIL'}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, help="timed steps (default 10; 2 per length with --find-max-seq-len)")
    parser.add_argument("--warmup", type=int,
                        help="untimed steps first (default 5 with the CUDA graph, else 3; 1 with --find-max-seq-len)")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--activation-checkpointing", type=checkpoint_mode_arg, default="none",
                        help="what a step recomputes in backward: none, full, selective or every:N "
                             "(kimik3.parallel.activation_checkpoint)")
    parser.add_argument("--find-max-seq-len", action="store_true",
                        help="batch 1, double the length from --seq-len until a step runs out of memory")
    parser.add_argument("--seq-len-limit", type=int, default=1 << 21, help="--find-max-seq-len stops past this")
    parser.add_argument("--no-mtp", action="store_true", help="our model without its MTP module (the port has none)")
    parser.add_argument("--peer", choices=["torchtitan"], help="also time torchtitan's Kimi K3 port, same run")
    parser.add_argument("--peer-compile", choices=["fast", "autotune"], default="fast",
                        help="the port's FlexAttention compile: inductor defaults, or its own max-autotune")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                        help="replay the step as one CUDA graph after 3 eager steps (kimik3.train.captured_step)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="compile each block (kimik3.parallel.compile, kimik3 train's default on a GPU); the "
                             "first step of each shape compiles (tens of seconds), inside the warm-up")
    parser.add_argument("--check-eager", type=int, metavar="STEPS",
                        help="instead of timing: STEPS steps eagerly (twice) and with the CUDA graph from the same "
                             "start, their losses compared")
    parser.add_argument("--check-tolerance", type=float, default=0.0,
                        help="--check-eager fails (exit 1) past twice eager's own spread plus this")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one step: kernel time against wall time, the top kernels")
    parser.add_argument("--trace", help="with --profile: write that step's chrome trace here")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.find_max_seq_len else 10
    if args.warmup is None:   # with the graph: its 3 eager steps, the capture and one replay
        args.warmup = 1 if args.find_max_seq_len else (5 if args.cuda_graph else 3)
    if not torch.cuda.is_available():
        raise SystemExit("train_gpu.py needs a CUDA GPU")
    device = "cuda"
    config = K3Config.preset(args.preset)
    if args.no_mtp:
        config = dataclasses.replace(config, mtp=dataclasses.replace(config.mtp, num_modules=0))
    if args.check_eager:
        out = check_against_eager(config, args)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0 if out["pass"] else 1
    model, optimizer = build_model(config, args)
    if args.find_max_seq_len:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.preset}, {args.optimizer}, "
              f"activation checkpointing {args.activation_checkpointing}: the longest sequence a step fits "
              f"(batch 1, from {args.seq_len:,} tokens, doubling)", flush=True)
        out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
               "optimizer": args.optimizer, "activation_checkpointing": args.activation_checkpointing, "batch": 1,
               "warmup": args.warmup, "steps": args.steps,
               **find_max_seq_len(model, optimizer, args, config.vocab_size)}
        if out["max_seq_len"] is None:
            print(f"activation checkpointing {args.activation_checkpointing}: not even {args.seq_len:,} tokens fit",
                  flush=True)
        else:
            print(f"activation checkpointing {args.activation_checkpointing}: max seq_len {out['max_seq_len']:,} "
                  f"tokens ({out['max_seq_len_tokens_per_s']:,.0f} tokens/s, peak "
                  f"{out['max_seq_len_peak_memory_gib']:.1f} GiB)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    step = step_fn(model, optimizer, args.batch, args.seq_len, config.vocab_size, device, args.cuda_graph)
    active = param_counts(config)["active"]
    tokens = args.batch * args.seq_len

    losses = []
    # from the first step: a CUDA graph allocates its activations at capture (a warm-up step), not in replays
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        losses.append(float(step()))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    losses.append(float(loss))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
           "optimizer": args.optimizer, "activation_checkpointing": args.activation_checkpointing,
           "mtp": not args.no_mtp, "batch": args.batch, "seq_len": args.seq_len, "active_params": active,
           "ms_per_step": seconds * 1e3, "tokens_per_s": tokens / seconds,
           "mfu": 6 * active * tokens / seconds / (args.peak_tflops * 1e12),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
           "reserved_gib": torch.cuda.memory_reserved() / 2**30, "cuda_graph": args.cuda_graph,
           "compile": args.compile,
           "losses": losses}
    print(f"{out['device']}, torch {out['torch']}, {args.preset} ({active / 1e6:.1f}M active), {args.optimizer}, "
          f"activation checkpointing {args.activation_checkpointing}, {args.batch} x {args.seq_len} tokens: "
          f"{out['ms_per_step']:.1f} ms/step, {out['tokens_per_s']:,.0f} tokens/s, MFU {out['mfu']:.1%}, "
          f"peak {out['peak_memory_gib']:.1f} GiB allocated, {out['reserved_gib']:.1f} GiB reserved after, "
          f"{'CUDA graph' if args.cuda_graph else 'eager'}{', blocks compiled' if args.compile else ''}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    if args.profile:
        prof = out["profile"] = profile_step(step, args.trace)
        print(f"one step under the profiler: {prof['wall_ms']:.1f} ms wall, host done issuing at "
              f"{prof['host_ms']:.1f} ms; {prof['kernels']} kernels taking {prof['kernel_ms']:.1f} ms "
              f"(GPU idle {prof['wall_ms'] - prof['kernel_ms']:.1f} ms); host calls that may wait on the GPU: "
              f"{prof['host_calls_that_may_sync']}")
        print("kernels by time (ms, launches):")
        for name, ms, count in prof["top"]:
            print(f"  {ms:8.2f} {count:6d}  {name}")
    if args.peer:
        del step, optimizer, model
        gc.collect()
        torch.cuda.empty_cache()
        peer = run_peer(config, args, config.vocab_size)
        peer["ratio_ours_over_peer"] = out["tokens_per_s"] / peer["tokens_per_s"]
        out["peer"] = peer
        print(f"peer {peer['name']} ({peer['compile']} compile): {peer['ms_per_step']:.1f} ms/step, "
              f"{peer['tokens_per_s']:,.0f} tokens/s, peak {peer['peak_memory_gib']:.1f} GiB, loss "
              f"{peer['losses'][0]:.3f} -> {peer['losses'][-1]:.3f}; ours / peer = "
              f"{peer['ratio_ours_over_peer']:.2f}x (our main loss {losses[0]:.3f} -> {losses[-1]:.3f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
