"""AgentENV on this machine: resume and fork latency, checkpoint size/time, paused CPU, eviction memory,
and the copy-on-write overcommit ratio (anchors: 49 ms resume, 6.5x overcommit, for Firecracker).

    sudo nice python benchmarks/agentenv.py [--repeats 50] [--sandboxes 8] [--budget-mib 1024]

Needs what ``kimik3.agentenv`` needs (root, namespaces, cgroup v1, overlayfs); prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from kimik3.agentenv import Limits, Sandbox, facilities
from kimik3.agentenv.isolation import host_python
from kimik3.agentenv.pool import SandboxPool
from kimik3.agentenv.zygote import Zygote

MIB = 1 << 20
PRELOAD = "import numpy\ntable = [str(i) * 4 for i in range(400_000)]\nmatrix = numpy.ones((1000, 1000))\n"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def resume_latency(store: str, repeats: int) -> dict:
    limits = Limits(memory_bytes=256 * MIB, disk_bytes=64 * MIB)
    with Sandbox.create(limits=limits, store=store) as sandbox:
        sandbox.exec(f"nohup setsid {host_python()} -c 'import time\nwhile True: time.sleep(0.01)' >/dev/null 2>&1 &")
        thaw, first_exec = [], []
        for _ in range(repeats):
            sandbox.pause()
            time.sleep(0.01)
            start = time.perf_counter()
            sandbox.resume()
            thaw.append(time.perf_counter() - start)
            sandbox.exec(["true"])
            first_exec.append(time.perf_counter() - start)
    return {"thaw": thaw, "thaw+exec": first_exec}


def evicted_resume(store: str, repeats: int) -> list[float]:
    with SandboxPool(memory_budget=1 << 40, store=store, limits=Limits(memory_bytes=256 * MIB)) as pool:
        key = pool.create()
        with pool.use(key) as sandbox:
            sandbox.exec("mkdir -p /work/repo && for i in $(seq 200); do echo line $i > /work/repo/f$i; done")
        times = []
        for _ in range(repeats):
            pool.evict(key)
            times.append(pool.resume_seconds(key))
    return times


def fork_latency(store: str, repeats: int) -> dict:
    out = {}
    with Sandbox.create(limits=Limits(memory_bytes=512 * MIB, disk_bytes=256 * MIB), store=store) as sandbox:
        for label, command in (("small layer (200 files, 2 KB)", "mkdir -p /work/r && for i in $(seq 200); do "
                                "echo $i > /work/r/f$i; done"),
                               ("large layer (+50 MB)", "head -c 50000000 /dev/urandom > /work/big")):
            sandbox.exec(command)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                child = sandbox.fork()
                times.append(time.perf_counter() - start)
                child.close()
            out[label] = times
    return out


def checkpoints(store: str) -> list[tuple[str, int, float]]:
    rows = []
    with Sandbox.create(limits=Limits(memory_bytes=512 * MIB, disk_bytes=256 * MIB), store=store) as sandbox:
        sandbox.exec("head -c 50000000 /dev/urandom > /work/data; mkdir /work/src; "
                     "for i in $(seq 500); do echo code $i > /work/src/m$i.py; done")
        sandbox.checkpoint()
        first = sandbox.last_checkpoint
        rows.append(("first (50 MB + 500 files)", first.bytes_written, first.seconds))
        sandbox.exec("echo edit >> /work/src/m7.py")
        info = sandbox.last_checkpoint if sandbox.checkpoint() else None
        rows.append(("after a small change (1 line)", info.bytes_written, info.seconds))
        sandbox.exec("head -c 30000000 /dev/urandom > /work/data2")
        sandbox.checkpoint()
        info = sandbox.last_checkpoint
        rows.append(("after a large change (+30 MB)", info.bytes_written, info.seconds))
    return rows


def paused_cpu(store: str, count: int, seconds: float) -> tuple[int, int]:
    sandboxes = [Sandbox.create(limits=Limits(memory_bytes=128 * MIB, cpus=0.2), store=store) for _ in range(count)]
    try:
        for sandbox in sandboxes:
            sandbox.exec("nohup setsid sh -c 'while :; do :; done' >/dev/null 2>&1 &")
        time.sleep(0.3)
        running0 = sum(s.cpu_ns() for s in sandboxes)
        time.sleep(seconds / 2)
        running = sum(s.cpu_ns() for s in sandboxes) - running0
        for sandbox in sandboxes:
            sandbox.pause()
        paused0 = sum(s.cpu_ns() for s in sandboxes)
        time.sleep(seconds)
        paused = sum(s.cpu_ns() for s in sandboxes) - paused0
    finally:
        for sandbox in sandboxes:
            sandbox.close()
    return running, paused


def eviction_memory(store: str, count: int) -> dict:
    limits = Limits(memory_bytes=256 * MIB, disk_bytes=64 * MIB)
    with SandboxPool(memory_budget=1 << 40, store=store, limits=limits) as pool:
        keys = [pool.create() for _ in range(count)]
        for key in keys:
            with pool.use(key) as sandbox:
                sandbox.exec(f"head -c 8000000 /dev/urandom > /work/state.bin; nohup setsid {host_python()} -c "
                             "'import time; x = bytearray(20 << 20); x[::4096] = b\"1\" * len(x[::4096]); "
                             "time.sleep(1e6)' >/dev/null 2>&1 & sleep 0.3")
        paused = pool.live_memory()
        disk0 = pool.store.size_bytes()
        start = time.perf_counter()
        for key in keys:
            pool.evict(key)
        evict_s = time.perf_counter() - start
        return {"paused": paused, "evicted": pool.live_memory(), "disk": pool.store.size_bytes() - disk0,
                "count": count, "evict_s": evict_s}


def overcommit(store: str, count: int, budget: int) -> dict:
    limits = Limits(memory_bytes=512 * MIB, disk_bytes=64 * MIB, pids=64)
    probe = "x = sum(range(1000)); print(len(table), matrix.shape[0])"
    separate, shared = [], []
    sandboxes = [Sandbox.create(limits=limits, store=store) for _ in range(count)]
    try:
        for sandbox in sandboxes:                  # without sharing: each starts its own interpreter
            script = PRELOAD + f"{probe}\nopen('/work/ready', 'w').write('1')\nimport time\ntime.sleep(1e6)\n"
            sandbox.write_file("/work/repl.py", script)
            sandbox.exec(f"nohup setsid {host_python()} /work/repl.py >/dev/null 2>/work/repl.err &")
        for sandbox in sandboxes:
            deadline = time.monotonic() + 60
            while True:
                try:
                    sandbox.read_file("/work/ready")
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("a REPL did not load: " + sandbox.read_file("/work/repl.err").decode())
                    time.sleep(0.1)
        time.sleep(0.5)
        separate = [s.memory_bytes() for s in sandboxes]
    finally:
        for sandbox in sandboxes:
            sandbox.close()
    sandboxes = [Sandbox.create(limits=limits, store=store) for _ in range(count)]
    repls = []
    try:
        with Zygote(PRELOAD) as zygote:
            zygote_rss = zygote.rss_bytes()
            for sandbox in sandboxes:              # with sharing: REPLs forked from one preloaded zygote
                repl = zygote.spawn(sandbox)
                repl.run(probe)
                repls.append(repl)
            time.sleep(0.5)
            shared = [s.memory_bytes() for s in sandboxes]
            for repl in repls:
                repl.close()
    finally:
        for sandbox in sandboxes:
            sandbox.close()
    # the first separate sandbox is also charged the page cache of the files every interpreter reads
    per_separate = statistics.median(separate)
    per_shared = statistics.median(shared)
    fit_separate = int(budget // per_separate)
    fit_shared = int((budget - zygote_rss) // per_shared)
    return {"per_separate": per_separate, "per_shared": per_shared, "zygote": zygote_rss,
            "fit_separate": fit_separate, "fit_shared": fit_shared, "ratio": fit_shared / max(fit_separate, 1),
            "count": count, "budget": budget}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sandboxes", type=int, default=8)
    parser.add_argument("--budget-mib", type=int, default=1024)
    args = parser.parse_args(argv)
    missing = facilities.missing()
    if missing:
        print("AgentENV cannot run here: " + "; ".join(missing), file=sys.stderr)
        return 2
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-") as store:
        lat = resume_latency(store, args.repeats)
        for label, values in lat.items():
            rows.append((f"resume of a paused sandbox ({label}) p50 / p99",
                         f"{ms(pct(values, 0.5))} / {ms(pct(values, 0.99))}"))
        ev = evicted_resume(store, max(5, args.repeats // 5))
        rows.append(("resume of an evicted sandbox (restore from disk) p50 / p99",
                     f"{ms(pct(ev, 0.5))} / {ms(pct(ev, 0.99))}"))
        for label, values in fork_latency(store, max(5, args.repeats // 5)).items():
            rows.append((f"fork, {label} p50 / p99", f"{ms(pct(values, 0.5))} / {ms(pct(values, 0.99))}"))
        for label, size, seconds in checkpoints(store):
            rows.append((f"checkpoint {label}", f"{size / 1e6:.3f} MB in {ms(seconds)}"))
        running, paused = paused_cpu(store, 4, 2.0)
        rows.append(("CPU of 4 spinning sandboxes (cpus=0.2 each), 1 s running / 2 s paused",
                     f"{running / 1e6:.1f} ms / {paused / 1e6:.3f} ms"))
        em = eviction_memory(store, 6)
        rows.append((f"memory of {em['count']} paused sandboxes (20 MB process + 8 MB files each)",
                     f"{em['paused'] / MIB:.1f} MiB"))
        rows.append(("... after checkpoint-to-disk eviction (memory / disk written / time)",
                     f"{em['evicted'] / MIB:.1f} MiB / {em['disk'] / MIB:.1f} MiB / {em['evict_s']:.2f} s"))
        oc = overcommit(store, args.sandboxes, args.budget_mib * MIB)
        rows.append(("Python REPL (numpy + 400k-string list), per sandbox: own interpreter / zygote fork",
                     f"{oc['per_separate'] / MIB:.1f} MiB / {oc['per_shared'] / MIB:.1f} MiB "
                     f"(+ zygote {oc['zygote'] / MIB:.0f} MiB once)"))
        rows.append((f"live REPL sandboxes in {args.budget_mib} MiB: without / with sharing (overcommit)",
                     f"{oc['fit_separate']} / {oc['fit_shared']} = {oc['ratio']:.1f}x (anchor 6.5x)"))
    width = max(len(r[0]) for r in rows)
    print(f"{'AgentENV (namespaces + cgroup v1 + overlayfs)':<{width}}  value")
    print("-" * (width + 40))
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
