"""Tiny-preset forward and forward+backward throughput on this machine's CPU, next to its peer.

    python benchmarks/model_cpu.py [--preset tiny] [--batch 8] [--seq 256] [--iters 5]

Prints tokens/s for forward, forward+backward (with the MTP loss) and cached greedy decode, for
the K3 preset and, in the same run, for the dense GPT of the same active parameter count
(``kimik3.model.baseline``), with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.baseline import DenseGPT, dense_baseline_for


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

    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    config = K3Config.preset(args.preset)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    tokens = ids.numel()
    rows = {}
    for name, model in (("k3", K3ForCausalLM(config, seed=0)), ("dense", DenseGPT(dense_baseline_for(config), seed=0))):
        def forward() -> None:
            with torch.no_grad():
                model(ids)

        def forward_backward() -> None:
            model(ids, labels=ids.roll(-1, 1)).loss.backward()
            model.zero_grad(set_to_none=True)

        rows[name] = [tokens / timed(forward, args.iters), tokens / timed(forward_backward, args.iters)]
        if name == "k3":
            prompt = ids[:1, :32]
            t_dec = timed(lambda: model.generate(prompt, args.decode_tokens), max(1, args.iters // 2))

    print(f"preset={args.preset} batch={args.batch} seq={args.seq} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}")
    print(f"{'tokens/s':<22}{'k3':>12}{'dense peer':>12}{'k3/dense':>10}")
    for i, label in enumerate(("forward", "forward+backward")):
        print(f"{label:<22}{rows['k3'][i]:>12,.0f}{rows['dense'][i]:>12,.0f}{rows['k3'][i] / rows['dense'][i]:>10.2f}")
    print(f"{'k3 greedy decode (B=1)':<22}{args.decode_tokens / t_dec:>12,.1f}  (32-token prompt + "
          f"{args.decode_tokens} new, hybrid cache)")


if __name__ == "__main__":
    main()
