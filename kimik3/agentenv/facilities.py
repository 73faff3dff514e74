"""What the machine must give for AgentENV, probed once: each missing facility is named, never worked around.

``probe()`` -> {facility: None if present, else why not}. ``require()`` raises ``MissingFacility``
listing every missing one (``Sandbox.create`` calls it): there is no silent fallback to weaker isolation.
Tests call ``missing()`` to skip with the names.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import time

from kimik3.agentenv import cgroups
from kimik3.agentenv import syscalls as sc


class MissingFacility(RuntimeError):
    """The machine lacks something a sandbox needs (the message names each thing)."""


def _root() -> str | None:
    return None if os.geteuid() == 0 else f"root (effective uid is {os.geteuid()})"


def _tools() -> str | None:
    missing = [tool for tool in ("nsenter",) if shutil.which(tool) is None]
    return f"util-linux tools not on PATH: {', '.join(missing)}" if missing else None


def _filesystems() -> str | None:
    try:
        with open("/proc/filesystems") as handle:
            names = {line.split()[-1] for line in handle if line.strip()}
    except OSError as err:
        return f"/proc/filesystems unreadable: {err}"
    missing = [name for name in ("overlay", "tmpfs", "proc") if name not in names]
    return f"filesystems not in the kernel: {', '.join(missing)}" if missing else None


def _cgroups() -> str | None:
    missing = cgroups.missing_controllers()
    if not missing:
        return None
    return (f"cgroup v1 controllers not mounted: {', '.join(missing)} (the unified v2 hierarchy is not driven "
            f"by this backend)")


def _namespaces_and_idmap() -> str | None:
    """A user namespace (with a mapping), and an id-mapped detached copy of /usr through it."""
    try:
        with open("/proc/sys/user/max_user_namespaces") as handle:
            if int(handle.read()) == 0:
                return "user namespaces (user.max_user_namespaces is 0)"
    except (OSError, ValueError):
        pass
    if shutil.which("unshare") is None:
        return "util-linux 'unshare' not on PATH (needed to probe user namespaces)"
    try:
        holder = subprocess.Popen(["unshare", "--user", "--pid", "--net", "--mount", "--ipc", "--uts", "--fork",
                                   "--kill-child", "sleep", "30"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
    except OSError as err:
        return f"namespaces: {err}"
    try:
        for _ in range(400):
            if holder.poll() is not None:
                return f"namespaces (unshare -U -p -n -m -i -u failed: {holder.stderr.read().decode().strip()})"
            try:
                if os.readlink(f"/proc/{holder.pid}/ns/user") != os.readlink("/proc/self/ns/user"):
                    break
            except OSError:
                pass
            time.sleep(0.005)
        for name, text in (("uid_map", "0 100000 65536\n"), ("setgroups", "deny"), ("gid_map", "0 100000 65536\n")):
            with open(f"/proc/{holder.pid}/{name}", "w") as handle:
                handle.write(text)
        fd = os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY)
        try:
            os.close(sc.idmapped_tree("/usr", fd))
        except OSError as err:
            return f"id-mapped mounts (open_tree/mount_setattr, Linux >= 5.12): {err}"
        finally:
            os.close(fd)
        return None
    except OSError as err:
        return f"user namespaces: {err}"
    finally:
        holder.kill()
        holder.wait()


def _openat2() -> str | None:
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        os.close(sc.open_in_root(fd, "proc", os.O_PATH))
        return None
    except OSError as err:
        return f"openat2 with RESOLVE_IN_ROOT (Linux >= 5.6): {err}"
    finally:
        os.close(fd)


@functools.cache
def probe() -> dict[str, str | None]:
    if platform.system() != "Linux":
        return {"linux": f"Linux (this is {platform.system()})"}
    found = {"root": _root(), "tools": _tools(), "filesystems": _filesystems(), "cgroups": _cgroups(),
             "openat2": _openat2()}
    found["namespaces"] = _namespaces_and_idmap() if found["root"] is None else "namespaces (needs root to probe)"
    return found


def missing() -> list[str]:
    return [reason for reason in probe().values() if reason]


def require() -> None:
    problems = missing()
    if problems:
        raise MissingFacility("AgentENV sandboxes need, and this machine lacks: " + "; ".join(problems))
