"""Quantile Balancing vs DeepSeek-V3's sign update on drifting synthetic routing (notes §4).

Claim checked: QB reads the balancing bias off a quantile instead of nudging it by +-gamma, so it
reaches max/mean load <= 1.05 in one or two steps from any start, and keeps tracking a routing
distribution that drifts, where a fixed step gamma lags by (bias range / gamma) steps.

Legend: T = tokens per step, E = experts, K = experts per token, R = rank of the token structure.

Synthetic routing, one fresh batch per step: logits_TE = mu_E(step) + u_TR @ W_RE + noise_TE with
mu_E(step) = mu_E(0) + velocity_E * step (a per-expert linear drift; mu_E(0) ~ N(0, skew^2),
velocity_E ~ N(0, drift^2)), u_TR ~ N(0, 1) a token's position in an R-dimensional "topic"
space that correlates experts (W_RE ~ N(0, structure^2 / R)), noise_TE ~ N(0, 1); scores =
sigmoid(logits). Each step routes the batch with the current bias (top-K of scores + bias),
records max/mean load, then updates the bias from that batch. Every policy sees the same batches
(common random numbers: the batch of step s depends only on (seed, s)).

Finite T puts a floor under max/mean whatever the bias: the loads of a fresh batch fluctuate by
~sqrt(T*K/E) tokens. The ``floor`` column measures it: the imbalance of fresh batches of the last
step's distribution under a bias fitted (six QB passes) on eight separate batches of that same
distribution. Steps-to-1.05 is meaningful only where the floor is well below 1.05.

Usage:
    python benchmarks/balance.py                    # CPU: 64:4:65536, 200 steps (~1 min on 2 idle cores)
    python benchmarks/balance.py --device cuda      # 64:4:262144,256:8:524288,896:16:1048576, 300 steps
                                                    # (~80 s on an H200)
Larger E on a CPU: at the T two cores can route in a couple of minutes, the sampling floor of
E=256 or 896 is above 1.05 (e.g. 1.14 at E=256 T=16384), so steps-to-1.05 says nothing there.
    python benchmarks/balance.py --drift 0.005      # a drift the sign update cannot follow
    python benchmarks/balance.py --plot balance.png # also plot max/mean vs step (matplotlib)
    python benchmarks/balance.py --real-training    # also inside kimik3's trainer (tiny preset, per policy)
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kimik3.train.balance import (  # noqa: E402
    accumulate_histogram,
    bin_range,
    histogram_quantile,
    load_imbalance,
    quantile_bias_histogram,
    required_bias,
    route_biased,
    sign_update,
)

POLICIES = ("quantile", "quantile-cutoff", "sign", "none")
POLICY_LABELS = {"quantile": "QB", "quantile-cutoff": "QB (K+1)-cutoff", "sign": "sign", "none": "no balancing"}


@dataclass(frozen=True, slots=True)
class Setting:
    num_experts: int
    top_k: int
    num_tokens: int

    @classmethod
    def parse(cls, text: str) -> "Setting":
        try:
            experts, top_k, tokens = (int(v) for v in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a setting is E:K:T (e.g. 64:4:32768), got {text!r}") from None
        if not 1 <= top_k < experts or tokens < 1:
            raise argparse.ArgumentTypeError(f"setting {text!r}: need 1 <= K < E and T >= 1")
        return cls(experts, top_k, tokens)

    def __str__(self) -> str:
        return f"E={self.num_experts} K={self.top_k} T={self.num_tokens}"


@dataclass(frozen=True, slots=True)
class Stream:
    """The drifting routing distribution (see the module docstring); all tensors on ``device``."""

    mu0_E: torch.Tensor
    velocity_E: torch.Tensor
    w_RE: torch.Tensor
    seed: int

    @classmethod
    def build(cls, num_experts: int, *, skew: float, drift: float, rank: int, structure: float, seed: int,
              device: torch.device) -> "Stream":
        g = torch.Generator().manual_seed(seed)
        mu0_E = torch.randn(num_experts, generator=g) * skew
        velocity_E = torch.randn(num_experts, generator=g) * drift
        w_RE = torch.randn(max(rank, 1), num_experts, generator=g) * (structure / math.sqrt(max(rank, 1)))
        if rank == 0:
            w_RE.zero_()
        return cls(mu0_E.to(device), velocity_E.to(device), w_RE.to(device), seed)

    def batch(self, step: int, num_tokens: int, salt: int = 0) -> torch.Tensor:
        """scores_TE [T, E] fp32 of step ``step``; a pure function of (seed, step, salt)."""
        device = self.mu0_E.device
        g = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + step * 7919 + salt)
        u_TR = torch.randn(num_tokens, self.w_RE.shape[0], generator=g, device=device)
        logits_TE = torch.randn(num_tokens, self.mu0_E.numel(), generator=g, device=device)
        logits_TE += self.mu0_E + self.velocity_E * step
        logits_TE.addmm_(u_TR, self.w_RE)
        return logits_TE.sigmoid_()


def simulate(policy: str, setting: Setting, stream: Stream, *, steps: int, num_bins: int = 1000,
             gamma: float = 1e-3) -> list[float]:
    """Route ``steps`` fresh batches with ``policy`` updating the bias after each; max/mean load per step."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    bias_E = torch.zeros(setting.num_experts, device=stream.mu0_E.device)
    history = []
    for step in range(steps):
        scores_TE = stream.batch(step, setting.num_tokens)
        ids_TK, cutoff_T, loads_E = route_biased(scores_TE, bias_E, setting.top_k)
        history.append(load_imbalance(loads_E))
        if policy in ("quantile", "quantile-cutoff"):
            bias_E = quantile_bias_histogram(scores_TE, cutoff_T, bias_E, setting.top_k, num_bins=num_bins,
                                             threshold="others" if policy == "quantile" else "cutoff",
                                             ids_TK=ids_TK)
        elif policy == "sign":
            bias_E = sign_update(bias_E, loads_E, gamma)
    return history


