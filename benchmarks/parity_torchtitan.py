"""Logit parity of our K3 against torchtitan's Kimi K3 port with the same weights (issue 40), in two directions:

  port-to-ours  the port's ``debugmodel`` with its own random init (``torchtitan_port.build_port``: its config's
                ``param_init`` through ``init_states``, seeded; ``--port-init``), the tensors that init leaves at
                constants perturbed (``perturb_port``: every RMSNorm weight x (1 + 0.1 N), KDA dt_bias 0.5 N, the
                MoE expert-bias buffer 0.02 N; the AttnRes projections are already random), loaded into
                ``K3ForCausalLM`` through ``kimik3.interop.from_torchtitan`` (``torchtitan_port.load_port_into_ours``,
                strict: a port tensor the adapter cannot map is an error naming it; our MTP module, which the port
                lacks, keeps its own weights and does not enter the logits). KL(port || ours).
  ours-to-port  ``K3ForCausalLM(config, seed=0)`` with the parameters a fresh model holds at constants perturbed
                (norm weights, AttnRes queries, dt_bias, the router bias: see ``perturb``), loaded into the port
                (``torchtitan_port.load_ours_into_port``, strict). KL(ours || port).

Both directions share one model of each side: each is built once; a direction restores its source's weights
(kept from the start, fp32) and copies them into the other side. Before the perturbation the port's init is
checked (``torchtitan_port.check_port_init``: the constants its config names at their values, every other
tensor finite and not constant); after it no tensor of more than one element may be constant.

Per position: KL(source || target), top-1 agreement, |logit difference|; per (position, MoE layer): whether the
two chose the same experts, and the port's top-k margin (k-th minus (k+1)-th biased score) so that flips at
near-ties can be told from real differences. Targets (issue 40): mean KL <= 1e-5 and top-1 >= 99.9%.

Variants, for each dtype (fp32 first, then both models cast to bf16 and the weights reloaded from the fp32
source) and each direction:
  port            the port as it is: its routed experts compute in bf16 even in an fp32 model
  fp32-experts    (fp32 only, --fp32-experts) the port's experts in fp32 (torchtitan_port.use_fp32_experts)
  forced-routing  (--force-routing) the port uses the expert ids our model chose, with its own scores
  bound: ours fp32  (dtypes other than fp32) not the port: our model computing in fp32 against itself in the dtype,
                  both with the dtype's rounded weights (``run_bound``): the scale that dtype's rounding alone gives
``--reference-kda``: both sides' KDA in torch (ours KIMIK3_KDA_BACKEND=torch, the port a token loop), to separate
the kernels' rounding from the rest (the default off CUDA). The port has no MTP module: logits only.

Timings: every phase (import, builds, init checks, casts, loads, each variant with its first sequence, which
carries the compile and autotune warm-up, apart) is printed as it ends and kept in the JSON's ``timings``.
``--time-budget S`` skips a variant that would end past S seconds from the start (estimated from the variants
so far: a dtype's first variant compiles and autotunes, later ones do not) and records it under ``skipped``;
the JSON is rewritten after every variant, so a call cut short keeps what finished.

GPU machine (carry .whl and third_party; see benchmarks/setup_torchtitan.sh):
  python -m pip install --no-index --no-deps .whl/*.whl
  python benchmarks/parity_torchtitan.py --fp32-experts --force-routing --port-init device --compile eager \\
      --time-budget 540 --json $OUT/parity_torchtitan.json
(about 6.5 min for fp32, most of it fla's autotuning at IEEE fp32; the bf16 pass about 2 min more)
The bound alone, without torchtitan (any machine; on a CPU our torch KDA path):
  python benchmarks/parity_torchtitan.py --bound-only --dtypes bfloat16 --device cpu
CPU smoke check (a small config, eager FlexAttention, the torch KDA on both sides):
  OMP_NUM_THREADS=1 python benchmarks/parity_torchtitan.py --config small --seqs 1 --seq-len 64 --device cpu \\
      --dtypes float32 --fp32-experts
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchtitan_port as tp  # noqa: E402
from kimik3 import K3Config, K3ForCausalLM  # noqa: E402

TARGET_KL = 1e-5
TARGET_TOP1 = 0.999
MARGINS = (1e-6, 1e-5, 1e-4, 1e-3)

SMALL = dict(name="small", vocab_size=512, dim=128, num_layers=7, max_seq_len=1024, dense_hidden=256,
             kda=dict(num_heads=4, head_dim=32, conv_kernel=4, gate_rank=32),
             mla=dict(num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                      v_head_dim=32),
             moe=dict(num_experts=8, top_k=2, latent_dim=64, expert_hidden=48, num_shared_experts=2,
                      shared_hidden=48),
             attn_res=dict(enabled=True, block_size=3), mtp=dict(num_modules=1), mla_layers=[3, 6])


def perturb(model: K3ForCausalLM, seed: int) -> None:
    """Move the parameters a fresh model holds at constants off them, so the comparison sees what they do: norm
    weights x (1 + 0.1 N), AttnRes queries N / sqrt(D), dt_bias 0.5 N, router bias 0.02 N (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed + 1)
    dim = model.config.dim
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name, tensor in sorted(tensors.items()):
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(tensor.shape, generator=gen).to(tensor.device, torch.float32)
            if name.endswith("norm.weight") or leaf.endswith("norm_weight"):
                value = tensor.float() * (1 + 0.1 * noise)
            elif leaf == "query":
                value = noise / math.sqrt(dim)
            elif leaf == "dt_bias":
                value = 0.5 * noise
            elif leaf == "expert_bias":
                value = 0.02 * noise
            else:
                continue
            tensor.copy_(value.to(tensor.dtype))


