"""K3 at full width, one layer at a time: the decode-step time (one new token per sequence) of each kind of layer on
one GPU, next to the memory floor of the bytes that step must read, and the 93-layer decode estimate they add up to
(issue: serve K3 near the memory floor). Method, modelling and formulas: docs/engine.md, "K3 at full width: a
per-layer decode estimate".

Each module is built alone on the meta device (never the whole model), materialised on the device with
``to_empty``, initialised by ``kimik3.model.init.init_weights`` and held in bf16, with KDA's ``A_log`` / ``dt_bias``
kept fp32 as ``K3ForCausalLM.cast`` keeps them. Rows, at each per-GPU batch B of ``--batches``:

  kda    ``KDA.forward(x [B, 1, D], state)`` on a pooled ``KDAState`` built by ``StatePool.gather`` (the conv inputs
         gathered before and scattered after, as the engine's step does): the batched one-token Triton kernel.
  mla    ``GatedMLA(x [B, 1, D], view)``, ``view = LatentPool(...).view(0, tables, lengths)`` holding ``--context``
         tokens per row in ``--block-size``-token physical blocks: the call the engine makes (one token: the view's
         ``decode_absorbed``, the paged Triton kernel ``kimik3.ops.mla.paged_mla_decode`` on CUDA).
  moe    what one GPU of a ``--gpus``-way MoonEP group computes in one MoE layer. The GPU's own B tokens go through
         the real router (all E experts, top-K) and W_down; the rows of the node's G*B tokens that land on its
         E/G experts arrive (K/G rows per token on average: 896/8 = 112 experts, 16/8 = 2 rows in K3), modelled
         by the routed experts of a config copy with E/G experts and top-K/G on G*B latent rows with uniform
         random distinct ids; then W_up and the 2 shared experts at full width on the own B tokens. The
         dispatch and combine all-to-alls are not run here: the estimate adds a stated model of them. With B = 1
         an extra row, "1 stream", has one token on the whole node (K/G rows arrive per GPU).
  dense  the dense SiTU-GLU FFN of layer 0.
  glue   per layer, K3Block's bookkeeping: two AttnRes mixes over the mean number of entries, two RMSNorms, two
         residual adds.
  head   the final AttnRes mix, final RMSNorm and output head (logits [B, V]).

Timing on CUDA: a warm-up on a side stream, then the step is captured as a CUDA graph (static inputs) and its
replays are timed one by one with CUDA events, the L2 cache overwritten before each (every layer of a real step
finds its weights cold), median of ``--iters``. Before capturing, the step runs once under
``torch.cuda.set_sync_debug_mode("error")``: a host synchronisation inside it (``int(tensor)``, ``.item()``,
``.tolist()``, CUDA ``torch.bincount``, boolean-mask indexing) is reported with the kimik3 line that made it, and
that row (like any row whose capture fails) is timed eagerly and says so. On CPU (``--device cpu --scale tiny``,
the smoke test) every row is eager, timed with ``time.perf_counter``.

Floor: the bytes the step must read or write (weights touched at that batch: for the MoE only the experts the
rows hit, plus the router, the latent projections and the shared experts; KDA recurrent state read + write and
conv inputs; MLA latents read), divided by ``--hbm-tbps`` (4.2 TB/s: the H200 copy ceiling measured in this
project was 4.19-4.27 TB/s). Ratio = measured / floor.

    python benchmarks/serve_k3_layers.py --json k3_layers.json                   # one H200: K3, B 1 and 64
    python benchmarks/serve_k3_layers.py --batches 1,16,64 --context 32768 --json out.json
    python benchmarks/serve_k3_layers.py --device cpu --scale tiny --gpus 2 --batches 1,4 --context 64 \\
        --block-size 16 --iters 3 --json /tmp/tiny.json                          # the smoke test's run
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kimik3.config.params import param_counts  # noqa: E402
from kimik3.config.schema import K3Config  # noqa: E402
from kimik3.model.attnres import AttnResMix  # noqa: E402
from kimik3.model.ffn import GLUFeedForward  # noqa: E402
from kimik3.model.init import init_weights  # noqa: E402
from kimik3.model.k3 import FP32_PARAMS  # noqa: E402
from kimik3.model.kda import KDA  # noqa: E402
from kimik3.model.mla import GatedMLA  # noqa: E402
from kimik3.model.moe import LatentMoE, Router  # noqa: E402
from kimik3.model.norm import RMSNorm  # noqa: E402
from kimik3.serve.paged_cache import LatentPool, StatePool  # noqa: E402

KINDS = ("kda", "mla", "moe", "dense", "glue", "head")
# Bytes per parameter of the weight formats in the memory arithmetic. MX formats: one 8-bit scale per 32 values.
FORMAT_BYTES = {"bf16": 2.0, "fp8": 33 / 32, "int4": 17 / 32}
# (routed experts, everything else): the layouts the memory arithmetic checks.
WEIGHT_SCHEMES = (("bf16", "bf16"), ("fp8", "fp8"), ("int4", "bf16"), ("int4", "fp8"), ("int4", "int4"))


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------- building modules
def materialise(make, config: K3Config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``make()`` built on the meta device, cast like ``K3ForCausalLM.cast`` (FP32_PARAMS stay fp32, buffers keep
    their dtype), allocated on ``device`` with ``to_empty`` and filled by ``init_weights``; eval, no grads."""
    with torch.device("meta"):
        module = make()
    for name, param in module.named_parameters():
        keep = name.rsplit(".", 1)[-1] in FP32_PARAMS
        param.data = param.data.to(torch.float32 if keep else dtype)
    module.to_empty(device=device)
    init_weights(module, config)
    return module.eval().requires_grad_(False)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(*modules: nn.Module | None) -> int:
    """Every parameter and buffer of ``modules`` (each read once by a step that uses the module)."""
    return sum(nbytes(*m.parameters(), *m.buffers()) for m in modules if m is not None)


