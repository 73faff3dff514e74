"""A K3 training step on one GPU: time, tokens/s, MFU, peak memory and kernel count (issue 39).

    python benchmarks/train_gpu.py                              # debug preset, 4 x 4,096 tokens, on cuda
    python benchmarks/train_gpu.py --optimizer muon --json out.json

One step = forward + backward (main and MTP losses) + optimizer step + zero_grad, on random token ids, the
model's parameters in bf16 as ``kimik3 train --device cuda`` holds them (fp32 islands as the model keeps them).
``--optimizer adamw`` is fused AdamW over every parameter (how torchtitan's parity loop trains); ``muon`` is
K3's own optimizer (per-head Muon + AdamW, ``kimik3.optim.build_param_groups``).

MFU counts 6 x active parameters per token (``kimik3.config.params.param_counts``: routed experts at
top_k / num_experts, embedding excluded) over the GPU's dense bf16 peak (``--peak-tflops``, 989 for an H200),
attention FLOPs left out, as the issue's baseline does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed
from kimik3 import K3Config, K3ForCausalLM  # noqa: E402
from kimik3.config.params import param_counts  # noqa: E402
from kimik3.optim.muon import build_param_groups  # noqa: E402


def make_optimizer(model: K3ForCausalLM, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return build_param_groups(model, lr=1e-4)


def step_fn(model: K3ForCausalLM, optimizer, batch: int, seq_len: int, vocab: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch, seq_len + 1), device=device, generator=gen)
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.main_loss.detach()

    return step


def count_kernels(step) -> tuple[int, list[tuple[str, float, int]]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if us and event.device_type.name == "CUDA":
            rows.append((event.key[:90], us / 1e3, event.count))
    rows.sort(key=lambda r: -r[1])
    return sum(r[2] for r in rows), rows[:30]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--profile", action="store_true", help="also count the kernels of one step")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("train_gpu.py needs a CUDA GPU")
    device = "cuda"
    config = K3Config.preset(args.preset)
    model = K3ForCausalLM(config, seed=0).to(device).cast(torch.bfloat16).train()
    optimizer = make_optimizer(model, args.optimizer)
    step = step_fn(model, optimizer, args.batch, args.seq_len, config.vocab_size, device)
    active = param_counts(config)["active"]
    tokens = args.batch * args.seq_len

    losses = []
    for _ in range(args.warmup):
        losses.append(float(step()))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    losses.append(float(loss))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
           "optimizer": args.optimizer, "batch": args.batch, "seq_len": args.seq_len, "active_params": active,
           "ms_per_step": seconds * 1e3, "tokens_per_s": tokens / seconds,
           "mfu": 6 * active * tokens / seconds / (args.peak_tflops * 1e12),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses}
    print(f"{out['device']}, torch {out['torch']}, {args.preset} ({active / 1e6:.1f}M active), {args.optimizer}, "
          f"{args.batch} x {args.seq_len} tokens: {out['ms_per_step']:.1f} ms/step, {out['tokens_per_s']:,.0f} "
          f"tokens/s, MFU {out['mfu']:.1%}, peak {out['peak_memory_gib']:.1f} GiB, loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}", flush=True)
    if args.profile:
        out["kernels_per_step"], out["top_kernels_ms"] = count_kernels(step)
        print(f"{out['kernels_per_step']} kernels per step; by time (ms, launches):")
        for name, ms, count in out["top_kernels_ms"]:
            print(f"  {ms:8.2f} {count:6d}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
