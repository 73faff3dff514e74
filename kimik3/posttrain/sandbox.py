"""Running untrusted Python (a model's code) in a subprocess with a timeout and no network.

The interface is one method, ``Sandbox.run(program, stdin, timeout_s) -> RunResult``, with two
backends. ``default_sandbox()`` picks ``AgentEnvSandbox`` where the machine gives what AgentENV needs
(root, namespaces, cgroups, overlayfs: ``kimik3.agentenv``) and ``SubprocessSandbox`` elsewhere, and logs
which one runs (a warning naming what is missing when it falls back to the weaker one). To choose, pass a
backend to the caller (``run_tests(..., sandbox=...)``).

``AgentEnvSandbox`` keeps one AgentENV sandbox as the *trajectory's* sandbox (the environment an agent
works in) and runs each program in a **fork** of it, closed afterwards: judging sees the trajectory's
files and leaves them untouched, and gets the full isolation of ``kimik3.agentenv`` (own user, pid,
mount and network namespaces, read-only base, CPU/memory/process/disk limits). ``SubprocessSandbox``:

* runs ``python -I -S`` (isolated: no user site, no environment variables, no ``site``) in a fresh
  temporary directory, as the leader of a new process group (setsid), all of which is killed at the timeout;
* with no network: in a new user + network namespace (``unshare -rn``) where the kernel allows it,
  else by making ``socket``/``ssl`` unimportable in the program (``NETWORK_BLOCK``: best effort);
* with resource limits set by ``LIMITS`` at the top of the program (address space, CPU seconds, file
  size, open files), and stdout/stderr written to files (a program that floods them hits the file-size
  limit and dies) read back up to ``MAX_OUTPUT`` bytes.

This isolates mistakes and accidents, not a determined adversary (the program runs as this user).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)
MAX_OUTPUT = 1 << 20
LIMITS = """\
import resource as _resource
for _name, _value in (("RLIMIT_AS", 1 << 30), ("RLIMIT_FSIZE", 4 << 20), ("RLIMIT_NOFILE", 64),
                      ("RLIMIT_CPU", {cpu_s})):
    try:
        _resource.setrlimit(getattr(_resource, _name), (_value, _value))
    except (ValueError, OSError, AttributeError):
        pass
del _resource, _name, _value
"""
NETWORK_BLOCK = """\
import sys as _sys
for _name in ("socket", "_socket", "ssl", "_ssl", "select", "selectors", "asyncio"):
    _sys.modules[_name] = None   # `import socket` now raises ImportError
del _sys, _name
"""


@dataclass(slots=True)
class RunResult:
    returncode: int | None      # None when it was killed at the timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


class Sandbox(Protocol):
    def run(self, program: str, stdin: str = "", timeout_s: float = 5.0) -> RunResult: ...


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` can give a child its own (empty) network namespace here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


class SubprocessSandbox:
    """``python -I -S`` in a subprocess: timeout, no network, resource limits (see the module's notes)."""

    def __init__(self, python: str = sys.executable, use_namespace: bool | None = None):
        self.python = python
        self.use_namespace = network_namespace_available() if use_namespace is None else use_namespace

    def run(self, program: str, stdin: str = "", timeout_s: float = 5.0) -> RunResult:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        prelude = LIMITS.format(cpu_s=max(1, int(timeout_s) + 1))
        if not self.use_namespace:
            prelude += NETWORK_BLOCK
        command = [self.python, "-I", "-S", "-c", prelude + program]
        if self.use_namespace:
            command = ["unshare", "-rn", *command]
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="kimik3-sandbox-") as work:
            out_path, err_path = os.path.join(work, ".stdout"), os.path.join(work, ".stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=work,
                                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                           start_new_session=True)
                timed_out = False
                try:
                    process.communicate(stdin.encode("utf-8", "replace"), timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                except (BrokenPipeError, OSError):   # the program exited without reading its input
                    pass
                finally:
                    _kill_group(process)
            return RunResult(None if timed_out else process.returncode, _read(out_path), _read(err_path),
                             timed_out, time.monotonic() - start)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the program and whatever it started (the process group it leads), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _read(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(MAX_OUTPUT).decode("utf-8", "replace")
    except OSError:
        return ""


class AgentEnvSandbox:
    """``Sandbox.run`` on AgentENV: each program runs in a fork of the trajectory's sandbox (see the
    module's notes). ``trajectory``: an ``kimik3.agentenv.Sandbox`` to judge in (default: a fresh one,
    made on first use and closed at exit)."""

    def __init__(self, trajectory=None, limits=None):
        self._trajectory = trajectory
        self._limits = limits
        self._lock = threading.Lock()

    @property
    def trajectory(self):
        with self._lock:
            if self._trajectory is None or self._trajectory.closed:
                from kimik3.agentenv import Limits, Sandbox

                self._trajectory = Sandbox.create(limits=self._limits or Limits(
                    cpus=1.0, memory_bytes=1 << 30, pids=128, disk_bytes=64 << 20, timeout_s=30))
                atexit.register(self._trajectory.close)
            return self._trajectory

    def run(self, program: str, stdin: str = "", timeout_s: float = 5.0) -> RunResult:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        from kimik3.agentenv.isolation import host_python

        start = time.monotonic()
        with self.trajectory.fork() as judge:
            judge.write_file("/tmp/program.py", program)
            result = judge.exec([host_python(), "-I", "-S", "/tmp/program.py"], timeout=timeout_s,
                                stdin=stdin.encode("utf-8", "replace"), max_output=MAX_OUTPUT)
        return RunResult(None if result.timed_out else result.exit_code, result.stdout, result.stderr,
                         result.timed_out, time.monotonic() - start)

    def close(self) -> None:
        with self._lock:
            if self._trajectory is not None:
                self._trajectory.close()


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """The backend for this machine (see the module's notes), made once."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = _pick_backend()
        return _DEFAULT


def _pick_backend() -> Sandbox:
    from kimik3.agentenv import facilities

    missing = facilities.missing()
    if not missing:
        log.info("code sandbox: AgentEnvSandbox (kimik3.agentenv: namespaces, cgroups, overlay; judged in forks)")
        return AgentEnvSandbox()
    log.warning("code sandbox: SubprocessSandbox, weaker isolation: AgentENV is unavailable here (missing: %s)",
                "; ".join(missing))
    return SubprocessSandbox()