def shard_config(config: K3Config, gpus: int) -> K3Config:
    """The MoE as one GPU of a ``gpus``-way expert-parallel group holds it: E/G experts, K/G rows per token."""
    m = config.moe
    if m.num_experts % gpus or m.top_k % gpus:
        raise ValueError(f"--gpus {gpus} must divide the experts ({m.num_experts}) and top-k ({m.top_k})")
    return dataclasses.replace(config, moe=dataclasses.replace(m, num_experts=m.num_experts // gpus,
                                                               top_k=m.top_k // gpus))


class MoEShard(nn.Module):
    """One GPU's part of a LatentMoE layer under MoonEP, without the exchanges: the real router and W_down on the
    own tokens, the local routed experts on the rows that arrive, W_up and the shared experts on the own tokens."""

    def __init__(self, config: K3Config, gpus: int):
        super().__init__()
        m = config.moe
        self.router = Router(config.dim, m.num_experts, m.top_k, m.route_scale)   # all E experts, as released
        self.local = LatentMoE(shard_config(config, gpus))    # E/G experts; its own router is not used

    def forward(self, x_TD: torch.Tensor, weights_NK: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
        local = self.local
        self.router(x_TD)                       # the own tokens' routing (what the dispatch would be planned from)
        latent_TL = local.routed_down(x_TD)
        # Dispatch (modelled, not run): the rows of the node's N tokens for this GPU's experts arrive.
        arrived_NL = latent_TL.repeat(ids_NK.shape[0] // x_TD.shape[0], 1)
        y_NL = local.experts(arrived_NL, weights_NK, ids_NK)
        # Combine (modelled): each own token's rows come back, summed.
        routed_TL = y_NL[: x_TD.shape[0]]
        out_TD = local.routed_up(local.routed_norm(routed_TL))
        return out_TD + local.shared(x_TD) if local.shared is not None else out_TD


class BlockGlue(nn.Module):
    """K3Block's per-layer work around its mixer and FFN: AttnRes mixes, pre-norms, residual adds."""

    def __init__(self, config: K3Config):
        super().__init__()
        attn_res, d, eps = config.attn_res.enabled, config.dim, config.norm_eps
        self.mixer_mix = AttnResMix(d, eps) if attn_res else None
        self.ffn_mix = AttnResMix(d, eps) if attn_res else None
        self.mixer_norm = RMSNorm(d, eps)
        self.ffn_norm = RMSNorm(d, eps)

    def forward(self, entries, prefix, mixer_out, ffn_out):
        x = self.mixer_mix(entries + [prefix]) if self.mixer_mix is not None else prefix
        mixer_in = self.mixer_norm(x)
        prefix = prefix + mixer_out
        mixed = self.ffn_mix(entries + [prefix]) if self.ffn_mix is not None else prefix
        return mixer_in, self.ffn_norm(mixed), prefix + ffn_out


class Head(nn.Module):
    """The end of the stack: final AttnRes mix, final norm, output head (``lm_head``: init_weights' head rule)."""

    def __init__(self, config: K3Config):
        super().__init__()
        self.final_mix = AttnResMix(config.dim, config.norm_eps) if config.attn_res.enabled else None
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, entries):
        hidden = self.final_mix(entries) if self.final_mix is not None else entries[-1]
        return self.lm_head(self.norm(hidden))


def glue_entries(config: K3Config) -> int:
    """Entries an AttnRes mix stacks, averaged over the layers: the embedding, one summary per completed block,
    the running prefix (``attn_res_block + 2``)."""
    plan = config.layer_plan()
    return max(1, round(sum(spec.attn_res_block + 2 for spec in plan) / len(plan)))


def layer_counts(config: K3Config) -> dict[str, int]:
    plan = config.layer_plan()
    return {"layers": len(plan), "kda": sum(s.mixer == "kda" for s in plan), "mla": sum(s.mixer == "mla" for s in plan),
            "dense": sum(s.ffn == "dense" for s in plan), "moe": sum(s.ffn == "moe" for s in plan)}


# ---------------------------------------------------------------------------------------------- timing
def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def where(err: BaseException) -> str:
    """The innermost kimik3 frame of ``err``'s traceback, as ``path:line (code)``."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f"{os.sep}kimik3{os.sep}" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    path = f.filename[f.filename.rfind(f"kimik3{os.sep}"):]
    return f"{path}:{f.lineno} ({(f.line or '').strip()})"


def host_sync(fn) -> str:
    """Run ``fn`` once with synchronising CUDA calls turned into errors: "" if none, else what and where."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        return f"host sync at {where(err) or '?'}: {first_line(err)}"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
    return ""


def time_step(fn, device: torch.device, warmup: int, iters: int, graph: bool, flush: torch.Tensor | None):
    """Median microseconds of one ``fn()`` step, how it ran ("graph" / "eager") and why not as a graph ("")."""
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times), "eager", "not CUDA: eager wall-clock timing"

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):     # compiles, autotunes and lazy inits happen here, outside the capture
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    captured, why = None, "--eager" if not graph else host_sync(fn)
    if not why:
        captured = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(captured):
                fn()
            captured.replay()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - any capture failure: time it eagerly and say why
            captured, why = None, f"capture failed at {where(err) or '?'}: {first_line(err)}"
            with contextlib.suppress(Exception):   # the failed capture's error may surface here again
                torch.cuda.synchronize()
    run = captured.replay if captured is not None else fn
    for _ in range(warmup):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    median = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    del captured
    return median, ("graph" if run is not fn else "eager"), why


# ---------------------------------------------------------------------------------------------- the cases
def kda_case(layer: KDA, config: K3Config, B: int, device, dtype, gen) -> tuple:
    one = dataclasses.replace(config, num_layers=1, mla_layers=[], trailing_mla=False,
                              dense_layers=min(config.dense_layers, 1))
    pool = StatePool(one, B, dtype, device)          # one KDA layer's pool, B slots
    pool.recurrent[0].normal_(0.0, 0.02, generator=gen)
    pool.conv[0].normal_(0.0, 1.0, generator=gen)
    slots = torch.randperm(B, device=device, generator=gen)
    x = torch.randn(B, 1, config.dim, device=device, generator=gen).to(dtype)

    def step():
        return layer(x, pool.view(slots)[0])

    heads, head_dim, width = config.kda.num_heads, config.kda_head_dim, config.kda.conv_kernel
    conv = B * 3 * heads * head_dim * (width - 1) * pool.conv[0].element_size()
    moved = {"weights": module_bytes(layer), "recurrent state read+write": 2 * B * heads * head_dim * head_dim * 4,
             "conv inputs read+write": 2 * conv, "activations": 2 * nbytes(x)}
    return step, moved, {}


def mla_case(layer: GatedMLA, config: K3Config, B: int, context: int, block_size: int, device, dtype, gen) -> tuple:
    width = config.mla.cache_width
    per_row = -(-(context + 1) // block_size)
    latents = LatentPool(1, B * per_row, block_size, width, dtype, device)
    latents.tensors[0].normal_(0.0, 1.0, generator=gen)
    tables = torch.randperm(B * per_row, device=device, generator=gen).view(B, per_row)
    lengths = torch.full((B,), context, dtype=torch.long, device=device)
    x = torch.randn(B, 1, config.dim, device=device, generator=gen).to(dtype)

    def step():
        return layer(x, latents.view(0, tables, lengths))

    el = latents.tensors[0].element_size()
    moved = {"weights": module_bytes(layer), "latents read": B * (context + 1) * width * el,
             "new latent write": B * width * el, "activations": 2 * nbytes(x)}
    return step, moved, {"context": context, "block_size": block_size}


def moe_case(shard: MoEShard, config: K3Config, B: int, node_tokens: int, device, dtype, gen) -> tuple:
    local = shard.local
    experts, top_k = local.router.num_experts, local.router.top_k
    x = torch.randn(B, config.dim, device=device, generator=gen).to(dtype)
    ids = torch.rand(node_tokens, experts, device=device, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(node_tokens, top_k, device=device, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)

    def step():
        return shard(x, weights, ids)

    m = config.moe
    el = local.experts.w_gate_ELF.element_size()
    per_expert = 3 * m.latent_dim * m.expert_hidden * el
    hit = int(torch.unique(ids).numel())
    rows = node_tokens * top_k
    moved = {"router": module_bytes(shard.router),
             "latent projections": module_bytes(local.routed_down, local.routed_up, local.routed_norm),
             "shared experts": module_bytes(local.shared),
             "experts hit": hit * per_expert,
             "activations": 2 * nbytes(x) + 2 * rows * m.latent_dim * el}
    info = {"node_tokens": node_tokens, "local_experts": experts, "rows": rows, "experts_hit": hit,
            "expert_bytes_all_local": nbytes(*local.experts.parameters())}
    return step, moved, info


def dense_case(ffn: GLUFeedForward, config: K3Config, B: int, device, dtype, gen) -> tuple:
    x = torch.randn(B, 1, config.dim, device=device, generator=gen).to(dtype)
    return (lambda: ffn(x)), {"weights": module_bytes(ffn), "activations": 2 * nbytes(x)}, {}


def glue_case(glue: BlockGlue, config: K3Config, B: int, device, dtype, gen) -> tuple:
    n = glue_entries(config)
    stream = [torch.randn(B, 1, config.dim, device=device, generator=gen).to(dtype) for _ in range(n + 2)]
    entries, prefix, mixer_out, ffn_out = stream[: n - 1], stream[n - 1], stream[n], stream[n + 1]

    def step():
        return glue(entries, prefix, mixer_out, ffn_out)

    # Two mixes read n entries each; the norms, adds and outputs touch a few more [B, D] rows.
    moved = {"weights": module_bytes(glue), "activations": (2 * n + 8) * nbytes(prefix)}
    return step, moved, {"entries": n}


def head_case(head: Head, config: K3Config, B: int, device, dtype, gen) -> tuple:
    n = config.num_attn_res_blocks + 1 if config.attn_res.enabled else 1
    entries = [torch.randn(B, 1, config.dim, device=device, generator=gen).to(dtype) for _ in range(n)]
    el = head.lm_head.weight.element_size()
    moved = {"weights": module_bytes(head), "logits write": B * config.vocab_size * el,
             "activations": n * nbytes(entries[0])}
    return (lambda: head(entries)), moved, {"entries": n}


# ---------------------------------------------------------------------------------------------- the estimate
def a2a_us(B: int, config: K3Config, gpus: int, latency_us: float, gbps: float, el: int = 2) -> float:
    """Modelled MoonEP dispatch + combine of one MoE layer for B own tokens per GPU: each is one all-to-all of
    the token-expert rows that leave the GPU (B * K * (G - 1) / G rows), a latent row in bf16 (+ its fp32 mixture
    weight on the way out), at ``gbps`` per direction, plus ``latency_us`` per all-to-all."""
    m = config.moe
    rows_out = B * m.top_k * (gpus - 1) / gpus
    dispatch = rows_out * (m.latent_dim * el + 4)
    combine = rows_out * m.latent_dim * el
    return 2 * latency_us + (dispatch + combine) / (gbps * 1e9) * 1e6


def find(rows: list[dict], layer: str, batch: int, node_tokens: int | None = None) -> dict | None:
    for row in rows:
        if (row["layer"] == layer and row["batch"] == batch and row.get("us") is not None
                and (node_tokens is None or row.get("node_tokens") == node_tokens)):
            return row
    return None


def step_estimate(rows: list[dict], config: K3Config, B: int, node_tokens: int, sequences: int, args) -> dict:
    """Per-GPU time of one decode step of the whole stack, from the measured rows (and, beside it, their floors)."""
    n = layer_counts(config)
    a2a = a2a_us(B, config, args.gpus, args.a2a_latency_us, args.a2a_gbps)
    terms = (("kda", "kda", None, n["kda"]), ("mla", "mla", None, n["mla"]), ("dense", "dense", None, n["dense"]),
             ("moe", "moe", node_tokens, n["moe"]), ("glue", "glue", None, n["layers"]), ("head", "head", None, 1))
    parts, floors, missing = {}, {}, []
    expert_floor_us = 0.0
    for name, layer, nt, count in terms:
        row = find(rows, layer, B, nt)
        if row is None:
            missing.append(name)
            continue
        parts[name] = count * row["us"]
        floors[name] = count * row["floor_us"]
        if layer == "moe":
            expert_floor_us = count * row["bytes"]["experts hit"] / (args.hbm_tbps * 1e12) * 1e6
    parts["all-to-all (modelled)"] = floors["all-to-all (modelled)"] = n["moe"] * a2a
    out = {"batch_per_gpu": B, "node_tokens_per_moe": node_tokens, "sequences_on_node": sequences,
           "missing": missing, "parts_us": parts, "floor_parts_us": floors, "a2a_us_per_moe_layer": a2a}
    if missing:
        return out
    step_us, floor_us = sum(parts.values()), sum(floors.values())
    # The same floor with MXFP4 expert weights (arithmetic only: no int4 kernel is measured here).
    mxfp4 = floor_us - expert_floor_us * (1 - FORMAT_BYTES["int4"] / FORMAT_BYTES["bf16"])
    out.update(step_ms=step_us / 1e3, ms_per_token=step_us / 1e3, tokens_per_s_node=sequences / (step_us * 1e-6),
               floor_step_ms=floor_us / 1e3, floor_tokens_per_s_node=sequences / (floor_us * 1e-6),
               floor_step_ms_mxfp4_experts=mxfp4 / 1e3, ratio=step_us / floor_us)
    return out


def estimate(rows: list[dict], config: K3Config, batches: list[int], args) -> dict:
    points = [step_estimate(rows, config, B, args.gpus * B, args.gpus * B, args) for B in batches]
    single = step_estimate(rows, config, 1, 1, 1, args) if 1 in batches and args.gpus > 1 else None
    return {"layer_counts": layer_counts(config), "gpus": args.gpus, "per_batch": points, "single_stream": single,
            "assumptions": {"a2a_latency_us": args.a2a_latency_us, "a2a_gbps_per_direction": args.a2a_gbps,
                            "status": "assumed, not measured (no H200 all-to-all figure is recorded in "
                                      "BENCHMARKS.md or docs/moonep.md)"}}


def memory_arithmetic(config: K3Config, gpus: int, hbm_gb: float, batch: int, context: int,
                      cache_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Do the weights (and the caches of ``batch`` sequences per GPU at ``context`` tokens) fit on ``gpus`` GPUs of
    ``hbm_gb`` GB? Two layouts: attention data-parallel (everything but the routed experts replicated on every GPU,
    experts sharded) and fully sharded (every weight split over the GPUs)."""
    counts = param_counts(config)
    routed = counts["moe_routed_experts"]
    rest = counts["total"] - routed
    hbm = hbm_gb * 1e9
    el = torch.empty((), dtype=cache_dtype).element_size()
    per_seq = StatePool.slot_bytes(config, cache_dtype) + context * len(config.mla_layer_indices) * \
        config.mla.cache_width * el
    cache = batch * per_seq

    def least(fixed: float, shared: float) -> int | None:
        """Fewest GPUs (a multiple of ``gpus``) with fixed + shared / G <= hbm; None if fixed alone is too much."""
        if fixed >= hbm:
            return None
        need = math.ceil(shared / (hbm - fixed))
        return -(-need // gpus) * gpus

    schemes = []
    for experts_fmt, rest_fmt in WEIGHT_SCHEMES:
        r, o = routed * FORMAT_BYTES[experts_fmt], rest * FORMAT_BYTES[rest_fmt]
        dp_gpu, sharded_gpu = o + r / gpus, (o + r) / gpus
        schemes.append({
            "experts": experts_fmt, "rest": rest_fmt, "total_gb": (r + o) / 1e9,
            "attn_dp_gb_per_gpu": dp_gpu / 1e9, "sharded_gb_per_gpu": sharded_gpu / 1e9,
            "fits_weights_attn_dp": dp_gpu <= hbm, "fits_weights_sharded": sharded_gpu <= hbm,
            "min_gpus_weights_attn_dp": least(o, r), "min_gpus_weights_sharded": least(0.0, r + o),
            "min_gpus_with_cache_attn_dp": least(o + cache, r),
        })
    return {"gpus": gpus, "hbm_gb": hbm_gb, "params_total": counts["total"], "params_routed": routed,
            "params_rest": rest, "params_mtp_apart": counts["mtp"], "node_hbm_gb": gpus * hbm_gb,
            "cache_per_sequence_gb": per_seq / 1e9, "cache_batch_per_gpu": batch, "cache_context": context,
            "cache_gb_per_gpu": cache / 1e9, "schemes": schemes}


# ---------------------------------------------------------------------------------------------- reporting
def rows_markdown(rows: list[dict]) -> str:
    lines = ["| layer | batch | measured µs | graph or eager | floor µs | ratio | MB read+written | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("us") is None:
            lines.append(f"| {r['label']} | {r['batch']} | - | error | - | - | - | {r.get('error', '')} |")
            continue
        lines.append(f"| {r['label']} | {r['batch']} | {r['us']:.1f} | {r['mode']} | {r['floor_us']:.1f} | "
                     f"{r['ratio']:.2f} | {r['bytes_total'] / 1e6:.1f} | {r['why']} |")
    return "\n".join(lines)


def estimate_markdown(est: dict) -> str:
    points = list(est["per_batch"]) + ([est["single_stream"]] if est["single_stream"] else [])
    lines = [("| point | sequences on node | step ms (= ms per token) | tokens/s per node | floor step ms | "
              "measured / floor | floor ms, MXFP4 experts | KDA | MLA | dense | MoE | all-to-all | glue | head |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        name = (f"B={p['batch_per_gpu']} per GPU" if p is not est["single_stream"] else "1 stream on the node")
        if p["missing"]:
            lines.append(f"| {name} | {p['sequences_on_node']} | missing rows: {', '.join(p['missing'])} |")
            continue
        ms = {k: v / 1e3 for k, v in p["parts_us"].items()}
        lines.append(
            f"| {name} | {p['sequences_on_node']} | {p['step_ms']:.2f} | {p['tokens_per_s_node']:.1f} | "
            f"{p['floor_step_ms']:.2f} | {p['ratio']:.2f} | {p['floor_step_ms_mxfp4_experts']:.2f} | "
            + " | ".join(f"{ms[k]:.2f}" for k in ("kda", "mla", "dense", "moe", "all-to-all (modelled)", "glue",
                                                 "head")) + " |")
    return "\n".join(lines)


def memory_markdown(mem: dict) -> str:
    def gpus(n):
        return "never (the replicated part alone is too big)" if n is None else str(n)

    lines = [(f"K3 weights: {mem['params_total'] / 1e12:.3f}T parameters ({mem['params_routed'] / 1e12:.3f}T "
              f"routed, {mem['params_rest'] / 1e9:.1f}B rest; MTP {mem['params_mtp_apart'] / 1e9:.1f}B apart, not "
              f"counted). {mem['gpus']} GPUs x {mem['hbm_gb']:.0f} GB = {mem['node_hbm_gb']:.0f} GB. Cache per "
              f"sequence at {mem['cache_context']} tokens: {mem['cache_per_sequence_gb']:.3f} GB (KDA states + MLA "
              f"latents); {mem['cache_batch_per_gpu']} sequences per GPU: {mem['cache_gb_per_gpu']:.1f} GB."), "",
             (f"| experts | rest | total GB | GB/GPU attention-DP at {mem['gpus']} | GB/GPU sharded at "
              f"{mem['gpus']} | fits {mem['gpus']} (DP / sharded) | min GPUs, weights: DP / sharded | "
              "min GPUs, DP with the cache |"),
             "|---|---|---|---|---|---|---|---|"]
    for s in mem["schemes"]:
        lines.append(f"| {s['experts']} | {s['rest']} | {s['total_gb']:.0f} | {s['attn_dp_gb_per_gpu']:.1f} | "
                     f"{s['sharded_gb_per_gpu']:.1f} | {'yes' if s['fits_weights_attn_dp'] else 'no'} / "
                     f"{'yes' if s['fits_weights_sharded'] else 'no'} | {gpus(s['min_gpus_weights_attn_dp'])} / "
                     f"{gpus(s['min_gpus_weights_sharded'])} | {gpus(s['min_gpus_with_cache_attn_dp'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (eager smoke runs)")
    p.add_argument("--scale", default="k3", choices=("k3", "debug", "tiny"), help="the preset whose widths to use")
    p.add_argument("--batches", default="1,64", help="comma list of sequences per GPU (attention data-parallel)")
    p.add_argument("--context", type=int, default=8192, help="tokens cached per sequence (MLA latents)")
    p.add_argument("--block-size", type=int, default=None,
                   help="MLA tokens per physical block (default: 6144 at k3 scale, 16 otherwise)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the expert-parallel group (attention DP over them)")
    p.add_argument("--only", default=",".join(KINDS), help=f"comma list of rows to run, of {','.join(KINDS)}")
    p.add_argument("--iters", type=int, default=50, help="timed steps per row (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before capture and before timing")
    p.add_argument("--eager", action="store_true", help="do not capture CUDA graphs")
    p.add_argument("--no-flush", action="store_true", help="do not overwrite the L2 cache between timed steps")
    p.add_argument("--hbm-tbps", type=float, default=4.2, help="memory bandwidth of the floor, TB/s")
    p.add_argument("--hbm-gb", type=float, default=141.0, help="memory per GPU in the memory arithmetic, GB")
    p.add_argument("--a2a-latency-us", type=float, default=10.0, help="ASSUMED fixed cost of one all-to-all, µs")
    p.add_argument("--a2a-gbps", type=float, default=450.0,
                   help="ASSUMED all-to-all bandwidth per GPU and direction, GB/s (NVLink 4: 450)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows, the estimate and the memory arithmetic here")
    args = p.parse_args(argv)
    if args.block_size is None:
        args.block_size = 6144 if args.scale == "k3" else 16
    return args


def run_rows(config: K3Config, args, device: torch.device, dtype: torch.dtype, batches: list[int],
             kinds: list[str]) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device=device).manual_seed(args.seed)
    flush = None
    if device.type == "cuda" and not args.no_flush:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
        flush = torch.empty(4 * l2, dtype=torch.uint8, device=device)
    m = config.moe
    builders = {
        "kda": lambda: KDA(config), "mla": lambda: GatedMLA(config),
        "moe": lambda: MoEShard(config, args.gpus),
        "dense": lambda: GLUFeedForward(config.dim, config.dense_hidden),
        "glue": lambda: BlockGlue(config), "head": lambda: Head(config),
    }
    for kind in kinds:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            module = materialise(builders[kind], config, device, dtype)
        except Exception as err:  # noqa: BLE001 - report and go on with the other kinds
            log(f"{kind}: could not build: {first_line(err)}")
            rows += [{"layer": kind, "label": kind, "batch": B, "us": None, "error": f"build: {first_line(err)}"}
                     for B in batches]
            continue
        log(f"{kind}: {module_bytes(module) / 1e9:.3f} GB of weights on {device}")
        if kind == "moe":
            local = module.local.experts
            expected = local.w_gate_ELF.shape[0] * 3 * m.latent_dim * m.expert_hidden * local.w_gate_ELF.element_size()
            assert nbytes(*local.parameters()) == expected, "the local experts' bytes disagree with E/G*3*L*F*el"
        points = [(B, None) for B in batches]
        if kind == "moe":
            points = [(B, args.gpus * B) for B in batches] + ([(1, 1)] if 1 in batches and args.gpus > 1 else [])
        for B, node_tokens in points:
            label = {"kda": "KDA", "mla": f"MLA (S={args.context})", "dense": "dense FFN",
                     "glue": f"glue ({glue_entries(config)} AttnRes entries)", "head": "head (V logits)"}.get(kind)
            if kind == "moe":
                label = (f"MoE shard{', 1 stream' if node_tokens == 1 else ''}: {m.num_experts // args.gpus} "
                         f"experts, {node_tokens} node tokens x {m.top_k // args.gpus} rows")
            row = {"layer": kind, "label": label, "batch": B}
            try:
                with torch.no_grad():
                    if kind == "kda":
                        step, moved, info = kda_case(module, config, B, device, dtype, gen)
                    elif kind == "mla":
                        step, moved, info = mla_case(module, config, B, args.context, args.block_size, device,
                                                     dtype, gen)
                    elif kind == "moe":
                        step, moved, info = moe_case(module, config, B, node_tokens, device, dtype, gen)
                    else:
                        case = {"dense": dense_case, "glue": glue_case, "head": head_case}[kind]
                        step, moved, info = case(module, config, B, device, dtype, gen)
                    us, mode, why = time_step(step, device, args.warmup, args.iters, not args.eager, flush)
                total = sum(moved.values())
                floor_us = total / (args.hbm_tbps * 1e12) * 1e6
                row.update(info, us=us, mode=mode, why=why, bytes=moved, bytes_total=total, floor_us=floor_us,
                           ratio=us / floor_us)
            except Exception as err:  # noqa: BLE001 - one failing row must not lose the others
                row.update(us=None, error=f"{first_line(err)} at {where(err)}")
                traceback.print_exc()
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            rows.append(row)
            if row.get("us") is not None:
                log(f"  {label} B={B}: {row['us']:.1f} us ({row['mode']}{': ' + row['why'] if row['why'] else ''}), "
                    f"floor {row['floor_us']:.1f} us, ratio {row['ratio']:.2f}")
            else:
                log(f"  {label} B={B}: ERROR {row['error']}")
            step = None
            if device.type == "cuda":   # (gc only where memory is scarce: it costs ~0.1 s a call)
                gc.collect()
                torch.cuda.empty_cache()
        del module
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: run on a GPU, or pass --device cpu --scale tiny for an eager smoke run")
        return 2
    batches = [int(b) for b in args.batches.split(",") if b]
    kinds = [k for k in args.only.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not batches or min(batches) < 1:
        log(f"bad --only {unknown} or --batches {args.batches}")
        return 2
    config = K3Config.preset(args.scale)
    shard_config(config, args.gpus)   # refuse a --gpus that does not divide the experts and top-k, before any work
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16
    started = time.time()
    header = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
              "python": platform.python_version(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "scale": args.scale, "dim": config.dim, "batches": batches, "context": args.context,
              "block_size": args.block_size, "gpus": args.gpus, "iters": args.iters, "warmup": args.warmup,
              "hbm_tbps": args.hbm_tbps, "l2_flush": device.type == "cuda" and not args.no_flush}
    try:
        import triton
        header["triton"] = triton.__version__
    except ImportError:
        pass
    log(f"{header['device']}, torch {header['torch']}, preset {args.scale} (dim {config.dim}), batches {batches}, "
        f"context {args.context}, {args.gpus}-way expert parallelism")

    rows = run_rows(config, args, device, dtype, batches, kinds)
    est = estimate(rows, config, batches, args)
    # The memory arithmetic is K3's whatever the scale timed (at another scale: on 8-GPU nodes).
    mem = memory_arithmetic(K3Config.preset("k3"), args.gpus if args.scale == "k3" else 8, args.hbm_gb,
                            max(batches), args.context)
    not_graph = [{"layer": r["label"], "batch": r["batch"], "why": r["why"]} for r in rows
                 if r.get("mode") == "eager" and device.type == "cuda"]
    header["seconds"] = time.time() - started
    if device.type == "cuda":
        header["peak_gib"] = max((r.get("peak_gib", 0.0) for r in rows), default=0.0)

    log("\n## Per-layer decode step\n")
    log(rows_markdown(rows))
    log(f"\n## Estimate: {est['layer_counts']['kda']} KDA + {est['layer_counts']['mla']} MLA mixers, "
        f"{est['layer_counts']['dense']} dense + {est['layer_counts']['moe']} MoE, glue x "
        f"{est['layer_counts']['layers']}, head; {args.gpus} GPUs, attention data-parallel, MoonEP experts; "
        f"all-to-all ASSUMED {args.a2a_latency_us:g} us + bytes / {args.a2a_gbps:g} GB/s (ms)\n")
    log(estimate_markdown(est))
    log("\n## Memory\n")
    log(memory_markdown(mem))
    if not_graph:
        log("\nNot captured as a CUDA graph (timed eagerly):")
        for item in not_graph:
            log(f"  {item['layer']} B={item['batch']}: {item['why']}")
    log(f"\n{header['seconds']:.0f} s" + (f", peak {header['peak_gib']:.1f} GiB" if "peak_gib" in header else ""))

    if args.json:
        Path(args.json).write_text(json.dumps({"run": header, "rows": rows, "estimate": est, "memory": mem,
                                               "not_graph_safe": not_graph}, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 1 if any(r.get("us") is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