def sampling_floor(setting: Setting, stream: Stream, step: int, *, fit_batches: int = 8, passes: int = 6,
                   repeats: int = 4) -> float:
    """Mean max/mean of fresh T-token batches of step ``step`` under a bias fitted on ``fit_batches`` others.

    The fit is ``passes`` QB passes from bias 0 (correlated experts need a few), each pooling the
    histograms of ``fit_batches`` independent batches (as ``QuantileBalancer`` pools
    micro-batches), so its own sampling error is small.
    """
    top_k, num_experts = setting.top_k, setting.num_experts
    device = stream.mu0_E.device
    bias_E = torch.zeros(num_experts, device=device)
    for _ in range(passes):
        low, high = bin_range(bias_E, top_k)
        histogram_EB = torch.zeros(num_experts, 4000, dtype=torch.int64, device=device)
        for batch in range(fit_batches):
            scores_TE = stream.batch(step, setting.num_tokens, salt=1 + batch)
            ids_TK, cutoff_T, _ = route_biased(scores_TE, bias_E, top_k)
            required_TE = required_bias(scores_TE, cutoff_T, bias_E, top_k, ids_TK=ids_TK)
            accumulate_histogram(histogram_EB, required_TE, low, high)
            del scores_TE, required_TE
        quantile_E = histogram_quantile(histogram_EB, low, high, top_k / num_experts)
        bias_E = quantile_E - quantile_E.mean()
    values = [load_imbalance(route_biased(stream.batch(step, setting.num_tokens, salt=100 + r), bias_E, top_k)[2])
              for r in range(repeats)]
    return sum(values) / len(values)


def steps_to(history: list[float], target: float) -> int | None:
    """First step whose batch was routed at max/mean <= target (None: never)."""
    return next((step for step, value in enumerate(history) if value <= target), None)


