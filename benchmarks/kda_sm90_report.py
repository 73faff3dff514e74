"""Compile the Triton KDA kernels of a training step and a decode step for the H200 (sm_90a) on a machine without a
GPU, and report each one's shared memory, registers per thread and register spills, as ptxas reports them, and from
those how many CTAs fit an H200 SM and how many waves the launch grid takes.

A screening tool for kernel changes before any GPU time: the public entry points (``chunk_kda`` forward and
backward, ``kda_decode``) run as usual on small CPU tensors with ``backend="triton"``, but every launch is
intercepted -- the kernel is compiled for ``GPUTarget("cuda", 90, 32)`` with the launch's own signature, constants
and alignment, and never run. ptxas (shipped with Triton) then prints registers and spill bytes. What it cannot
tell: time. A kernel that spills, or needs more than the H200's 227 KB of shared memory, is worth fixing before
spending device time on it. The kernels are the ones the dispatch picks for CPU tensors (the Triton kernels; the
Gluon kernels, chosen on an sm_90 device only, are compiled by their own tests' ``Sm90Compiler`` calls)::

    python benchmarks/kda_sm90_report.py                      # K = V = 128, H = 96, fp32 inputs
    python benchmarks/kda_sm90_report.py --dtype bfloat16 --tokens 8192 --json out.json
    python benchmarks/kda_sm90_report.py --kernels '_bwd_wy|_decode'   # only the kernels whose name matches

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


def run_kda(args, compiler: Sm90Compiler) -> None:
    """One training forward and its backward through ``chunk_kda`` (K3's contract: gate, L2 norm and beta sigmoid
    fused), then, with ``args.decode_batch``, one ``kda_decode`` step; every launch of a kernel whose name
    ``args.kernels`` matches (every launch without it) goes to ``compiler``, the others are skipped."""
    import torch
    import triton.runtime.jit as jit

    from kimik3.ops.kda import chunk_kda, kda_decode

    original = jit.JITFunction.run
    wanted = re.compile(args.kernels) if args.kernels else None

    def intercepted(self, *a, grid, warmup, **kw):
        if wanted is None or wanted.search(self.__name__):
            compiler(self, a, kw, grid)

    jit.JITFunction.run = intercepted
    try:
        B, T, H, K, V = 1, args.tokens, args.heads, args.head_dim, args.head_dim
        dtype = getattr(torch, args.dtype)
        q, k, z = (torch.zeros(B, T, H, K, dtype=dtype, requires_grad=True) for _ in range(3))
        v = torch.zeros(B, T, H, V, dtype=dtype, requires_grad=True)
        beta = torch.zeros(B, T, H, dtype=dtype, requires_grad=True)
        h0 = torch.zeros(B, H, K, V, requires_grad=True)
        a_log, dt_bias = torch.zeros(H), torch.zeros(H, K)
        fused = dict(A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0, use_gate_in_kernel=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        o, ht = chunk_kda(q, k, v, z, beta, initial_state=h0, output_final_state=True, backend="triton", **fused)
        torch.autograd.grad(o.float().sum() + ht.sum(), [q, k, v, z, beta, h0])
        if args.decode_batch:  # the serving decode kernel, one token for each of decode_batch sequences
            Bd = args.decode_batch
            x = torch.zeros(Bd, H, K, dtype=dtype)
            kda_decode(x, x, torch.zeros(Bd, H, V, dtype=dtype), x, torch.zeros(Bd, H, dtype=dtype),
                       torch.zeros(Bd, H, K, V), torch.arange(Bd), A_log=a_log, dt_bias=dt_bias,
                       use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       backend="triton")
    finally:
        jit.JITFunction.run = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="q, k, v, z, beta's dtype")
    p.add_argument("--heads", type=int, default=96, help="H of the dummy inputs")
    p.add_argument("--head-dim", type=int, default=128, help="K = V of the dummy inputs")
    p.add_argument("--tokens", type=int, default=256,
                   help="tokens of the dummy inputs: the compiled kernels do not depend on it, the chunk-parallel "
                        "grids (and so their waves) do; 8192 for K3's per-layer shape")
    p.add_argument("--decode-batch", type=int, default=64,
                   help="sequences of the decode kernel's launch (0: leave it out)")
    p.add_argument("--kernels", default=None, help="a regular expression: compile only the kernels it finds in "
                                                    "their names (e.g. '_bwd_wy|_decode')")
    p.add_argument("--json", help="write the arguments and the rows here")
    args = p.parse_args(argv)
    if args.kernels is not None:
        try:
            re.compile(args.kernels)
        except re.error as exc:
            raise SystemExit(f"--kernels: not a regular expression ({exc}): {args.kernels!r}") from None
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kda_sm90_report.py compiles for the GPU: unset TRITON_INTERPRET")
    compiler = Sm90Compiler()
    run_kda(args, compiler)
    if not compiler.rows:
        raise SystemExit(f"no kernel launched matches --kernels {args.kernels!r}")
    print(f"sm_90a, K = V = {args.head_dim}, H = {args.heads}, T = {args.tokens}, {args.dtype}")
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
