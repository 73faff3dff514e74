"""Issue 7's multi-GPU measurements: MoonEP expert parallelism, KDA context parallelism, FSDP2.

One measurement per call, every rank launched by torchrun (NCCL on GPUs, gloo with --device cpu)::

    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py ep            # debug preset, MoonEP vs none
    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py ep --wide-moe # one K3-shaped MoE layer
    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py kcp           # one 64K-token sequence
    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py fsdp          # debug preset, dp = N

Each prints progress lines (flushed), then a markdown table, and rank 0 writes the JSON to
``$OUT/multigpu-<sub>.json`` (``multigpu-ep-wide.json`` for ``ep --wide-moe``; ``--json PATH``
overrides; nothing is written when neither is set). NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are forced at import, before torch
touches a GPU (issue 7 and the device README: no NVLink multicast).

What each subcommand measures
-----------------------------
``ep``: the trainer itself (``Trainer(TrainArgs(...), parallel=ParallelDims(dp=N, ep=N))``,
driven step by step through ``Trainer.train_step``, no checkpoints or evaluation), once per
``--balance`` mode: ``moonep`` (MoonEP's perfectly balanced plan) and ``none`` (every expert on its
owner: ``kimik3.parallel.moonep.PLANNERS["none"]``, set on every ``EPRoutedExperts`` after the
trainer built it). Same seed, same batches, same initial weights in both. Per run: global tokens/s
(median step), the per-step spread of step times over ranks (max/min, each rank's own
synchronised wall time of ``train_step``), the tokens each rank computed per MoE layer-step from
``EPRoutedExperts.last_quota`` (max/mean over ranks: 1.000 is perfect balance), peak memory per
rank, and the loss curve. Afterwards the process group is destroyed and rank 0 alone trains the
same steps as a plain single-process ``Trainer`` (the global batch on one device) for the loss
comparison, up to ``--ref-steps`` / ``--ref-budget-s`` (or ``--reference JSON`` reads an earlier
one, ``--no-reference`` skips it). Router-bias balancing (Quantile Balancing) stays on
(``--router-balance``), as in K3 training. The vocabulary is cut to 16K by default (``--vocab``:
the 164K BPE is not worth training on the stdlib corpus; 0 keeps the preset's).

``ep --wide-moe``: one ``LatentMoE`` at K3's shapes (D=7168, 896 experts of hidden 3072 in a 3584
latent, top-16, 2 shared experts; all flags), built on the meta device, expert-sharded with
``apply_expert_parallel`` and materialised in bf16 (only this rank's experts ever exist). The router
gets a Zipf-shaped selection bias (``--skew``: bias_e = -skew * log(1 + popularity rank of e), the
popularity order a random permutation) so that plain EP is imbalanced, as trained routers are.
Timed: forward + backward of ``--tokens-per-rank`` tokens per rank, MoonEP vs none on the same
weights and inputs (their outputs are compared too: the same math, placed differently).

``kcp``: one sequence of ``--tokens`` tokens (B=1, H=--heads, K=V=--head-dim, fp32 by default)
split into contiguous segments over the first P ranks, for P = 2, 4, 8, ... up to the world (and
the world itself): ``kimik3.parallel.kcp.kcp_kda`` forward + backward (loss sum(o * dO) with a
fixed random dO). The single-GPU reference is ``chunk_kda`` on the whole sequence, run by every
rank at once (each on its own GPU: the same time as rank 0 alone) and timed on rank 0; its outputs
and gradients are the truth the KCP runs are compared with (max abs error / max abs value).
Memory: a 4K-token probe measures chunk_kda's bytes per token (V = D, and V = 2D as a KCP rank
carries the transition columns); runs predicted to exceed ``--mem-fraction`` of a GPU are skipped
on every rank alike. The torch KDA path keeps ~2.4 MB per token at H=96, D=128 (CPU measurement;
the Triton kernels, the CUDA default, keep their own amount, which the probe measures), so one H200
may hold only tens of thousands of tokens: when the whole sequence does not fit, T1
is measured on the longest prefix T/2^j that does (or ``--single-tokens``) and scaled linearly,
and one extra KCP run over all ranks at that length checks the errors. speed-up = T1 / TP,
scaling efficiency = T1 / (P x TP).

``fsdp``: the trainer with ``ParallelDims(dp=N)`` (FSDP2, bf16 compute, fp32 reduction) on the
``debug`` preset: tokens/s (median step after ``--warmup``) and MFU.

MFU, model FLOPs per token (``model_flops_per_token``; training = 3 x forward, forward = 2 FLOPs per
multiply-add):
    6 x (active params + MTP active params)
        active (``kimik3.config.params.param_counts``): everything a token computes with, routed
        experts at top_k / E, the input embedding (a lookup) excluded, the output head included;
        MTP: its block (routed experts at top_k / E) and projection, plus the head it re-uses.
  + MLA layers (the model's and MTP's): 3 x H x (d_qk + d_v) x (T + 1)   [causal QK^T and AV,
        (T + 1) / 2 keys on average]
  + KDA layers: 3 x H x (6 K V + C (K + V))   [per token and head: three K x V products (readout
        q^T S, k^T S of the delta rule, the rank-1 state update) and the intra-chunk causal scores
        and values over C/2 tokens on average, C = chunk size 64]
MFU = tokens/s x FLOPs/token / (N x peak); peak = the H200's dense bf16 989 TFLOP/s (``--peak-tflops``).

Expected wall time on 8 H200s, defaults (estimates from the one-GPU figures in BENCHMARKS.md; not
yet measured): ``ep`` ~6-7 min (startup and 16K tokenizer ~1 min, each mode capped at
``--budget-s`` 120 s, the single-GPU reference at ``--ref-budget-s`` 75 s); ``ep --wide-moe`` ~2 min;
``kcp`` ~2 min; ``fsdp`` ~2-3 min. Every timed loop also stops at its budget, so the calls stay
inside the device tool's 10-minute limit; raise ``--steps``/budgets for longer runs.

CPU smoke (gloo, toy sizes; ``tests/parallel/test_multigpu_script.py`` runs these)::

    torchrun --standalone --nproc_per_node 2 benchmarks/multigpu.py ep --device cpu --preset tiny \\
        --vocab 0 --steps 4 --seq-len 64 --rows-per-rank 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the subcommand modules, also when loaded by path

import multigpu_common  # noqa: F401  (the NCCL switches, before torch touches a GPU)
import torch
from multigpu_common import model_flops_per_token  # noqa: F401  (re-exported: the FLOPs formula)
from multigpu_ep import cmd_ep
from multigpu_fsdp import cmd_fsdp
from multigpu_kcp import cmd_kcp


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    top = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    subs = top.add_subparsers(dest="sub", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", choices=["cuda", "cpu"], default=default_device,
                       help="cuda: NCCL, one GPU per rank; cpu: gloo (the smoke test)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="JSON path (default $OUT/multigpu-<sub>.json)")
        p.add_argument("--log-every", type=int, default=10)

    def training(p: argparse.ArgumentParser, steps: int, warmup: int, seq: int, rows: int, budget: float) -> None:
        p.add_argument("--preset", default="debug")
        p.add_argument("--config", help="a K3Config JSON file (overrides --preset)")
        p.add_argument("--vocab", type=int, default=16384, help="vocabulary override (0: the model's own)")
        p.add_argument("--data", help="corpus path (default: the stdlib sources)")
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--warmup", type=int, default=warmup, help="first steps left out of the timings")
        p.add_argument("--seq-len", type=int, default=seq)
        p.add_argument("--rows-per-rank", type=int, default=rows, help="sequences per rank per step")
        p.add_argument("--lr", type=float, default=4e-3)
        p.add_argument("--router-balance", default="quantile", choices=["quantile", "sign", "none"],
                       help="router-bias balancing (TrainArgs.balance), independent of MoonEP")
        p.add_argument("--budget-s", type=float, default=budget, help="stop a timed run after this many seconds")

    ep = subs.add_parser("ep", help="expert parallel: MoonEP vs no balancing")
    common(ep)
    training(ep, steps=200, warmup=5, seq=512, rows=4, budget=120.0)
    ep.add_argument("--balance", default="moonep,none", help="comma list of planners: moonep, none")
    ep.add_argument("--ref-steps", type=int, default=200, help="steps of the single-process reference (at most --steps)")
    ep.add_argument("--ref-budget-s", type=float, default=75.0)
    ep.add_argument("--reference", help="read the reference losses from an earlier multigpu-ep.json instead")
    ep.add_argument("--no-reference", action="store_true")
    ep.add_argument("--wide-moe", action="store_true", help="time one K3-shaped MoE layer instead of training")
    ep.add_argument("--dim", type=int, default=7168)
    ep.add_argument("--experts", type=int, default=896)
    ep.add_argument("--hidden", type=int, default=3072)
    ep.add_argument("--latent", type=int, default=3584)
    ep.add_argument("--top-k", type=int, default=16)
    ep.add_argument("--shared", type=int, default=2)
    ep.add_argument("--tokens-per-rank", type=int, default=4096)
    ep.add_argument("--skew", type=float, default=0.1, help="Zipf-shaped router selection bias (0: none)")
    ep.add_argument("--iters", type=int, default=10, help="--wide-moe: timed iterations")
    ep.set_defaults(func=cmd_ep)

    kcp = subs.add_parser("kcp", help="KDA context parallelism on one long sequence")
    common(kcp)
    kcp.add_argument("--tokens", type=int, default=65536)
    kcp.add_argument("--heads", type=int, default=96)
    kcp.add_argument("--head-dim", type=int, default=128)
    kcp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    kcp.add_argument("--ranks", help="comma list of rank counts (default 2, 4, 8, ... up to the world, and the world)")
    kcp.add_argument("--warmup", type=int, default=1)
    kcp.add_argument("--iters", type=int, default=3)
    kcp.add_argument("--no-single", action="store_true", help="skip the single-device reference")
    kcp.add_argument("--single-tokens", type=int, default=0,
                     help="time the single device on this many tokens and scale T1 linearly to --tokens (default: "
                          "the whole sequence, halved until it fits the device); errors are then checked by one "
                          "more KCP run at that length")
    kcp.add_argument("--mem-fraction", type=float, default=0.85,
                     help="skip runs predicted (from a 4K-token probe) to need more than this share of a GPU")
    kcp.add_argument("--kda-backend", choices=["auto", "torch", "triton"], help="sets KIMIK3_KDA_BACKEND")
    kcp.set_defaults(func=cmd_kcp)

    fsdp = subs.add_parser("fsdp", help="FSDP2 with dp = world: tokens/s and MFU")
    common(fsdp)
    training(fsdp, steps=40, warmup=5, seq=1024, rows=8, budget=240.0)
    fsdp.add_argument("--peak-tflops", type=float, default=989.0, help="per-device dense bf16 peak (H200: 989)")
    fsdp.add_argument("--activation-checkpointing", choices=["none", "full", "selective"], default="none",
                      help="what each step recomputes in backward (kimik3.parallel.activation_checkpoint)")
    fsdp.set_defaults(func=cmd_fsdp)
    return top.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.func(args)


if __name__ == "__main__":
    main()
    # Every process group is destroyed and rank 0's JSON is written by now: end the rank before gloo's
    # finalisation can fail it.
    from kimik3.parallel.context import exit_rank

    exit_rank()
