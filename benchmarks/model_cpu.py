"""Tiny-preset forward and forward+backward throughput on this machine's CPU.

    python benchmarks/model_cpu.py [--preset tiny] [--batch 8] [--seq 256] [--iters 5]

Prints tokens/s for forward, forward+backward (with the MTP loss), and cached greedy decode.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kimik3 import K3Config, K3ForCausalLM


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = K3Config.preset(args.preset)
    model = K3ForCausalLM(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    tokens = ids.numel()

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    def forward_backward() -> None:
        model(ids, labels=ids.roll(-1, 1)).loss.backward()
        model.zero_grad(set_to_none=True)

    t_fwd = timed(forward, args.iters)
    t_fb = timed(forward_backward, args.iters)
    prompt = ids[:1, :32]
    t_dec = timed(lambda: model.generate(prompt, args.decode_tokens), max(1, args.iters // 2))

    print(f"preset={args.preset} batch={args.batch} seq={args.seq} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}")
    print(f"{'forward':<22}{t_fwd * 1e3:>10.1f} ms {tokens / t_fwd:>12,.0f} tok/s")
    print(f"{'forward+backward':<22}{t_fb * 1e3:>10.1f} ms {tokens / t_fb:>12,.0f} tok/s")
    print(f"{'greedy decode (B=1)':<22}{t_dec * 1e3:>10.1f} ms {args.decode_tokens / t_dec:>12,.1f} tok/s "
          f"(32-token prompt + {args.decode_tokens} new)")


if __name__ == "__main__":
    main()