def perturb_port(model: torch.nn.Module, seed: int) -> list[str]:
    """Move the tensors the port's init holds at constants (``torchtitan_port.PORT_INIT_CONSTANTS``) off them, as
    ``perturb`` does ours: every RMSNorm weight (``*norm.weight``) x (1 + 0.1 N), KDA dt_bias 0.5 N, the MoE
    expert-bias buffer (``expert_bias_E``) 0.02 N (drawn on the CPU). Returns the names perturbed."""
    gen = torch.Generator().manual_seed(seed + 3)
    done = []
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            if tp.port_init_constant(name) is None:
                continue
            noise = torch.randn(tensor.shape, generator=gen).to(tensor.device, torch.float32)
            if name.endswith("norm.weight"):
                value = tensor.float() * (1 + 0.1 * noise)
            elif name.endswith("dt_bias"):
                value = 0.5 * noise
            else:
                value = 0.02 * noise
            tensor.copy_(value.to(tensor.dtype))
            done.append(name)
    return done


def our_routers(model: K3ForCausalLM) -> dict[int, torch.nn.Module]:
    return {index: layer.ffn.router for index, layer in enumerate(model.layers) if hasattr(layer.ffn, "router")}


def port_moes(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {int(key): layer.moe for key, layer in model.layers.items() if layer.moe is not None}


class RoutingProbe:
    """Records our routers' expert ids and the port routers' ids and top-k margins; optionally makes the port's
    routers use our ids (with the port's own scores for the weights)."""

    def __init__(self, ours: K3ForCausalLM, port: torch.nn.Module | None = None):
        self.ours: dict[int, torch.Tensor] = {}
        self.port: dict[int, torch.Tensor] = {}
        self.margin: dict[int, torch.Tensor] = {}
        self.force = False
        self.handles = []
        for index, router in our_routers(ours).items():
            self.handles.append(router.register_forward_hook(self._ours_hook(index)))
        for index, moe in (port_moes(port) if port is not None else {}).items():
            self.handles.append(moe.router.register_forward_hook(self._port_hook(index, moe)))
            original = moe.router.forward
            moe.router.forward = self._port_forward(index, moe.router, original)

    def _ours_hook(self, index: int):
        def hook(module, args, output):
            self.ours[index] = output[1].detach()
        return hook

    def _port_hook(self, index: int, moe: torch.nn.Module):
        def hook(module, args, output):
            scores_TE = output[2].detach().float()
            biased = scores_TE + moe.expert_bias_E.float() if moe.expert_bias_E is not None else scores_TE
            top = biased.topk(min(module.top_k + 1, biased.shape[-1]), dim=-1).values
            self.margin[index] = (top[:, module.top_k - 1] - top[:, module.top_k] if top.shape[-1] > module.top_k
                                  else torch.full_like(top[:, 0], float("inf")))
            self.port[index] = output[1].detach()
        return hook

    def _port_forward(self, index: int, router: torch.nn.Module, original):
        def forward(x_TD, expert_bias_E=None):
            weights, ids, scores_TE = original(x_TD, expert_bias_E)
            if not self.force:
                return weights, ids, scores_TE
            ids = self.ours[index].to(ids.dtype).contiguous()
            weights = scores_TE.gather(-1, ids)
            if router.route_norm:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return weights * router.route_scale, ids, scores_TE
        return forward

    def compare(self) -> dict[str, torch.Tensor]:
        """Per position: how many MoE layers chose a different expert set, and the smallest port margin."""
        layers = sorted(self.port)
        differ = torch.stack([(self.ours[i].sort(-1).values != self.port[i].sort(-1).values).any(-1)
                              for i in layers])
        margin = torch.stack([self.margin[i] for i in layers]).min(0).values
        return {"layers_differ_T": differ.sum(0), "min_margin_T": margin}


DIRECTIONS = ("port-to-ours", "ours-to-port")
# per direction: whose weights both sides carry (the KL's reference distribution)
SOURCE = {"port-to-ours": "port", "ours-to-port": "ours"}


def kl_per_position(ref_TV: torch.Tensor, other_TV: torch.Tensor) -> torch.Tensor:
    """KL(ref || other) per position, computed in float64 (in fp32 its rounding is ~1e-7, near the figures measured)."""
    log_p = F.log_softmax(ref_TV.double(), -1)
    log_q = F.log_softmax(other_TV.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def run_variant(ours: K3ForCausalLM, port: torch.nn.Module, probe: RoutingProbe, sequences: list[torch.Tensor],
                force: bool, source: str = "ours") -> dict[str, Any]:
    """Compare the two models on ``sequences``; ``source`` ("ours" or "port", whose weights both carry) is the
    reference of the KL and of the near-tie test."""
    kl, top1, near_tie, max_diff, mean_diff, differ, margin = [], [], [], [], [], [], []
    start = time.perf_counter()
    first_seq_seconds = None
    with torch.no_grad():
        for tokens_T in sequences:
            ours_TV = ours(tokens_T[None]).logits[0]
            probe.force = force
            try:
                port_TV = tp.port_logits(port, tokens_T)
            finally:
                probe.force = False
            ref_TV, other_TV = (ours_TV, port_TV) if source == "ours" else (port_TV, ours_TV)
            diff = (ref_TV.float() - other_TV.float()).abs()
            kl.append(kl_per_position(ref_TV, other_TV))
            top1.append(ref_TV.argmax(-1) == other_TV.argmax(-1))
            top2 = ref_TV.float().topk(2, dim=-1).values
            near_tie.append(top2[:, 0] - top2[:, 1] <= 2 * diff.max(-1).values)
            max_diff.append(diff.max())
            mean_diff.append(diff.mean())
            routing = probe.compare()
            differ.append(routing["layers_differ_T"])
            margin.append(routing["min_margin_T"])
            if first_seq_seconds is None:
                first_seq_seconds = round(time.perf_counter() - start, 2)   # includes compile / autotune warm-up
    kl_T, top1_T, near_tie_T = torch.cat(kl), torch.cat(top1).float(), torch.cat(near_tie)
    differ_T, margin_T = torch.cat(differ), torch.cat(margin)
    agree = differ_T == 0
    moe_layers = len(probe.port)
    result = {
        "kl": f"KL({source} || {'port' if source == 'ours' else 'ours'})",
        "positions": kl_T.numel(),
        "kl_mean": kl_T.mean().item(), "kl_max": kl_T.max().item(),
        "kl_median": kl_T.median().item(),
        "top1": top1_T.mean().item(),
        # random weights give near-uniform logits: a flip where the reference's top-1 leads by less than twice the
        # position's largest |logit difference| is a near-tie, not a disagreement about the prediction
        "top1_flips": int((top1_T == 0).sum()),
        "top1_flips_at_near_ties": int(((top1_T == 0) & near_tie_T).sum()),
        "max_abs_logit_diff": torch.stack(max_diff).max().item(),
        "mean_abs_logit_diff": torch.stack(mean_diff).mean().item(),
        "routing_choices_differ_frac": (differ_T.sum() / (differ_T.numel() * max(moe_layers, 1))).item(),
        "positions_routing_differs": int((~agree).sum()),
        "kl_mean_where_routing_agrees": kl_T[agree].mean().item() if agree.any() else None,
        "top1_where_routing_agrees": top1_T[agree].mean().item() if agree.any() else None,
        "positions_min_margin_below": {f"{m:g}": int((margin_T < m).sum()) for m in MARGINS},
        "seconds": round(time.perf_counter() - start, 2),
        "first_seq_seconds": first_seq_seconds,
    }
    result["pass"] = result["kl_mean"] <= TARGET_KL and result["top1"] >= TARGET_TOP1
    return result


def run_bound(ours: K3ForCausalLM, probe: RoutingProbe, sequences: list[torch.Tensor]) -> dict[str, Any]:
    """How far the pass's dtype alone moves our logits: KL(ours computing in fp32 || ours in the dtype), both with
    the dtype's (rounded) weights, routing free on each side. A cross-implementation figure in that dtype is held
    to this scale: two implementations that each round differently cannot be expected to agree more closely than
    either agrees with its own fp32 computation."""
    dtype = ours.dtype
    low, high, low_ids, high_ids = [], [], [], []
    with torch.no_grad():
        for tokens_T in sequences:
            low.append(ours(tokens_T[None]).logits[0])
            low_ids.append({i: ids.sort(-1).values for i, ids in probe.ours.items()})
        ours.cast(torch.float32)
        try:
            for tokens_T in sequences:
                high.append(ours(tokens_T[None]).logits[0])
                high_ids.append({i: ids.sort(-1).values for i, ids in probe.ours.items()})
        finally:
            ours.cast(dtype)
    kl_T = torch.cat([kl_per_position(h, lo) for h, lo in zip(high, low)])
    top1_T = torch.cat([h.argmax(-1) == lo.argmax(-1) for h, lo in zip(high, low)]).float()
    differ_T = torch.cat([torch.stack([(hi[i] != lo[i]).any(-1) for i in sorted(hi)]).sum(0)
                          for hi, lo in zip(high_ids, low_ids)])
    agree = differ_T == 0
    return {"kl": f"KL(ours fp32 || ours {str(dtype).removeprefix('torch.')})", "positions": kl_T.numel(),
            "kl_mean": kl_T.mean().item(), "kl_max": kl_T.max().item(), "kl_median": kl_T.median().item(),
            "top1": top1_T.mean().item(), "top1_flips": int((top1_T == 0).sum()),
            "max_abs_logit_diff": max((h - lo.float()).abs().max().item() for h, lo in zip(high, low)),
            "routing_choices_differ_frac": (differ_T.sum() / (differ_T.numel() * max(len(probe.ours), 1))).item(),
            "positions_routing_differs": int((~agree).sum()),
            "kl_mean_where_routing_agrees": kl_T[agree].mean().item() if agree.any() else None,
            "top1_where_routing_agrees": top1_T[agree].mean().item() if agree.any() else None,
            "pass": None}


def make_sequences(config: K3Config, args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(args.seed + 2)
    return [torch.randint(0, config.vocab_size, (args.seq_len,), generator=gen).to(device) for _ in range(args.seqs)]


def bound_only(config: K3Config, dtypes: list[torch.dtype], device: torch.device, args: argparse.Namespace) -> None:
    """``--bound-only``: the bound rows without the port (nothing of torchtitan is imported): our init, perturbed as
    for ours-to-port, on the same sequences, each dtype but fp32 against fp32."""
    ours = K3ForCausalLM(config, device=device, dtype=torch.float32, seed=args.seed).eval()
    if not args.no_perturb:
        perturb(ours, args.seed)
    source = snapshot(ours)
    probe = RoutingProbe(ours)
    sequences = make_sequences(config, args, device)
    results = []
    for dtype in dtypes:
        if dtype == torch.float32:
            continue
        ours.cast(dtype)
        ours.load_state_dict(source)
        start = time.perf_counter()
        results.append({"direction": "ours", "dtype": str(dtype).removeprefix("torch."), "variant": "bound: ours fp32",
                        **run_bound(ours, probe, sequences), "seconds": round(time.perf_counter() - start, 2)})
        print(json.dumps(results[-1]), flush=True)
    print(format_table(results), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": config.name, "device": str(device), "torch": torch.__version__,
                                         "seqs": args.seqs, "seq_len": args.seq_len, "seed": args.seed,
                                         "kda_backend": os.environ.get("KIMIK3_KDA_BACKEND", "default"),
                                         "results": results}, indent=2) + "\n")


class Phases:
    """Wall time of each phase since the previous mark, printed as it ends; ``elapsed`` counts from the start."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.timings: list[dict[str, Any]] = []

    def mark(self, name: str) -> float:
        now = time.perf_counter()
        seconds = now - self.last
        self.last = now
        self.timings.append({"phase": name, "seconds": round(seconds, 2), "at": round(now - self.start, 2)})
        print(f"[{now - self.start:7.1f}s] {name}: {seconds:.1f}s", flush=True)
        return seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s state dict, on its device, in fp32 where it is floating point (the source for every
    dtype: a bf16 pass rounds these values, as casting the fp32 model would)."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).clone()
            for k, v in model.state_dict().items()}


def format_table(results: list[dict[str, Any]]) -> str:
    head = ("direction", "dtype", "variant", "KL mean", "KL max", "top-1", "routing differ", "KL | routing agrees",
            "pass")
    rows = [head]
    for r in results:
        agree = r["kl_mean_where_routing_agrees"]
        rows.append((r["direction"], r["dtype"], r["variant"], f"{r['kl_mean']:.2e}", f"{r['kl_max']:.2e}",
                     f"{r['top1']:.4f}", f"{r['routing_choices_differ_frac']:.2%}",
                     "-" if agree is None else f"{agree:.2e}", {True: "yes", False: "no", None: "-"}[r["pass"]]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def main() -> None:
    phases = Phases()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="debug", choices=["debug", "small"],
                        help="our preset 'debug' (= the port's debugmodel) or a small one for CPU smoke checks")
    parser.add_argument("--direction", default="both", choices=["ours-to-port", "port-to-ours", "both"],
                        help="whose random init both sides carry (both: port-to-ours, then ours-to-port, per dtype)")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", default=None, choices=["fast", "autotune", "eager"],
                        help="the port's FlexAttention compile (default: fast on CUDA, eager on CPU)")
    parser.add_argument("--fp32-experts", action="store_true", help="add the port with fp32 experts (fp32 pass)")
    parser.add_argument("--force-routing", action="store_true", help="add the port forced to our expert choices")
    parser.add_argument("--reference-kda", action="store_true",
                        help="torch KDA on both sides (default on CPU, where fla's kernels cannot run)")
    parser.add_argument("--no-perturb", action="store_true", help="compare the fresh inits as they are")
    parser.add_argument("--port-init", default="cpu", choices=["cpu", "device"],
                        help="where the port initialises its weights and buffers (RoPE table): on the CPU and then "
                             "moved, as its numerical test does (default; ~50 s for the debugmodel, the CPU RNG is "
                             "serial), or on --device, as torchtitan's trainer does (seconds on a GPU; other values "
                             "for the same seed, its RoPE table computed there)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds from the start: skip a variant expected to end past it (the JSON keeps what "
                             "ran and lists what was skipped)")
    parser.add_argument("--bound-only", action="store_true",
                        help="only the bound rows (ours in fp32 against ours in each other dtype), no port")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    directions = list(DIRECTIONS) if args.direction == "both" else [args.direction]

    device = torch.device(args.device)
    reference_kda = args.reference_kda or device.type != "cuda"
    if reference_kda:
        os.environ["KIMIK3_KDA_BACKEND"] = "torch"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # fla's KDA kernels call tl.dot without a precision, which Triton runs at TF32 for fp32 operands: the port's
    # "fp32" KDA would carry ~1e-3 relative error. IEEE fp32 makes the fp32 pass fp32 on both sides (ours passes
    # its precision explicitly: tf32x3); 16-bit operands are unaffected.
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    config = K3Config.preset("debug") if args.config == "debug" else K3Config.from_dict(dict(SMALL))
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    if args.bound_only:
        bound_only(config, dtypes, device, args)
        return
    compile_mode = args.compile or ("fast" if device.type == "cuda" else "eager")
    port_ns = tp.import_port(compile_mode=compile_mode)
    phases.mark("import the port")
    ours = K3ForCausalLM(config, device=device, dtype=dtypes[0], seed=args.seed).eval()
    phases.mark(f"build ours ({config.name}, {str(dtypes[0]).removeprefix('torch.')})")
    sources: dict[str, dict[str, torch.Tensor]] = {}
    port_perturbed: list[str] = []
    if "ours-to-port" in directions:
        if not args.no_perturb:
            perturb(ours, args.seed)
            phases.mark("perturb ours")
        sources["ours"] = snapshot(ours)
    port = tp.build_port(device, dtypes[0], args.seed, our_config=None if args.config == "debug" else config,
                         init_on_device=args.port_init == "device").eval()
    phases.mark(f"build the port (its own init on {device.type if args.port_init == 'device' else 'the CPU'})")
    if "port-to-ours" in directions:
        tp.check_port_init(port)
        if not args.no_perturb:
            port_perturbed = perturb_port(port, args.seed)
            still = tp.constant_tensors(port)
            if still:
                raise RuntimeError(f"port tensors still constant after perturb_port: {still}")
        sources["port"] = snapshot(port)
        phases.mark("check and perturb the port's init")
    if reference_kda:
        tp.use_reference_kda(port)
    print(f"port {port_ns.commit[:12]}, {config.name}, {sum(p.numel() for p in port.parameters()):,} port "
          f"parameters; directions {', '.join(directions)}", flush=True)
    probe = RoutingProbe(ours, port)
    sequences = make_sequences(config, args, device)

    report = {"port_commit": port_ns.commit, "config": config.name, "device": str(device),
              "torch": torch.__version__, "seqs": args.seqs, "seq_len": args.seq_len, "seed": args.seed,
              "perturbed": not args.no_perturb, "reference_kda": reference_kda,
              "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"), "compile": compile_mode,
              "time_budget": args.time_budget, "port_init": args.port_init,
              "targets": {"kl_mean_max": TARGET_KL, "top1_min": TARGET_TOP1},
              "notes": "KL(source || target) per position, the source being the side whose init both carry; the "
                       "port has no MTP; its routed experts are bf16 in the 'port' variant even for fp32",
              "directions": {
                  "port-to-ours": {"weights": "the port's own init (torchtitan_port.build_port), loaded into ours "
                                              "with from_torchtitan", "kl": "KL(port || ours)",
                                   "perturbed": port_perturbed, "results": []},
                  "ours-to-port": {"weights": "our init (K3ForCausalLM seed), loaded into the port with "
                                              "to_torchtitan", "kl": "KL(ours || port)", "results": []}},
              "skipped": [], "timings": phases.timings}
    report["directions"] = {d: report["directions"][d] for d in directions}

    def write() -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(args.json.suffix + ".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(args.json)

    results: list[dict[str, Any]] = []

    def keep(result: dict[str, Any]) -> None:
        """A finished row: in the table, the report under its direction, printed, and the JSON rewritten."""
        results.append(result)
        report["directions"][result["direction"]]["results"].append(result)
        print(json.dumps(result), flush=True)
        write()
    # expected seconds of the next variant: a dtype's first one compiles and autotunes (cold), later ones do not
    cold, warm = 0.0, 0.0

    def over_budget(dtype_warm: bool) -> bool:
        expected = warm if dtype_warm else max(cold, warm)
        return args.time_budget is not None and phases.elapsed() + expected > args.time_budget

    for dtype in dtypes:
        dtype_warm = False
        dtype_name = str(dtype).removeprefix("torch.")
        if dtype != ours.dtype:
            ours.cast(dtype)
            tp.cast_port(port, dtype)
            phases.mark(f"cast both to {dtype_name}")
        variants = [("port", False, False)]
        if args.fp32_experts and dtype == torch.float32:
            variants.append(("fp32-experts", True, False))
        if args.force_routing:
            variants.append(("forced-routing", False, True))
        for direction in directions:
            if over_budget(dtype_warm):
                report["skipped"] += [f"{direction} {dtype_name} {name}" for name, _, _ in variants]
                print(f"time budget: skipping {direction} {dtype_name}", flush=True)
                write()
                continue
            if direction == "port-to-ours":
                port.load_state_dict(sources["port"])
                tp.load_port_into_ours(ours, port)
            else:
                ours.load_state_dict(sources["ours"])
                tp.load_ours_into_port(port, ours)
            phases.mark(f"{dtype_name} {direction}: load the weights")
            for name, fp32_experts, force in variants:
                if over_budget(dtype_warm):
                    report["skipped"].append(f"{direction} {dtype_name} {name}")
                    print(f"time budget: skipping {direction} {dtype_name} {name}", flush=True)
                    continue
                if fp32_experts:
                    tp.use_fp32_experts(port)
                try:
                    result = {"direction": direction, "dtype": dtype_name, "variant": name,
                              **run_variant(ours, port, probe, sequences, force, SOURCE[direction])}
                finally:
                    if fp32_experts:
                        tp.use_fp32_experts(port, enable=False)
                seconds = phases.mark(f"{dtype_name} {direction} {name} (first sequence "
                                      f"{result['first_seq_seconds']}s)")
                if dtype_warm:
                    warm = max(warm, seconds)
                else:
                    cold = max(cold, seconds)
                    later = result["seconds"] - result["first_seq_seconds"]
                    warm = max(warm, later * len(sequences) / (len(sequences) - 1) if len(sequences) > 1 else 0.0)
                    dtype_warm = True
                keep(result)
            if dtype != torch.float32:
                bound = {"direction": direction, "dtype": dtype_name, "variant": "bound: ours fp32",
                         **run_bound(ours, probe, sequences)}
                phases.mark(f"{dtype_name} {direction}: ours in fp32 against ours in {dtype_name}")
                keep(bound)

    print(format_table(results), flush=True)
    if report["skipped"]:
        print(f"skipped (time budget): {', '.join(report['skipped'])}", flush=True)
    report["total_seconds"] = round(phases.elapsed(), 2)
    write()
    if args.json is not None:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
