"""Compile every Triton KDA kernel for the H200 (sm_90a) on a machine without a GPU, and report each one's
shared memory, registers per thread and register spills, as ptxas reports them, and from those how many
CTAs fit an H200 SM and how many waves the launch grid takes.

A screening tool for kernel changes between GPU sessions: the launchers run as usual on small CPU
tensors, but every launch is intercepted -- the kernel is compiled for ``GPUTarget("cuda", 90, 32)``
with the launch's own signature, constants and alignment, and never run. ptxas (shipped with Triton)
then prints registers and spill bytes. What it cannot tell: time. A kernel that spills, or needs more
than the H200's 227 KB of shared memory, is worth fixing before spending device time on it::

    python benchmarks/kda_sm90_report.py                      # default switches, K = V = 128, fp32 inputs
    python benchmarks/kda_sm90_report.py --dtype bfloat16 --fwd fused --intra fused --wy-split 0
    python benchmarks/kda_sm90_report.py --set triton_backward.BWD_WARPS=8 --set triton_forward.SCAN_CONFIG=32,4,1
    python benchmarks/kda_sm90_report.py --set gluon_wy.RING=1   # a gluon_* module (imported when named)
    python benchmarks/kda_sm90_report.py --json out.json

Needs no GPU; must not run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

H200_SHARED_BYTES = 232448  # the opt-in maximum per block on sm_90 (227 KB)
H200_SMS = 132
SM90_SHARED_PER_SM, SM90_RESERVED_PER_CTA = 233472, 1024  # 228 KB per SM; 1 KB of it reserved per CTA
SM90_REGS_PER_SM, SM90_WARPS_PER_SM, SM90_CTAS_PER_SM = 65536, 64, 32
_TORCH_TO_TRITON = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32", "int64": "i64",
                    "uint8": "u8", "bool": "i1"}


def _ptxas() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        raise SystemExit(f"ptxas not found at {path}: this Triton wheel does not ship it")
    return path


def ptxas_usage(ptx: str) -> dict:
    """Registers and spill bytes of the one kernel in ``ptx``, from ``ptxas -v``."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        p = subprocess.run([_ptxas(), f"-arch={target}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ptxas failed: {p.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", p.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", p.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None}


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Resident CTAs per sm_90 SM: the least of the register file (registers per thread rounded up to 8,
    per warp), shared memory (with the 1 KB each CTA reserves), the warp slots and the CTA slots."""
    by_regs = (SM90_REGS_PER_SM // (-(-max(registers, 1) // 8) * 8 * 32)) // num_warps
    by_shared = SM90_SHARED_PER_SM // (shared_bytes + SM90_RESERVED_PER_CTA)
    return min(by_regs, by_shared, SM90_WARPS_PER_SM // num_warps, SM90_CTAS_PER_SM)


def waves(grid, ctas: int) -> float:
    """Programs of the grid over the H200's resident CTA slots (1.0 = every program resident at once)."""
    return math.prod(grid) / max(ctas * H200_SMS, 1)


def _ast_source(fn):
    """The compiler's source class for a kernel: Gluon's for a Gluon kernel, Triton's otherwise."""
    from triton.compiler import ASTSource

    try:
        from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    except ImportError:  # a Triton without Gluon has no Gluon kernels either
        return ASTSource
    return GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource


