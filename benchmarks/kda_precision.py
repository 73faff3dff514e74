"""KDA precision class: ours (the default kernels) and fla 0.6.0 against the fp32 token loop, on the same bf16 inputs
with K3's contract, forward and every gradient.

    python benchmarks/kda_precision.py [--shape 1,2048,32,128] [--seeds 2] [--no-fla] [--out DIR]

The bf16 inputs (raw q, k, v, gate input z, beta logits, and an fp32 initial state) are upcast to fp32 for the
reference (`naive_recurrent_kda` after the fp32 pre-activations), so every error measured is the kernel's own
rounding. Printed per implementation: the relative RMS error of o and the final state (of the training forward, and
of a forward alone, which takes other kernels), and of the gradients of q, k, v, z, the beta logits and the initial
state, and each of our errors over fla's on the same inputs. Ours is "in fla's precision class" when none of its
errors exceeds 1.25x fla's (or its own error is under 1e-3 anyway). Which kernels run depends on the shape, as it
does in the model (their dispatch thresholds count chunks x heads); a shape over the thresholds, e.g. H96, measures
the kernels that run at K3's shape. Timing is kda_kernel.py's job; this script only measures errors. GPU (or CPU
under TRITON_INTERPRET=1 at a tiny --shape, as the CPU smoke test does).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda_k3 as k3  # noqa: E402  (the K3-contract inputs and callers; k3.DEVICE: where inputs are built)
from harness import log, rel  # noqa: E402

# o_fwd, state_fwd: a forward alone (no autograd), which takes other kernel forms than the training forward (o, state)
FIELDS = ["o", "state", "o_fwd", "state_fwd", "dq", "dk", "dv", "dz", "dbeta", "dh0"]
CLASS_RATIO, CLASS_FLOOR = 1.25, 1e-3


def errors(call, xs, h0, do, ds, ref) -> dict:
    """call(xs, h0) -> (o, final state); its errors against ref (same FIELDS order) as a dict."""
    o, s = call(xs, h0)
    grads = torch.autograd.grad((o.float() * do).sum() + (s.float() * ds).sum(), xs + [h0])
    with torch.no_grad():  # (detached: an autograd.Function sees inputs that require grad even under no_grad)
        o_fwd, s_fwd = call([x.detach() for x in xs], h0.detach())
    return {name: rel(r, x) for name, r, x in zip(FIELDS, ref, [o, s, o_fwd, s_fwd, *grads])}


def measure(shape, use_fla: bool, seed: int) -> dict:
    """{implementation: {field: error}} at shape (B, T, H, D) for one input seed: "ours", and "fla" when use_fla
    and its wheels are there."""
    B, T, H, D = shape
    xs, a_log, dtb = k3.k3_inputs(B, T, H, D, seed=seed, requires_grad=True)
    gen = torch.Generator(device=k3.DEVICE).manual_seed(seed + 1000)
    h0 = (0.5 * torch.randn(B, H, D, D, generator=gen, device=k3.DEVICE)).requires_grad_()
    do = torch.randn(B, T, H, D, generator=gen, device=k3.DEVICE)
    ds = torch.randn(B, H, D, D, generator=gen, device=k3.DEVICE)
    xs32 = [x.detach().float().requires_grad_() for x in xs]
    o_n, s_n = k3.naive_k3(xs32, a_log, dtb, h0)
    ref = [o_n, s_n, o_n, s_n, *torch.autograd.grad((o_n * do).sum() + (s_n * ds).sum(), xs32 + [h0])]
    del xs32, o_n, s_n
    out = {"ours": errors(lambda x, h: k3.ours_k3(x, a_log, dtb, h, True), xs, h0, do, ds, ref)}
    fla_fn, _ = k3.load_fla() if use_fla else (None, None)
    if fla_fn is not None:
        out["fla"] = errors(lambda x, h: k3.fla_k3(fla_fn, x, a_log, dtb, h, True), xs, h0, do, ds, ref)
    return out


def in_fla_class(errs: dict, fla: dict) -> bool:
    return all(errs[f] <= max(CLASS_RATIO * fla[f], CLASS_FLOOR) for f in FIELDS)


def report(shape, per_seed: list) -> dict:
    """Mean over seeds; prints the table and, with fla measured, our class verdict. Returns the summary dict."""
    names = list(per_seed[0])
    mean = {n: {f: sum(s[n][f] for s in per_seed) / len(per_seed) for f in FIELDS} for n in names}
    B, T, H, D = shape
    log(f"\nrelative RMS error vs the fp32 token loop, bf16 inputs, K3 contract, B{B} T{T} H{H} D{D}, "
        f"mean of {len(per_seed)} seed(s):")
    log("| implementation | " + " | ".join(FIELDS) + " |")
    log("|---|" + "---|" * len(FIELDS))
    fla = mean.get("fla")
    for n in names:
        cells = []
        for f in FIELDS:
            cell = f"{mean[n][f]:.2e}"
            if fla is not None and n != "fla":
                cell += f" ({mean[n][f] / max(fla[f], 1e-30):.2f}x)"
            cells.append(cell)
        log(f"| {n} | " + " | ".join(cells) + " |")
    verdicts = {}
    if fla is not None:
        for n in names:
            if n != "fla":
                verdicts[n] = in_fla_class(mean[n], fla)
                log(f"{n}: {'in' if verdicts[n] else 'NOT in'} fla's precision class "
                    f"(every error <= {CLASS_RATIO}x fla's or < {CLASS_FLOOR:g})")
    return {"shape": list(shape), "seeds": len(per_seed), "mean": mean, "in_fla_class": verdicts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1,2048,32,128", help="B,T,H,D (the token loop's autograd holds T states)")
    p.add_argument("--seeds", type=int, default=2, help="input seeds 0 .. N-1; the table is their mean")
    p.add_argument("--no-fla", action="store_true", help="leave the peer out")
    p.add_argument("--out", default=os.environ.get("OUT"), help="write kda_precision.json here (default $OUT)")
    p.add_argument("--gluon-any-size", action="store_true",
                   help="the Gluon stages at any size (dispatch.thresholds(0, 0)), so that a shape small enough for "
                        "the token loop measures them")
    a = p.parse_args(argv)
    try:
        shape = tuple(int(x) for x in a.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise SystemExit(f"--shape takes four positive integers B,T,H,D, got {a.shape!r}")
    if a.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {a.seeds}")
    if not torch.cuda.is_available():  # the interpreter at a tiny shape (a smoke run)
        k3.DEVICE = "cpu"
        k3.interpreter_bf16_fix()
    from kimik3.ops.kda import dispatch

    with dispatch.thresholds(0, 0) if a.gluon_any_size else contextlib.nullcontext():
        per_seed = [measure(shape, not a.no_fla, seed) for seed in range(a.seeds)]
    summary = report(shape, per_seed)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kda_precision.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
