"""Where ``torch.compile`` breaks the model's blocks, and what compiling them buys a training step.

  python benchmarks/compile_probe.py [--preset debug] [--device cuda] [--batch 4] [--seq-len 4096] [--json F]

For each kind of block (mixer x FFN) the first such block of the model goes through ``torch._dynamo.explain`` on a
training-shaped input (the forward; AOTAutograd traces the backward with it): its graph count, graph breaks and
their reasons with where in our code they happen (deduplicated). Then the whole model's forward + backward (no
optimizer) is timed eagerly and with every block compiled (``kimik3.parallel.compile``, what ``kimik3 train
--compile`` does; the first compiled step's time reported apart), from the same weights on the same batch, with
the two losses. A trace or a compile that fails is reported (its first line) and the probe goes on. Defaults:
the ``debug`` preset in bf16 on CUDA at 4 x 4,096 tokens; on the CPU the ``tiny`` preset in fp32 at 4 x 256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed
import kimik3  # noqa: E402
from kimik3 import K3Config, K3ForCausalLM  # noqa: E402
from kimik3.parallel.compile import apply_compile  # noqa: E402


def first_line(error: object) -> str:
    """The first line of an exception's (or a break reason's) text, with the next when it ends in a colon (a
    wrapped error: "backend='inductor' raised:"), at most 300 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] + [""]
    return (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") else lines[0])[:300]


PACKAGE = Path(kimik3.__file__).resolve().parent


def where(reason: object) -> str:
    """file:line (relative to the package) of the innermost frame in the kimik3 package where a graph break
    happened."""
    for frame in reversed(getattr(reason, "user_stack", None) or []):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(PACKAGE):
            return f"{path.relative_to(PACKAGE)}:{frame.lineno} ({(frame.line or '').strip()[:80]})"
    return "?"


def block_inputs(model: K3ForCausalLM, index: int, ids: torch.Tensor) -> tuple:
    """The stream and AttnRes entries block ``index`` sees in the model's forward on ``ids`` (no grad)."""
    with torch.no_grad():
        stream, entries = model.embed(ids), []
        for block in model.layers[:index]:
            stream, entries = block(stream, entries)
    return stream.detach().requires_grad_(), [e.detach() for e in entries]


def explain_blocks(model: K3ForCausalLM, ids: torch.Tensor) -> list[dict]:
    """Dynamo's view of the first block of each (mixer, FFN) kind: graphs, breaks, reasons."""
    import torch._dynamo

    seen, rows = set(), []
    for index, block in enumerate(model.layers):
        kind = (block.spec.mixer, block.spec.ffn, block.spec.opens_block, index == 0)
        if kind in seen:
            continue
        seen.add(kind)
        stream, entries = block_inputs(model, index, ids)
        torch._dynamo.reset()

        def forward(stream, entries, block=block):   # the backward is AOTAutograd's: traced with the forward
            return block(stream, entries)[0]

        row = {"layer": index, "mixer": block.spec.mixer, "ffn": block.spec.ffn}
        try:
            report = torch._dynamo.explain(forward)(stream, entries)
        except Exception as error:   # a trace that fails is a finding too: its first line, and go on
            row["error"] = f"{type(error).__name__}: {first_line(error)}"
            rows.append(row)
            print(f"layer {index} ({block.spec.mixer} + {block.spec.ffn}): tracing failed: {row['error']}", flush=True)
            continue
        reasons = sorted({f"{first_line(getattr(b, 'reason', b))} at {where(b)}" for b in report.break_reasons})
        row.update(graphs=report.graph_count, graph_breaks=report.graph_break_count, reasons=reasons)
        rows.append(row)
        print(f"layer {index} ({block.spec.mixer} + {block.spec.ffn}): {report.graph_count} graph(s), "
              f"{report.graph_break_count} break(s)", flush=True)
        for reason in reasons:
            print(f"    {reason}", flush=True)
    torch._dynamo.reset()
    return rows


def time_steps(model: K3ForCausalLM, ids: torch.Tensor, steps: int) -> tuple[float, float, float]:
    """(first step's seconds, mean seconds of ``steps`` more, the loss) of forward + backward on ``ids``."""
    def sync():
        if ids.is_cuda:
            torch.cuda.synchronize()

    def one() -> float:
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return float(out.main_loss)

    sync()
    start = time.perf_counter()
    loss = one()
    sync()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        one()
    sync()
    return first, (time.perf_counter() - start) / steps, loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first (default 5)")
    parser.add_argument("--no-explain", action="store_true", help="only the timing")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    preset = args.preset or ("debug" if cuda else "tiny")
    seq_len = args.seq_len or (4096 if cuda else 256)
    config = K3Config.preset(preset)
    model = K3ForCausalLM(config, seed=0).to(args.device)
    if cuda:
        model = model.cast(torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (args.batch, seq_len + 1), device=args.device,
                        generator=torch.Generator(device=args.device).manual_seed(0))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "preset": preset, "batch": args.batch, "seq_len": seq_len}
    if not args.no_explain:
        result["blocks"] = explain_blocks(model, ids[:, :-1])
    first, eager, loss = time_steps(model, ids, args.steps)
    result["eager"] = {"first_s": first, "ms_per_step": eager * 1e3, "loss": loss}
    print(f"eager: {eager * 1e3:.1f} ms forward + backward (first {first:.1f} s), loss {loss:.6f}", flush=True)
    apply_compile(model)
    try:
        first, compiled, loss = time_steps(model, ids, args.steps)
        result["compiled_blocks"] = {"first_s": first, "ms_per_step": compiled * 1e3, "loss": loss,
                                     "speedup": eager / compiled}
        print(f"blocks compiled: {compiled * 1e3:.1f} ms (first {first:.1f} s), loss {loss:.6f}, "
              f"{eager / compiled:.2f}x eager", flush=True)
    except Exception as error:
        result["compiled_blocks"] = {"error": f"{type(error).__name__}: {first_line(error)}"}
        print(f"blocks compiled: failed: {result['compiled_blocks']['error']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
