"""Run the Triton KDA forward + backward (``chunk_kda(backend="triton")``) on a list of shapes, one process per case.

A kernel that faults on the GPU (an illegal address) poisons the CUDA context of its process, so a
test run stops telling anything after the first one. This script gives every case its own process with
``CUDA_LAUNCH_BLOCKING=1`` and reports, per case: PASS (outputs, final state and every gradient match
the torch chunk path within 1e-3 relative RMS, 2e-2 in bf16), FAIL (numbers differ) or CRASH (with the last
kimik3 source line of the traceback, i.e. which launch surfaced it)::

    python3 benchmarks/kda_gpu_probe.py                 # the default cases below
    python3 benchmarks/kda_gpu_probe.py K=128,V=16 K=100,V=32,lens=1/3/64/65

A case is a comma list of ``key=value``: K, V, H, T (defaults 100, 16, 1, 65), ``lens`` (varlen: the
segment lengths joined by ``/``, e.g. ``lens=1/1/3/64/65/2``; T is then their sum) and ``dtype`` (float32 |
bfloat16). The default cases cover head sizes that are not powers of two, narrow V blocks, K3's head size in
both dtypes and short varlen segments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

DEFAULT_CASES = [
    "K=100,V=16",                   # K not a power of two, 16-column V blocks
    "K=128,V=16",                   # 16-column V blocks, K a power of two
    "K=100,V=32",
    "K=130,V=40",
    "K=16,V=16,H=2,lens=1/3/63/64/65/2",
    "K=128,V=128,H=4,T=200",        # K3's head size
    "K=128,V=128,H=4,T=200,dtype=bfloat16",
]
KEYS = {"K": int, "V": int, "H": int, "T": int, "lens": str, "dtype": str}


def parse_case(text: str) -> dict:
    case = {"K": 100, "V": 16, "H": 1, "T": 65, "lens": "", "dtype": "float32"}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in KEYS:
            raise SystemExit(f"bad case item {part!r} in {text!r}: expected key=value with key in {sorted(KEYS)}")
        try:
            case[key] = KEYS[key](value)
        except ValueError:
            raise SystemExit(f"bad value in {part!r} of {text!r}: {key} takes {KEYS[key].__name__}") from None
    if case["dtype"] not in ("float32", "bfloat16"):
        raise SystemExit(f"{text!r}: dtype takes float32 or bfloat16")
    if case["lens"]:
        try:
            lens = [int(x) for x in case["lens"].split("/")]
        except ValueError:
            raise SystemExit(f"{text!r}: lens takes segment lengths joined by '/', e.g. lens=1/3/64") from None
        case["T"] = sum(lens)
    return case


def run_case(text: str) -> dict:
    """In the child process: one forward + backward, compared with the torch chunk path."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import torch

    from kimik3.ops.kda import chunk_kda

    c = parse_case(text)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1 (the CI smoke test)
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator(device="cpu").manual_seed(c["K"] * 1000 + c["V"])
    B, T, H, K, V = 1, c["T"], c["H"], c["K"], c["V"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    q, v = rnd(B, T, H, K), rnd(B, T, H, V)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    g = -torch.rand(B, T, H, K, generator=gen).to(dev) * 5.0
    beta = torch.rand(B, T, H, generator=gen).to(dev)
    lens = [int(x) for x in c["lens"].split("/")] if c["lens"] else [T]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    N = len(lens)
    h0 = rnd(N, H, K, V, scale=0.1)
    do, dht = rnd(B, T, H, V), rnd(N, H, K, V)

    def fwd_bwd(backend: str):
        xs = [x.to(dtype).clone().requires_grad_() for x in (q, k, v, g, beta)] + [h0.clone().requires_grad_()]
        o, s = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, backend=backend,
                         cu_seqlens=cu if c["lens"] else None)
        grads = torch.autograd.grad((o.float() * do).sum() + (s * dht).sum(), xs)
        if dev == "cuda":
            torch.cuda.synchronize()
        return [o.float(), s.float()] + [x.float() for x in grads]

    got = fwd_bwd("triton")
    ref = fwd_bwd("torch")
    names = ["o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = {n: float(((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item())
            for n, a, b in zip(names, got, ref)}
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    return {"case": text, "status": "PASS" if max(errs.values()) < tol else "FAIL", "rel_rms": errs}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        print("RESULT " + json.dumps(run_case(argv[1])), flush=True)
        return 0
    cases = argv or DEFAULT_CASES
    for text in cases:
        parse_case(text)  # reject a bad case before any process starts
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    results, failed = [], 0
    for i, text in enumerate(cases, 1):
        t0 = time.time()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", text], env=env,
                           capture_output=True, text=True)
        out = p.stdout + p.stderr
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode == 0 and line:
            res = json.loads(line[len("RESULT "):])
        else:
            frames = [x.strip() for x in out.splitlines() if "kimik3/" in x and 'File "' in x]
            last = [x for x in out.splitlines() if x.strip()][-1:] or ["(no output)"]
            res = {"case": text, "status": "CRASH", "error": last[0][:300], "surfaced_at": frames[-1:]}
        res["seconds"] = round(time.time() - t0, 1)
        failed += res["status"] != "PASS"
        results.append(res)
        detail = (" ".join(f"{k} {v:.1e}" for k, v in res["rel_rms"].items()) if "rel_rms" in res
                  else f"{res['error']} | surfaced at {res['surfaced_at']}")
        print(f"[{i}/{len(cases)}] {res['status']:5s} {text}  ({res['seconds']} s)  {detail}", flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "kda_gpu_probe.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"{len(cases) - failed} of {len(cases)} cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
