"""One cgroup (v1) per sandbox: its CPU, memory and process-count limits, freezing and CPU accounting.

A sandbox's cgroup sits in each of the ``memory``, ``pids``, ``cpu``, ``cpuacct`` and ``freezer``
hierarchies at ``<this process's cgroup>/kimik3-agentenv/<name>``, so its memory also counts against
whatever limit the caller's own cgroup has. Limits: ``memory.limit_in_bytes`` (the kernel's OOM
killer acts inside the cgroup only, counted in ``memory.oom_control``'s ``oom_kill``), ``pids.max``
(fork fails with EAGAIN past it, counted in ``pids.events``), ``cpu.cfs_quota_us`` over a 100 ms
period (CPU time per wall time). Pausing writes ``FROZEN`` to ``freezer.state``: every task of the
cgroup stops being scheduled (no CPU time is accrued, ``cpuacct.usage`` stands still) until ``THAWED``.

The unified (v2) hierarchy is probed too (``facilities``) but not driven: on the machines this was
built on it holds no memory/pids/cpu controllers, so a v2-only machine is reported as missing the v1
controllers rather than run with weaker limits.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
GROUP = "kimik3-agentenv"
CFS_PERIOD_US = 100_000


def mounted_controllers() -> dict[str, str]:
    """Controller -> mount point of its v1 hierarchy (``cpu,cpuacct`` co-mounts give both)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mounts") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup":
            for option in parts[3].split(","):
                if option in CONTROLLERS:
                    found.setdefault(option, parts[1])
    return found