class Sm90Compiler:
    """Stands in for ``JITFunction.run``: compiles for sm_90 and records the result instead of launching."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.rows: list[dict] = []

    def __call__(self, fn, args, kwargs, grid) -> None:
        import torch
        import triton
        from triton.runtime.jit import mangle_type

        names = fn.arg_names
        bound = dict(zip(names, args))
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        bound.update(kwargs)
        if "num_warps" in names and "num_warps" in options:  # a Gluon kernel takes num_warps as a parameter too
            bound["num_warps"] = options["num_warps"]
        constexpr_names = {p.name for p in fn.params if p.is_constexpr}
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(names):
            value = bound[name]
            if name in constexpr_names or value is None:
                signature[name], constexprs[(i,)] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
                if value.data_ptr() % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                if value == 1:  # Triton specialises integer arguments equal to 1
                    signature[name], constexprs[(i,)] = "constexpr", 1
                    continue
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:  # e.g. a TMA tensor descriptor: typed as the launcher types it
                signature[name] = mangle_type(value)
        src = _ast_source(fn)(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=self.target, options=options)
        grid = tuple(grid(bound) if callable(grid) else grid)
        row = {"kernel": fn.__name__, "grid": list(grid), "num_warps": kernel.metadata.num_warps,
               "num_stages": kernel.metadata.num_stages, "shared_bytes": kernel.metadata.shared}
        row.update(ptxas_usage(kernel.asm["ptx"]))
        self.rows.append(row)


def parse_override(text: str):
    """'triton_backward.BWD_WARPS=8' -> (the module, 'BWD_WARPS', 8); '32,4,1' becomes a tuple, None / True / False
    themselves, a word stays a string."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_bwd_intra as tbi
    import kimik3.ops.kda.triton_decode as td
    import kimik3.ops.kda.triton_forward as tf
    import kimik3.ops.kda.triton_prep16 as tp16
    import kimik3.ops.kda.triton_prologue as tp
    import kimik3.ops.kda.triton_scan as ts

    target, sep, value = text.partition("=")
    module, dot, attr = target.partition(".")
    modules = {"triton_forward": tf, "triton_prologue": tp, "triton_scan": ts, "triton_backward": tb,
               "triton_bwd_intra": tbi, "triton_decode": td, "triton_prep16": tp16}
    if module.startswith("gluon_"):  # the Gluon kernels' modules, imported only when named (a Triton with Gluon)
        import importlib

        modules[module] = importlib.import_module(f"kimik3.ops.kda.{module}")
    if not sep or not dot or module not in modules or not hasattr(modules[module], attr):
        raise argparse.ArgumentTypeError(f"{text!r}: expected module.ATTR=value with an existing ATTR of "
                                         f"{', '.join(modules)} or a gluon_* module")
    if value in ("None", "True", "False"):
        return modules[module], attr, {"None": None, "True": True, "False": False}[value]
    try:
        parts = [int(x) for x in value.split(",")]
    except ValueError:  # a mode name, e.g. triton_bwd_intra.BWD_INTRA_MODE=rows
        return modules[module], attr, value
    return modules[module], attr, parts[0] if len(parts) == 1 else tuple(parts)


