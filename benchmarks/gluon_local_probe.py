"""Phases A-C of the KDA forward in one Gluon kernel (``kimik3/ops/kda/gluon_local.py``) against the split kernels it
replaces, at K3's per-layer shape on the H200: each setting of the kernel's knobs checked against the split kernels
(relative RMS of Aqk, T, W, U, qg, kg; not for ablations, whose results are wrong by design) and timed alone
(``do_bench`` median), the split kernels' three launches timed in the same run.

    python benchmarks/gluon_local_probe.py [--try "ABLATE=1,MAXNREG=None+CTAS_PER_SM=1"] [--out DIR]

Each comma-separated entry of --try is one setting: '+'-joined ATTR=value overrides of ``gluon_local``'s module
knobs (RING, CONSUMER_WARPS, MAXNREG, CTAS_PER_SM, ABLATE); the default setting is always timed first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import bench, log, rel  # noqa: E402


def parse_setting(text: str) -> dict:
    """'ABLATE=1+MAXNREG=None' -> {'ABLATE': 1, 'MAXNREG': None}."""
    from kimik3.ops.kda import gluon_local

    out = {}
    for part in filter(None, text.split("+")):
        name, sep, value = part.partition("=")
        if not sep or not hasattr(gluon_local, name):
            raise SystemExit(f"--try: {part!r} is not ATTR=value for a knob of gluon_local")
        out[name] = {"None": None, "True": True, "False": False}.get(value, value)
        if isinstance(out[name], str):
            out[name] = int(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--try", dest="settings", default="")
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--H", type=int, default=96)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gluon_local_probe.py times the kernel on an sm_90 GPU")
    import triton.language as tl

    from kimik3.ops.kda import gluon_local
    from kimik3.ops.kda import triton_forward as tf

    T, H, K = a.T, a.H, 128
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    plan = tf.make_plan(1, T, None, dev)
    q, k, v = (torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, device=dev), dim=-1).bfloat16()
               for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=gen, device=dev) * 1.5)
    G = g.view(1, T // 64, 64, H, K).cumsum(2).view(1, T, H, K).contiguous()
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen, device=dev))

    def outputs():
        m = lambda: torch.empty(plan.NT, H, 64, 64, device=dev)  # noqa: E731
        return (m(), m(), torch.empty_like(q), torch.empty(1, T, H, K, device=dev), torch.empty_like(q),
                torch.empty_like(q), torch.empty(plan.NT, H, K, device=dev))

    ref = outputs()

    def split():  # the three kernels the forward runs (at this size: Triton phase A and solve, Gluon phase C)
        tf._launch_split_intra(q, k, v, G, beta, *ref, plan, H, K, K, K, 64, 64, tl.bfloat16, tl.bfloat16, "tf32",
                               "tf32")

    split()
    rows = [{"setting": "split kernels (phase A, solve, Gluon phase C)", "ms": bench(split)}]
    log(f"split: {rows[0]['ms']:.3f} ms")
    defaults = {name: getattr(gluon_local, name) for name in ("RING", "CONSUMER_WARPS", "MAXNREG", "CTAS_PER_SM",
                                                               "ABLATE")}
    for text in [""] + [t for t in a.settings.split(",") if t]:
        setting = parse_setting(text)
        for name, value in {**defaults, **setting}.items():
            setattr(gluon_local, name, value)
        out = outputs()
        row = {"setting": text or "default", "store_t": False}
        try:
            fn = lambda: gluon_local.launch(q, k, v, G, beta, *out, plan, H, False)  # noqa: E731
            fn()
            row["ms"] = bench(fn)
            gluon_local.launch(q, k, v, G, beta, *out, plan, H, True)
            torch.cuda.synchronize()
            if not setting.get("ABLATE"):
                row["rel"] = {n: rel(r.float(), o.float()) for n, r, o in
                              zip(("aqk", "T", "w", "u", "qg", "kg", "eg"), ref, out)}
        except Exception as exc:  # noqa: BLE001  (a setting that fails to compile or run is reported, not fatal)
            row["error"] = repr(exc)[:500]
        log(json.dumps(row))
        rows.append(row)
    for name, value in defaults.items():
        setattr(gluon_local, name, value)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gluon_local_probe.json"), "w") as f:
            json.dump({"shape": f"B1 T{T} H{H} D{K}", "device": torch.cuda.get_device_name(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
