"""MXFP4 routed-expert matmuls on the GPU: ``mxfp4_grouped_mm`` (packed E2M1 codes + E8M0 scales) on each of its
routes, against bf16 ``torch._grouped_mm`` at K3's expert shapes.

    python benchmarks/mxfp4_experts.py [--experts 112] [--tokens 1,4,8,16,32,64,128,256,512,2048] [--layer]
                                       [--routing uniform|random] [--out DIR]

K3's routed experts are SiTU-GLU FFNs, latent 3584 -> hidden 3072 -> 3584: the gate and up matmuls [in 3584, out 3072]
(each; timed as one) and the down matmul [in 3072, out 3584]. Per shape and tokens an expert (every one of the E local
experts gets that many rows: 1..64 is decode, 2048 and more prefill), the script first checks each route's output
(mma, on a GPU that runs it and up to ``MMA_TOKENS`` rows an expert: the weights decoded into the tensor cores'
operand registers; gemv, up to ``GEMV_TOKENS`` rows an expert: a program per row, the weights decoded in registers and
multiplied on the CUDA cores; registers: the weights decoded in the matmul's registers; dequantize: decoded once to
bf16, then ``torch._grouped_mm``) against ``torch._grouped_mm`` on the dequantised bf16 weights (the same products:
relative RMS error under 1e-3, and every element within 2^-7 of its reference plus 1e-3 of the largest; a case that
fails is not timed), then times the routes and bf16 (``triton.testing.do_bench`` medians of a CUDA graph's replay of
the call, as the engine decodes: at decode sizes a call's host work, its checks and launches from Python, lasts about
as long as its kernels, and timing it from Python measured the host's speed; ``--eager`` times the calls as
launched) and prints ms, the time of the weights' decode alone, the route ``mxfp4_route`` takes at that size, the
bf16 / MXFP4 time ratio for that route (above 1: MXFP4 is faster), where the Hopper kernel runs the mma route also on
x already in its k order ("ordered": as the packed layer's producers write x, so without ``renumber_k``'s pass; checked
equal to the mma route bit for bit) and its ratio, TFLOP/s, the weight bytes of each form and the weight bandwidth
they imply (bytes / time).
``--layer`` also times the packed expert layer as ``RoutedExperts`` serves it (``layer_table``: the rows gathered
and quantised to MXFP8, gate and up as one matmul, the SiTU-GLU, down) against bf16 and against its unfused form;
``--routing random`` spreads its rows over the experts at random, as a balanced router does, instead of exactly
``--tokens`` each (an expert past a pass's rows takes a second pass over its weights).
``--blocks`` overrides the registers kernel's tile sizes (and warps and pipeline stages), for tuning. GPU only:
without CUDA it exits with a message (``--help`` works anywhere). Writes ``mxfp4_experts.json`` under ``--out`` when
given.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # --help works anywhere; the timings need CUDA (and so triton)
    triton = tl = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"gate_up": (3584, 3072), "down": (3072, 3584)}  # name -> (in I, out O)
DEVICE = "cuda"  # a smoke test of the script's logic may set "cpu" (the kernel then needs TRITON_INTERPRET=1)
REL_RMS_MAX = 1e-3
GEMV_TOKENS = 16  # the gemv route re-reads an expert's weights for each of its rows: timed up to this many
MMA_TOKENS = 512  # the mma route takes up to 64 rows a pass over the weights: timed up to this many (past it)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=112,
                   help="local experts E (default 112: K3's 896 routed experts served on 8 GPUs; 14 on 64)")
    p.add_argument("--tokens", default="1,4,8,16,32,64,128,256,512,2048",
                   help="rows an expert, comma-separated (default: decode 1-64, the routes' crossovers 128-512, "
                        "prefill 2048)")
    p.add_argument("--shapes", default="gate_up,down", help=f"which matmuls, comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--blocks", default=None,
                   help="BLOCK_M,BLOCK_N,BLOCK_K[,NUM_WARPS,NUM_STAGES] for the kernel (default: mxfp4_blocks')")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms (default 25)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms (default 100)")
    p.add_argument("--eager", action="store_true",
                   help="time each call as launched from Python (default: its CUDA graph's replay)")
    p.add_argument("--layer", action="store_true",
                   help="also time the whole expert FFN (rows gathered, gate and up, SiTU-GLU, down) packed against "
                        "bf16, at each --tokens up to 64")
    p.add_argument("--routing", choices=("uniform", "random"), default="uniform",
                   help="--layer's rows an expert: uniform (every expert exactly --tokens; default) or random (each "
                        "of the E x tokens rows sent to an expert drawn uniformly: a balanced router's spread, about "
                        "sqrt(tokens) either side)")
    p.add_argument("--out", default=None, help="directory for mxfp4_experts.json")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens takes comma-separated integers, got {args.tokens!r}")
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {unknown}, known {sorted(SHAPES)}")
    if args.experts < 1 or any(t < 1 for t in args.tokens):
        p.error("--experts and --tokens must be >= 1")
    if args.blocks is not None:
        names = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
        try:
            values = [int(b) for b in args.blocks.split(",")]
        except ValueError:
            values = []
        if len(values) not in (3, 5):
            p.error(f"--blocks takes 3 or 5 integers BLOCK_M,BLOCK_N,BLOCK_K[,NUM_WARPS,NUM_STAGES], got "
                    f"{args.blocks!r}")
        args.blocks = dict(zip(names, values))
    else:
        args.blocks = {}
    return args


def read_all(t: torch.Tensor) -> torch.Tensor:
    """Reads every byte of a contiguous tensor once (a Triton kernel XOR-ing its 32-bit words, 32 KB a program, one
    word out a program): the floor of any kernel that must read those bytes, launch and ramp included."""
    words = t.reshape(-1).view(torch.int32) if t.numel() * t.element_size() % 4 == 0 else t.reshape(-1)
    n = words.numel()
    out = torch.empty(triton.cdiv(n, _READ_BLOCK * _READ_ITERS), dtype=words.dtype, device=t.device)
    _read_kernel[(out.numel(),)](words, out, n, BLOCK=_READ_BLOCK, ITERS=_READ_ITERS, num_warps=8)
    return out


_READ_BLOCK, _READ_ITERS = 1024, 8  # the fastest of 1,024-4,096 x 4-8 on an H100 (NOTES-quant.md)

if triton is not None:
    @triton.jit
    def _read_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK * ITERS + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=w_ptr.dtype.element_ty)
        for i in range(ITERS):
            acc ^= tl.load(w_ptr + offs + i * BLOCK, mask=offs + i * BLOCK < n, other=0)
        tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def main(argv=None) -> int:
    args = parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("mxfp4_experts.py times CUDA kernels: no CUDA device here (nothing run)", file=sys.stderr)
        return 2

    from harness import Report, bench, graphed, log, rel

    from kimik3.ops.moe import ExpertGroups, mxfp4_grouped_mm
    from kimik3.ops.moe.mxfp4_dequantize import mxfp4_dequantize
    from kimik3.ops.moe.mxfp4_grouped_mm import (gemv_blocks, mma_available, mxfp4_blocks, mxfp4_mma_order,
                                                 mxfp4_route, wgmma_available)
    from kimik3.ops.moe.mxfp8_rows import renumber_k
    from kimik3.quant.kernel_order import to_kernel_order
    from kimik3.quant.mx import dequantize, quantize

    report = Report(table=[])
    t0 = time.time()
    dev = torch.device(DEVICE)
    cuda = dev.type == "cuda"
    E = args.experts
    log(f"{torch.cuda.get_device_name(dev) if cuda else dev}, torch {torch.__version__}, E = {E} local experts")
    mma, wgmma = mma_available(dev), wgmma_available(dev)
    graphs = cuda and not args.eager

    def timed(fn) -> float:
        if graphs:
            try:
                fn = graphed(fn)
            except RuntimeError as err:   # said, and timed as launched: a capture failure is a finding, not a stop
                log(f"CUDA graph capture failed ({str(err).splitlines()[0][:200]}): this call timed as launched")
        return bench(fn, args.warmup, args.rep)

    log(f"times: do_bench medians of {'each call replayed from a CUDA graph' if graphs else 'each call as launched'}")
    log(f"{'shape':>8} {'tok/exp':>7} {'rows':>6} {'M,N,K,warps,stages':>20} {'mma ms':>8} {'gemv ms':>8} "
        f"{'regs ms':>8} "
        f"{'deq ms':>8} {'(decode)':>8} {'route':>10} {'bf16 ms':>8} {'ratio':>6} {'ordered':>8} {'ratio':>6} "
        f"{'mxfp4 TF':>8} {'bf16 TF':>8} "
        f"{'W mxfp4':>9} {'W bf16':>9} {'mxfp4 GB/s':>10} {'bf16 GB/s':>9}")
    for name in args.shapes:
        I, O = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(0)
        w_EIO = (torch.randn(E, I, O, device=dev, generator=gen) / I ** 0.5).to(torch.bfloat16)
        mx = to_kernel_order(quantize(w_EIO, "mxfp4", axis=-2))
        codes, scales = mx.codes, mx.scales
        w_deq = dequantize(mx, torch.bfloat16).contiguous()
        bytes_mx = codes.numel() + scales.numel()
        bytes_bf16 = w_deq.numel() * 2
        w_EIO = None
        with torch.inference_mode():
            ms_decode = timed(lambda: mxfp4_dequantize(mx))
            ms_read_mx, ms_read_bf16 = (timed(lambda t=t: read_all(t)) for t in (codes, w_deq))
        log(f"{name}: reading the weights alone (no decode, no product): MXFP4 codes {ms_read_mx:.4f} ms, bf16 "
            f"{ms_read_bf16:.4f} ms -> at most {ms_read_bf16 / ms_read_mx:.2f}x from the bytes at this size")
        report.results.setdefault("read_floor", {})[name] = {"codes_ms": ms_read_mx, "bf16_ms": ms_read_bf16}
        for tokens in args.tokens:
            case = f"{name}:{tokens}"
            R = E * tokens
            x = torch.randn(R, I, device=dev, generator=gen).to(torch.bfloat16)
            groups = ExpertGroups.of(torch.full((E,), tokens, device=dev))
            auto = mxfp4_route(R, E, O, x.dtype, mma=mma, wgmma=wgmma)
            times = {}
            with torch.inference_mode():
                run_bf16 = lambda: torch._grouped_mm(x, w_deq, offs=groups.offsets_E)  # noqa: E731
                ref = run_bf16().float()
                bound = ref.abs() * 2.0 ** -7 + 1e-3 * ref.abs().max()
                for route in ("mma", "gemv", "registers", "dequantize"):
                    if (route == "gemv" and tokens > GEMV_TOKENS) or (route == "mma" and (not mma
                                                                                           or tokens > MMA_TOKENS)):
                        continue
                    extra = args.blocks if route == "registers" else {}
                    run = lambda: mxfp4_grouped_mm(x, mx, groups, route=route, **extra)  # noqa: E731
                    y = run().float()
                    if route == "mma":
                        y_mma = y      # (what x in the MMA's order must give, below)
                    err = rel(ref, y)
                    ok = err < REL_RMS_MAX and bool(((y - ref).abs() <= bound).all())
                    report.verdict(f"{case}:{route}:matches_bf16", ok, f"rel_rms {err:.2e}")
                    if ok:
                        times[route] = (timed(run), err)
                if auto not in times:
                    continue
                ms_bf16 = timed(run_bf16)
                ms_ordered = None
                if auto == "mma" and mxfp4_mma_order(R, E, x.dtype, dev):
                    # x as the packed layer's producers write it (the Hopper kernel's k order): no renumber_k inside
                    x_k = renumber_k(x)
                    run = lambda: mxfp4_grouped_mm(x_k, mx, groups, mma_order=True)  # noqa: E731
                    same = torch.equal(run().float(), y_mma)
                    report.verdict(f"{case}:mma_ordered:equals_mma", same, "bit for bit" if same else "differs")
                    if same:
                        ms_ordered = timed(run)
            ms_mx, err = times[auto]
            flops = 2.0 * R * I * O
            if auto == "mma" and wgmma:   # rows a pass, columns a program, 128 K, warps, ring slots
                from kimik3.ops.moe.mxfp4_wgmma import WGMMA_COLUMNS, wgmma_tile  # (Gluon: where it runs)

                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                per_pass, slots, consumers, _ = wgmma_tile(R, E, O, sms)
                blocks = [per_pass, consumers * WGMMA_COLUMNS, 128, 4 * consumers + 4, slots]
            elif auto == "mma":     # mma.sync: 8 rows a pass, 16 x warps columns, 128 x steps K
                from kimik3.ops.moe.mxfp4_mma import MMA_STEPS, MMA_WARPS

                blocks = [8, 16 * MMA_WARPS, 128 * MMA_STEPS, MMA_WARPS, 1]
            elif auto == "gemv":    # its tiles: one row, gemv_blocks' columns and K, one stage
                block_n, block_k, warps = gemv_blocks(O, I)
                blocks = [1, block_n, block_k, warps, 1]
            else:
                blocks = [args.blocks.get(n, v) for n, v in
                          zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), mxfp4_blocks(R, E, O, I))]
            row = {"shape": name, "I": I, "O": O, "experts": E, "tokens_per_expert": tokens, "rows": R,
                   "blocks": blocks, "route": auto, "mma_ms": times.get("mma", (None,))[0],
                   "gemv_ms": times.get("gemv", (None,))[0],
                   "registers_ms": times.get("registers", (None,))[0],
                   "dequantize_ms": times.get("dequantize", (None,))[0], "dequantize_weights_ms": ms_decode,
                   "mma_ordered_ms": ms_ordered,
                   "ratio_bf16_over_mma_ordered": ms_bf16 / ms_ordered if ms_ordered else None,
                   "mxfp4_ms": ms_mx, "bf16_ms": ms_bf16, "ratio_bf16_over_mxfp4": ms_bf16 / ms_mx,
                   "mxfp4_tflops": flops / ms_mx / 1e9, "bf16_tflops": flops / ms_bf16 / 1e9,
                   "weight_bytes_mxfp4": bytes_mx, "weight_bytes_bf16": bytes_bf16,
                   "mxfp4_weight_gbps": bytes_mx / ms_mx / 1e6, "bf16_weight_gbps": bytes_bf16 / ms_bf16 / 1e6,
                   "rel_rms": err}
            report.results["table"].append(row)

            def ms(v):
                return f"{v:.4f}" if v is not None else "-"

            log(f"{name:>8} {tokens:>7} {R:>6} {','.join(map(str, blocks)):>20} {ms(row['mma_ms']):>8} "
                f"{ms(row['gemv_ms']):>8} "
                f"{ms(row['registers_ms']):>8} {ms(row['dequantize_ms']):>8} {ms_decode:>8.4f} {auto:>10} "
                f"{ms_bf16:>8.4f} "
                f"{row['ratio_bf16_over_mxfp4']:>6.2f} {ms(ms_ordered):>8} "
                f"{(f'{ms_bf16 / ms_ordered:.2f}' if ms_ordered else '-'):>6} "
                f"{row['mxfp4_tflops']:>8.1f} {row['bf16_tflops']:>8.1f} "
                f"{bytes_mx / 2 ** 20:>7.1f}MB {bytes_bf16 / 2 ** 20:>7.1f}MB {row['mxfp4_weight_gbps']:>10.0f} "
                f"{row['bf16_weight_gbps']:>9.0f}")
        # this shape's tensors freed before the next one's
        codes = scales = w_deq = mx = x = y = y_mma = ref = run = None
        if cuda:
            torch.cuda.empty_cache()
    if args.layer:
        layer_table(args, report, timed, [t for t in args.tokens if t <= 64])
    return report.finish(t0, args.out, "mxfp4_experts.json")


def layer_table(args, report, timed, tokens_list) -> None:
    """The expert FFN of a packed layer from the token rows to the down matmul's output, as ``RoutedExperts``
    serves it, against bf16 at the same shapes: packed = ``expert_rows_mxfp8`` (rows gathered and fake-quantised
    to MXFP8, in the Hopper kernel's k order where it runs), gate and up as one MXFP4 matmul of 2F columns,
    ``situ_glu_mxfp8``, the down matmul; bf16 = the gather, one ``torch._grouped_mm`` of 2F columns, the SiTU-GLU
    kernel, the down ``torch._grouped_mm``. Also timed: the packed layer unfused (the gather, ``fake_quantize`` in
    torch, two MXFP4 matmuls that each renumber x, the SiTU-GLU and ``fake_quantize`` again). Each token is one row
    (rows = E x tokens an expert, routed in a random order); ``--routing random`` spreads them over the experts at
    random (the same counts for every form timed)."""
    from harness import log, rel

    from kimik3.model.ffn import situ_glu_cast
    from kimik3.ops.glue import situ_glu_fused
    from kimik3.ops.moe import ExpertGroups, mxfp4_grouped_mm
    from kimik3.ops.moe.mxfp4_grouped_mm import mxfp4_mma_order
    from kimik3.ops.moe.mxfp8_rows import expert_rows_mxfp8, situ_glu_mxfp8
    from kimik3.quant.kernel_order import to_kernel_order
    from kimik3.quant.mx import MXTensor, dequantize, fake_quantize, quantize

    dev = torch.device(DEVICE)
    E = args.experts
    L, F = SHAPES["gate_up"]
    gen = torch.Generator(device=dev).manual_seed(1)
    packed, bf16_weights = {}, {}
    for name, (I, O) in (("gate_up", (L, 2 * F)), ("down", (F, L))):
        parts = []
        for e0 in range(0, E, 8):      # (8 experts at a time: quantize's fp32 temporaries of 112 would not fit)
            w = (torch.randn(min(8, E - e0), I, O, device=dev, generator=gen) / I ** 0.5).to(torch.bfloat16)
            parts.append(quantize(w, "mxfp4", axis=-2))
        packed[name] = to_kernel_order(MXTensor(torch.cat([p.codes for p in parts]),
                                                torch.cat([p.scales for p in parts]), "mxfp4", parts[0].block_size,
                                                axis=1, shape=(E, I, O)))
        bf16_weights[name] = torch.cat([dequantize(p, torch.bfloat16) for p in parts])
        parts = w = None
    (w_gu, w_down), (gu, down) = bf16_weights.values(), packed.values()
    gate_half, up_half = (dataclasses.replace(gu, codes=gu.codes[:, cols], scales=gu.scales[:, cols], shape=(E, L, F))
                          for cols in (slice(0, F), slice(F, 2 * F)))
    log(f"\nexpert FFN {L} -> {F} -> {L}, {E} experts: packed MXFP4 (fused producers) against bf16; ms; "
        f"{args.routing} routing")
    log(f"{'tok/exp':>7} {'rows':>6} {'min,max':>9} {'mma order':>9} {'bf16 ms':>8} {'mxfp4 ms':>8} {'ratio':>6} "
        f"{'unfused ms':>10} {'ratio':>6} {'rel err':>8}")
    for tokens in tokens_list:
        R = E * tokens
        x_TL = torch.randn(R, L, device=dev, generator=gen).to(torch.bfloat16)
        order_R = torch.randperm(R, device=dev, generator=gen)
        w_R = torch.rand(R, device=dev, generator=gen)
        if args.routing == "random":
            counts_E = torch.bincount(torch.randint(0, E, (R,), device=dev, generator=gen), minlength=E)
        else:
            counts_E = torch.full((E,), tokens, device=dev)
        groups = ExpertGroups.of(counts_E)
        spread = (int(counts_E.min()), int(counts_E.max()))
        mma = mxfp4_mma_order(R, E, torch.bfloat16, dev)

        def bf16():
            gate_up = torch._grouped_mm(x_TL.index_select(0, order_R), w_gu, offs=groups.offsets_E)
            hidden = situ_glu_fused(gate_up[:, :F], gate_up[:, F:], w_R, torch.bfloat16)
            return torch._grouped_mm(hidden, w_down, offs=groups.offsets_E)

        def mxfp4():
            x_RL = expert_rows_mxfp8(x_TL, order_R, 1, mma_order=mma)
            gate_up = mxfp4_grouped_mm(x_RL, gu, groups, mma_order=mma)
            hidden = situ_glu_mxfp8(gate_up[:, :F], gate_up[:, F:], w_R, mma_order=mma)
            return mxfp4_grouped_mm(hidden, down, groups, mma_order=mma)

        def unfused():
            x_RL = fake_quantize(x_TL.index_select(0, order_R), "mxfp8_e4m3")
            gate = mxfp4_grouped_mm(x_RL, gate_half, groups)
            up = mxfp4_grouped_mm(x_RL, up_half, groups)
            hidden = fake_quantize(situ_glu_cast(gate, up, w_R, torch.bfloat16), "mxfp8_e4m3")
            return mxfp4_grouped_mm(hidden, down, groups)

        with torch.inference_mode():
            y, y_unfused, y_bf16 = mxfp4(), unfused(), bf16()
            # (the same values bit for bit: the producers' kernels compute fake_quantize's and situ_glu_cast's, and
            # the matmuls' columns do not depend on the call's width)
            diff = rel(y_unfused.float(), y.float())
            report.verdict(f"layer:{tokens}:fused_matches_unfused", diff == 0,
                           f"rel_rms {diff:.2e}")
            err = rel(y_bf16.float(), y.float())
            ms_bf16, ms_mx, ms_unfused = timed(bf16), timed(mxfp4), timed(unfused)
        row = {"experts": E, "tokens_per_expert": tokens, "rows": R, "routing": args.routing,
               "rows_an_expert_min_max": spread, "mma_order": mma, "bf16_ms": ms_bf16,
               "mxfp4_ms": ms_mx, "mxfp4_unfused_ms": ms_unfused, "ratio_bf16_over_mxfp4": ms_bf16 / ms_mx,
               "ratio_bf16_over_unfused": ms_bf16 / ms_unfused, "rel_err_vs_bf16": err}
        report.results.setdefault("layer", []).append(row)
        log(f"{tokens:>7} {R:>6} {'%d,%d' % spread:>9} {str(mma):>9} {ms_bf16:>8.4f} {ms_mx:>8.4f} "
            f"{ms_bf16 / ms_mx:>6.2f} "
            f"{ms_unfused:>10.4f} {ms_bf16 / ms_unfused:>6.2f} {err:>8.2e}")


if __name__ == "__main__":
    sys.exit(main())