def run_kda(args, compiler: Sm90Compiler) -> None:
    import torch
    import triton.runtime.jit as jit

    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_forward as tf
    from kimik3.ops.kda.triton_preact import PreactInputs

    tf.FWD_MODE, tf.INTRA_MODE, tb.WY_SPLIT_K = args.fwd, args.intra, bool(args.wy_split)
    if args.variant is not None:
        tf.DEFAULT_VARIANT = args.variant
    for module, attr, value in args.overrides:
        setattr(module, attr, value)
    original = jit.JITFunction.run

    def intercepted(self, *a, grid, warmup, **kw):
        compiler(self, a, kw, grid)

    jit.JITFunction.run = intercepted
    try:
        B, T, H, K, V = 1, args.tokens, args.heads, args.head_dim, args.head_dim
        dtype = getattr(torch, args.dtype)
        q, k = torch.zeros(B, T, H, K, dtype=dtype), torch.zeros(B, T, H, K, dtype=dtype)
        v, g = torch.zeros(B, T, H, V, dtype=dtype), torch.zeros(B, T, H, K, dtype=torch.float32)
        beta, h0 = torch.zeros(B, T, H, dtype=torch.float32), torch.zeros(B, H, K, V)
        a_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
        plan = tf.make_plan(B, T, None, q.device)
        o, ht, aux = tf.kda_fwd_triton(q, k, v, g, beta, K ** -0.5, h0, True, plan, A_log=a_log, dt_bias=dt_bias,
                                       use_gate=True, use_l2=True, use_beta_sigmoid=True, return_aux=True)
        preact = PreactInputs(q, k, g, beta, a_log, dt_bias, -5.0, True, True, True)  # as K3's layer calls it
        tb.kda_bwd_triton(torch.zeros_like(v), torch.zeros_like(h0), aux, v, h0, K ** -0.5, plan, preact=preact)
        if args.decode_batch:  # the serving decode kernel, one token for each of decode_batch sequences
            from kimik3.ops.kda.triton_decode import kda_decode

            Bd = args.decode_batch
            x = torch.zeros(Bd, H, K, dtype=dtype)
            kda_decode(x, x, torch.zeros(Bd, H, V, dtype=dtype), x, torch.zeros(Bd, H, dtype=dtype),
                       torch.zeros(Bd, H, K, V), torch.arange(Bd), A_log=a_log, dt_bias=dt_bias.view(H, K),
                       use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    finally:
        jit.JITFunction.run = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256,
                   help="tokens of the dummy inputs: the compiled kernels do not depend on it, the chunk-parallel "
                        "grids (and so their waves) do; 8192 for K3's per-layer shape")
    p.add_argument("--fwd", default="split", choices=["fused", "split"], help="KIMIK3_KDA_FWD")
    p.add_argument("--intra", default="split", choices=["fused", "split", "tiles16"])
    p.add_argument("--variant", default=None, help="precision variant (KIMIK3_KDA_VARIANT), e.g. ach")
    p.add_argument("--wy-split", type=int, choices=[0, 1], default=1, help="KIMIK3_KDA_WY_SPLIT")
    p.add_argument("--decode-batch", type=int, default=64,
                   help="sequences of the decode kernel's launch (0: leave it out); its blocks from "
                        "--set triton_decode.DEFAULT_BLOCKS=BV,warps")
    p.add_argument("--set", dest="overrides", action="append", default=[], type=parse_override,
                   help="module.ATTR=value, module one of triton_forward, triton_prologue, triton_scan, "
                        "triton_backward, triton_bwd_intra, triton_decode; value an int or a "
                        "comma tuple of ints (e.g. triton_backward.BWD_WARPS=8, triton_forward.SCAN_CONFIG=32,4,1)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kda_sm90_report.py compiles for the GPU: unset TRITON_INTERPRET")
    compiler = Sm90Compiler()
    run_kda(args, compiler)
    print(f"sm_90a, K = V = {args.head_dim}, H = {args.heads}, {args.dtype}, fwd {args.fwd}, intra {args.intra}, "
          f"WY split {args.wy_split}, variant {args.variant or 'default'}"
          + "".join(f", {m.__name__.rsplit('.', 1)[-1]}.{a}={v}" for m, a, v in args.overrides))
    print("| kernel | grid | warps | stages | shared KB | registers | spill store / load bytes | CTAs / SM | waves |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in compiler.rows:
        flag = " (over the H200's 227 KB)" if r["shared_bytes"] > H200_SHARED_BYTES else ""
        r["ctas_per_sm"] = ctas_per_sm(r["registers"], r["num_warps"], r["shared_bytes"])
        r["waves"] = waves(r["grid"], r["ctas_per_sm"])
        print(f"| {r['kernel']} | {tuple(r['grid'])} | {r['num_warps']} | {r['num_stages']} | "
              f"{r['shared_bytes'] / 1024:.1f}{flag} | {r['registers']} | {r['spill_store_bytes']} / "
              f"{r['spill_load_bytes']} | {r['ctas_per_sm']} | {r['waves']:.2f} |")
    print(f"(CTAs / SM from registers, shared memory and warp slots; waves = programs / (CTAs x {H200_SMS} SMs): "
          "a serial scan with waves > 1 runs its chains in turn; the grid of chunk-parallel kernels grows with "
          "--tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kernels": compiler.rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