def own_paths() -> dict[str, str]:
    """Controller -> this process's cgroup path in that hierarchy (from ``/proc/self/cgroup``)."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle.read().splitlines():
            _, names, path = line.split(":", 2)
            for name in names.split(","):
                paths[name] = path
    return paths


def missing_controllers() -> list[str]:
    mounted = mounted_controllers()
    return [name for name in CONTROLLERS if name not in mounted]


@dataclass(frozen=True, slots=True)
class CgroupLimits:
    cpus: float = 1.0                 # CPU time per wall time (1.0 = one core)
    memory_bytes: int = 512 << 20
    pids: int = 256

    def __post_init__(self):
        if not self.cpus > 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus}")
        if self.memory_bytes < (8 << 20):
            raise ValueError(f"memory_bytes must be at least 8 MiB, got {self.memory_bytes}")
        if self.pids < 4:
            raise ValueError(f"pids must be at least 4 (the sandbox's init and a command need some), got {self.pids}")


class Cgroup:
    """The cgroup directories of one sandbox in each controller's hierarchy."""

    def __init__(self, name: str, limits: CgroupLimits):
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad cgroup name {name!r}")
        mounted, own = mounted_controllers(), own_paths()
        missing = [c for c in CONTROLLERS if c not in mounted]
        if missing:
            raise OSError(errno.ENOENT, f"cgroup v1 controllers not mounted: {', '.join(missing)}")
        self.name = name
        self.dirs: dict[str, str] = {}
        for controller in CONTROLLERS:
            parent = os.path.join(mounted[controller], own.get(controller, "/").lstrip("/"), GROUP)
            os.makedirs(parent, exist_ok=True)
            path = os.path.join(parent, name)
            if path not in self.dirs.values():
                os.makedirs(path, exist_ok=True)
            self.dirs[controller] = path
        try:
            self._write("memory", "memory.limit_in_bytes", str(limits.memory_bytes))
            self._write("memory", "memory.swappiness", "0", missing_ok=True)
            self._write("pids", "pids.max", str(limits.pids))
            self._write("cpu", "cpu.cfs_period_us", str(CFS_PERIOD_US))
            self._write("cpu", "cpu.cfs_quota_us", str(max(1000, int(limits.cpus * CFS_PERIOD_US))))
        except OSError:
            self.remove()
            raise

    # -- files ------------------------------------------------------------------------------------------
    def _write(self, controller: str, name: str, value: str, missing_ok: bool = False) -> None:
        try:
            with open(os.path.join(self.dirs[controller], name), "w") as handle:
                handle.write(value)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def _read(self, controller: str, name: str) -> str:
        with open(os.path.join(self.dirs[controller], name)) as handle:
            return handle.read()

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a new process writes its pid into to join every hierarchy."""
        return sorted({os.path.join(path, "cgroup.procs") for path in self.dirs.values()})

    def add(self, pid: int) -> None:
        for path in self.procs_files():
            with open(path, "w") as handle:
                handle.write(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self._read("freezer", "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    # -- state ------------------------------------------------------------------------------------------
    def freeze(self, timeout_s: float = 10.0) -> None:
        self._write("freezer", "freezer.state", "FROZEN")
        deadline = time.monotonic() + timeout_s
        while self._read("freezer", "freezer.state").strip() != "FROZEN":
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.name} did not freeze within {timeout_s} s")
            time.sleep(0.0005)

    def thaw(self) -> None:
        self._write("freezer", "freezer.state", "THAWED")

    def frozen(self) -> bool:
        return self._read("freezer", "freezer.state").strip() != "THAWED"

    def cpu_ns(self) -> int:
        """CPU time used by the cgroup's tasks so far, in ns (``cpuacct.usage``)."""
        return int(self._read("cpuacct", "cpuacct.usage"))

    def memory_bytes(self) -> int:
        return int(self._read("memory", "memory.usage_in_bytes"))

    def memory_stat(self) -> dict[str, int]:
        return {k: int(v) for k, v in (line.split() for line in self._read("memory", "memory.stat").splitlines())}

    def oom_kills(self) -> int:
        for line in self._read("memory", "memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return int(self._read("memory", "memory.failcnt"))

    def fork_failures(self) -> int:
        try:
            for line in self._read("pids", "pids.events").splitlines():
                if line.startswith("max "):
                    return int(line.split()[1])
        except FileNotFoundError:
            pass
        return 0

    def kill_all(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every task, frozen first so none can fork away meanwhile, then wait for them to go."""
        if not os.path.isdir(self.dirs["freezer"]):
            return
        self.freeze()
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.thaw()
        deadline = time.monotonic() + timeout_s
        while self.pids():
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.name}: tasks {self.pids()} outlived SIGKILL for {timeout_s} s")
            time.sleep(0.001)

    def remove(self) -> None:
        """Kill what is left and remove the directories (rmdir of an empty cgroup; retried while the
        kernel finishes tearing down exited tasks)."""
        if "freezer" in self.dirs and os.path.isdir(self.dirs["freezer"]):
            self.kill_all()
        for path in sorted(set(self.dirs.values()), reverse=True):
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as err:
                    if err.errno != errno.EBUSY:
                        raise
                    time.sleep(0.005)
            try:
                os.rmdir(os.path.dirname(path))      # the shared parent, once the last sandbox is gone
            except OSError:
                pass


def sweep_stale(alive=lambda pid: os.path.exists(f"/proc/{pid}")) -> list[str]:
    """Remove sandbox cgroups left behind by managers that died (names start ``<manager pid>-``)."""
    removed = []
    mounted, own = mounted_controllers(), own_paths()
    for controller, mount_point in mounted.items():
        if controller not in CONTROLLERS:
            continue
        parent = os.path.join(mount_point, own.get(controller, "/").lstrip("/"), GROUP)
        if not os.path.isdir(parent):
            continue
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            owner = name.split("-", 1)[0]
            if not (os.path.isdir(path) and owner.isdigit()) or alive(int(owner)):
                continue
            if controller == "freezer":
                _kill_tasks(path)
            try:
                os.rmdir(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def _kill_tasks(path: str) -> None:
    try:
        with open(os.path.join(path, "freezer.state"), "w") as handle:
            handle.write("THAWED")
        with open(os.path.join(path, "cgroup.procs")) as handle:
            for pid in handle.read().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
    except OSError:
        pass