def real_training_comparison(steps: int = 60, policies: tuple[str, ...] = ("quantile", "sign", "none"), *,
                             target: float = 1.05, last: int = 20, preset: str = "tiny",
                             out_root: str | None = None) -> list[dict] | None:
    """The same comparison inside real training: ``kimik3 train``'s loop on ``preset``, one run per policy.

    Returns one row per policy (steps to ``target``, mean max/mean over the last ``last`` steps,
    final loss), or None after a printed note when ``kimik3.train.trainer`` is not importable.
    The per-step imbalance is the trainer's ``expert_load_max_over_mean`` (the balancer's mean
    over layers); with the tiny preset's small batches its sampling floor is well above 1.05.
    """
    try:
        from kimik3.train.trainer import TrainArgs, Trainer
    except ImportError as err:
        print(f"\nreal training comparison skipped: it needs kimik3.train.trainer ({err})")
        return None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(out_root or tmp)
        for policy in policies:
            args = TrainArgs(preset=preset, steps=steps, out=str(root / policy), balance=policy, progress=False,
                             eval_every=10 * steps, checkpoint_every=10 * steps)
            started = time.perf_counter()
            summary = Trainer(args, log=lambda _: None).run()
            imbalance = [r.get("expert_load_max_over_mean") for r in summary.history]
            imbalance = [v if v is not None else math.nan for v in imbalance]
            tail = [v for v in imbalance[-last:] if not math.isnan(v)]
            rows.append({"policy": policy, "steps_to_target": steps_to(imbalance, target),
                         "last_mean": sum(tail) / len(tail) if tail else math.nan,
                         "first": imbalance[0] if imbalance else math.nan,
                         "final_loss": summary.final_loss, "seconds": time.perf_counter() - started,
                         "history": imbalance})
    print(f"\nreal training: preset {preset}, {steps} steps per policy (trainer defaults otherwise)")
    print(f"| policy | max/mean at step 0 | steps to <= {target} | max/mean, last {last} steps | final loss | s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        reached = row["steps_to_target"] if row["steps_to_target"] is not None else f"> {steps - 1}"
        print(f"| {row['policy']} | {row['first']:.3f} | {reached} | {row['last_mean']:.3f} | "
              f"{row['final_loss']:.3f} | {row['seconds']:.0f} |")
    return rows


def plot(results: dict[Setting, dict[str, list[float]]], path: str, target: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), squeeze=False)
    for ax, (setting, by_policy) in zip(axes[0], results.items()):
        for policy, history in by_policy.items():
            ax.plot(range(len(history)), history, label=POLICY_LABELS[policy], lw=1.2)
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(str(setting))
        ax.set_xlabel("step")
        ax.set_ylabel("max / mean expert load")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--settings", type=lambda s: [Setting.parse(v) for v in s.split(",")],
                        default=None, help="comma-separated E:K:T (default: 64:4:65536 on CPU, "
                                           "64:4:262144,256:8:524288,896:16:1048576 on CUDA)")
    parser.add_argument("--steps", type=int, default=None, help="default: 300 on CUDA, 200 on CPU")
    parser.add_argument("--policies", default="quantile,quantile-cutoff,sign",
                        help=f"comma-separated subset of {POLICIES}")
    parser.add_argument("--target", type=float, default=1.05, help="max/mean load counted as balanced")
    parser.add_argument("--last", type=int, default=50, help="steady state: average over the last N steps")
    parser.add_argument("--gamma", type=float, default=1e-3, help="sign update step (score units)")
    parser.add_argument("--num-bins", type=int, default=1000)
    parser.add_argument("--skew", type=float, default=0.25, help="std of the initial per-expert logit offsets")
    parser.add_argument("--drift", type=float, default=0.002, help="std of per-expert logit drift per step")
    parser.add_argument("--rank", type=int, default=8, help="rank R of the shared token structure (0: none)")
    parser.add_argument("--structure", type=float, default=0.5, help="std of the token-structure logit term")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot", default=None, help="write max/mean vs step to this PNG")
    parser.add_argument("--real-training", action="store_true", help="also compare inside kimik3's trainer")
    parser.add_argument("--real-steps", type=int, default=60)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    policies = tuple(p.strip() for p in args.policies.split(","))
    for policy in policies:
        if policy not in POLICIES:
            parser.error(f"--policies: {policy!r} is not one of {POLICIES}")
    if args.steps is None:
        args.steps = 300 if device.type == "cuda" else 200
    if args.steps <= args.last:
        parser.error(f"--steps ({args.steps}) must exceed --last ({args.last})")
    settings = args.settings or (
        [Setting(64, 4, 262144), Setting(256, 8, 524288), Setting(896, 16, 1048576)] if device.type == "cuda"
        else [Setting(64, 4, 65536)])

    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {args.steps} steps, skew {args.skew}, drift {args.drift}/step, "
          f"rank {args.rank} x {args.structure}, gamma {args.gamma}, {args.num_bins} bins, seed {args.seed}")
    results: dict[Setting, dict[str, list[float]]] = {}
    rows = []
    started_all = time.perf_counter()
    for setting in settings:
        stream = Stream.build(setting.num_experts, skew=args.skew, drift=args.drift, rank=args.rank,
                              structure=args.structure, seed=args.seed, device=device)
        started = time.perf_counter()
        results[setting] = {p: simulate(p, setting, stream, steps=args.steps, num_bins=args.num_bins,
                                        gamma=args.gamma) for p in policies}
        floor = sampling_floor(setting, stream, args.steps - 1)
        rows.append((setting, floor, time.perf_counter() - started))

    print(f"\nsteps to max/mean <= {args.target} from bias 0 (\"> N\": never in N steps); "
          f"max/mean averaged over the last {args.last} steps")
    header = "| setting | max/mean at step 0 | " + " | ".join(f"{POLICY_LABELS[p]}: steps" for p in policies) + \
             " | " + " | ".join(f"{POLICY_LABELS[p]}: last {args.last}" for p in policies) + " | floor | s |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for setting, floor, seconds in rows:
        by_policy = results[setting]
        first = next(iter(by_policy.values()))[0]
        reached = []
        for p in policies:
            s = steps_to(by_policy[p], args.target)
            reached.append(str(s) if s is not None else f"> {args.steps - 1}")
        tails = [sum(by_policy[p][-args.last:]) / args.last for p in policies]
        print(f"| {setting} | {first:.2f} | " + " | ".join(reached) + " | " +
              " | ".join(f"{t:.3f}" for t in tails) + f" | {floor:.3f} | {seconds:.0f} |")
    print(f"total {time.perf_counter() - started_all:.0f} s")

    if args.plot:
        plot(results, args.plot, args.target)
    if args.real_training:
        real_training_comparison(args.real_steps, target=args.target)
    else:
        print("(real-training comparison: add --real-training; it runs kimik3.train.trainer once per policy)")


if __name__ == "__main__":
    main()
