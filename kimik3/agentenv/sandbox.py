"""The AgentENV sandbox: create, exec, files, pause/resume, fork, checkpoint/restore, close.

``Sandbox.create(image=None)`` starts an isolated root (``isolation``: its own user, mount, pid, net,
IPC, UTS and cgroup namespaces; an overlay of a read-only base image with a private writable layer on
a size-limited tmpfs; a cgroup with CPU, memory and process-count limits). On it:

* ``exec(cmd, timeout=..., stdin=None)`` runs a shell string (``/bin/sh -c``) or an argv list inside,
  as the sandbox's root, in ``/work``; returns an ``ExecResult`` (``exit_code``, ``stdout``, ``stderr``
  decoded as UTF-8 with replacement, the raw bytes, ``timed_out``, and whether the memory or process
  limit was hit). The command leads a new process group (setsid); at the timeout every process whose
  setsid id is the command's is killed (one that called setsid itself is a daemon of the sandbox and lives
  on until ``close``). Output past ``max_output`` bytes is
  read and dropped (``truncated``), so a flood cannot fill the manager's memory.
* ``write_file``/``read_file`` work from the host on the sandbox's root with every path resolved inside
  it (``openat2`` + ``RESOLVE_IN_ROOT``: a symlink the sandbox planted cannot point the host outside),
  also while paused.
* ``pause()`` freezes the cgroup (no CPU time at all until ``resume()``, which thaws it).
* ``fork()`` is a new sandbox whose writable layer is a copy of this one's, taken while this one is
  frozen (the base image is shared, not copied). Processes are not forked: the child starts with a
  fresh pid 1 (no process checkpointing works here, see ``docs/agentenv.md``).
* ``checkpoint()`` stores the writable layer incrementally (``layers.CheckpointStore``) and returns its
  id; ``restore(id)`` replaces the sandbox with one whose layer is that checkpoint's (processes are
  not kept: files are).

Missing facilities (not root, no user namespaces, cgroup controllers, overlayfs, id-mapped mounts,
``openat2``, ``nsenter``) raise ``MissingFacility`` at ``create``, naming each one (``facilities``).
"""

from __future__ import annotations

import atexit
import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kimik3.agentenv import facilities, isolation, layers
from kimik3.agentenv import syscalls as sc
from kimik3.agentenv.cgroups import Cgroup, CgroupLimits, sweep_stale
from kimik3.agentenv.image import plan_parts
from kimik3.agentenv.network import LoopbackForwarder, parse_allow

log = logging.getLogger(__name__)

DEFAULT_BASE_DIR = os.path.join(tempfile.gettempdir(), "kimik3-agentenv")   # ``base_dir=`` puts it elsewhere
MAX_OUTPUT = 1 << 20
MAX_READ = 64 << 20
SETPRIV = "/usr/bin/setpriv"
# Capabilities (inside the sandbox's user namespace) a command keeps: file ownership and permission
# overrides, setuid/setgid, kill, binding low ports. Not: sys_admin, sys_chroot, net_admin, ptrace, ...
KEEP_CAPS = "+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,+net_bind_service,+audit_write"
_counter = iter(range(1, 1 << 62))
_counter_lock = threading.Lock()


_process_stores: dict[str, layers.CheckpointStore] = {}


def _process_store(base_dir: str) -> layers.CheckpointStore:
    """The checkpoint store of the sandboxes this process creates without one: ``checkpoints-<pid>`` under
    ``base_dir``, removed when the process exits (its sandboxes end with it). Stores that processes which
    are gone left behind (killed before their exit handlers ran) are removed on the way."""
    with _counter_lock:
        if base_dir not in _process_stores:
            for entry in os.listdir(base_dir):
                pid = entry.removeprefix("checkpoints-")
                if entry.startswith("checkpoints-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    shutil.rmtree(os.path.join(base_dir, entry), ignore_errors=True)
            directory = os.path.join(base_dir, f"checkpoints-{os.getpid()}")
            _process_stores[base_dir] = layers.CheckpointStore(directory)
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        return _process_stores[base_dir]


class SandboxError(RuntimeError):
    """A sandbox operation that cannot be done in the sandbox's state (closed, paused for exec, ...)."""


@dataclass(frozen=True, slots=True)
class Limits:
    cpus: float = 1.0                  # CPU time per wall time
    memory_bytes: int = 512 << 20      # anonymous + page cache + the tmpfs layer
    pids: int = 256                    # processes and threads
    disk_bytes: int = 256 << 20        # the writable layer
    timeout_s: float = 30.0            # default wall time of one exec

    def __post_init__(self):
        CgroupLimits(self.cpus, self.memory_bytes, self.pids)
        if self.disk_bytes < (1 << 20):
            raise ValueError(f"disk_bytes must be at least 1 MiB, got {self.disk_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(slots=True)
class ExecResult:
    exit_code: int | None          # None when killed at the timeout; -N when killed by signal N
    stdout: str
    stderr: str
    timed_out: bool = False
    seconds: float = 0.0
    truncated: bool = False        # more than max_output bytes on a stream (the rest was dropped)
    oom_killed: bool = False       # the memory limit's OOM killer acted during this exec
    pids_limited: bool = False     # a fork failed at the process-count limit during this exec
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)


class Sandbox:
    """One isolated sandbox (see the module's notes); use ``Sandbox.create``."""

    def __init__(self, *, name: str, image: str | None, limits: Limits, base_dir: str,
                 store: layers.CheckpointStore, allow: tuple, parts: tuple):
        self.name, self.image, self.limits, self.base_dir = name, image, limits, base_dir
        self.store, self.allow, self.parts = store, allow, parts
        self.cgroup: Cgroup | None = None
        self._started: isolation.Started | None = None
        self._root_fd = -1
        self._forwarder: LoopbackForwarder | None = None
        self._cache: dict[str, tuple] = {}
        self.last_checkpoint: layers.CheckpointInfo | None = None
        self._lock = threading.RLock()
        self.closed = False
        self._mountpoint = os.path.join(base_dir, "run", name)

    # -- creation ---------------------------------------------------------------------------------------
    @classmethod
    def create(cls, image: str | None = None, *, limits: Limits | None = None, allow: Sequence = (),
               base_dir: str | None = None, store: layers.CheckpointStore | str | None = None) -> Sandbox:
        """A new running sandbox on ``image`` (``None``: the host's system read-only, see ``image``).
        ``allow``: loopback services of the host the sandbox may reach, as ``port`` or ``(port, host_port)``
        (the sandbox connects to ``127.0.0.1:port``, forwarded to the host's ``127.0.0.1:host_port``)."""
        facilities.require()
        base_dir = os.path.abspath(base_dir or DEFAULT_BASE_DIR)
        os.makedirs(os.path.join(base_dir, "run"), exist_ok=True)
        if not isinstance(store, layers.CheckpointStore):
            store = layers.CheckpointStore(store) if store else _process_store(base_dir)
        sandbox = cls(name=_new_name(), image=image, limits=limits or Limits(), base_dir=base_dir, store=store,
                      allow=parse_allow(allow), parts=plan_parts(image, base_dir))
        sandbox._boot(None)
        return sandbox

    def _boot(self, populate) -> None:
        """Start the namespaces/cgroup/overlay of this sandbox (its layer filled by ``populate``)."""
        try:
            self.cgroup = Cgroup(self.name, CgroupLimits(self.limits.cpus, self.limits.memory_bytes,
                                                         self.limits.pids))
            os.makedirs(self._mountpoint, exist_ok=True)
            plan = isolation.Plan(name=self.name, parts=self.parts, layer_mountpoint=self._mountpoint,
                                  cgroup_procs=tuple(self.cgroup.procs_files()), disk_bytes=self.limits.disk_bytes,
                                  python=isolation.host_python())
            self._started = isolation.start(plan, populate)
            self._root_fd = os.open(f"/proc/{self._started.init_pid}/root", os.O_PATH | os.O_DIRECTORY)
            if self.allow:
                self._forwarder = LoopbackForwarder(self._started.init_pid, self.allow)
        except BaseException:
            self._teardown()
            raise

    # -- exec -------------------------------------------------------------------------------------------
    def exec(self, cmd: str | Sequence[str], timeout: float | None = None, stdin: bytes | str | None = None,
             env: dict[str, str] | None = None, max_output: int = MAX_OUTPUT) -> ExecResult:
        """Run ``cmd`` (a shell string or an argv list) inside; see the module's notes."""
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd]
        elif isinstance(cmd, Sequence) and cmd and all(isinstance(a, str) for a in cmd):
            argv = list(cmd)
        else:
            raise TypeError(f"cmd must be a shell string or a non-empty list of strings, got {cmd!r}")
        if any("\0" in a for a in argv):
            raise ValueError("cmd contains a NUL character")
        timeout = self.limits.timeout_s if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        with self._lock:
            self._check_running("exec")
            oom0, forks0 = self.cgroup.oom_kills(), self.cgroup.fork_failures()
            command = ["nsenter", f"--target={self._started.init_pid}", "--user", "--mount", "--pid", "--net",
                       "--ipc", "--uts", "--cgroup", "--root", "--wd", "--", SETPRIV, "--no-new-privs",
                       f"--bounding-set=-all,{KEEP_CAPS}", "--", *argv]
            procs = self.cgroup.procs_files()
            environment = {"PATH": isolation.PATH + ":" + os.path.dirname(isolation.host_python()),
                           "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb", **(env or {})}
            start = time.monotonic()
            process = subprocess.Popen([*_join_cgroup(procs), *command], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment,
                                       start_new_session=True)
            out, err, timed_out, truncated = _communicate(process, data, timeout, max_output)
            if timed_out:
                self._kill_group(process.pid)
            try:
                code = process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill_group(process.pid)
                code = process.wait()
            return ExecResult(None if timed_out else code, out.decode("utf-8", "replace"),
                              err.decode("utf-8", "replace"), timed_out, time.monotonic() - start, truncated,
                              self.cgroup.oom_kills() > oom0, self.cgroup.fork_failures() > forks0, out, err)

    def _kill_group(self, leader: int) -> None:
        """SIGKILL what the command ``leader`` started: its process group, and any sandbox process still in the
        leader's POSIX session (its /proc/PID/stat session field equals the leader's pid)."""
        try:
            os.killpg(leader, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.cgroup.pids():
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == leader:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass

    # -- files ------------------------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` inside (relative paths are under ``/work``), creating parent
        directories; the file is owned by the sandbox's root."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        with self._lock:
            self._check_alive("write_file")
            rel = _inside_path(path)
            self._mkdirs(os.path.dirname(rel))
            fd = sc.open_in_root(self._root_fd, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            try:
                os.fchown(fd, isolation.UID_BASE, isolation.UID_BASE)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)

    def read_file(self, path: str, max_bytes: int = MAX_READ) -> bytes:
        """The bytes of ``path`` inside (relative paths are under ``/work``); at most ``max_bytes``."""
        with self._lock:
            self._check_alive("read_file")
            fd = sc.open_in_root(self._root_fd, _inside_path(path), os.O_RDONLY)
            try:
                chunks, size = [], 0
                while size <= max_bytes and (chunk := os.read(fd, min(1 << 20, max_bytes + 1 - size))):
                    chunks.append(chunk)
                    size += len(chunk)
            finally:
                os.close(fd)
            if size > max_bytes:
                raise SandboxError(f"{path} is larger than max_bytes={max_bytes}")
            return b"".join(chunks)

    def _mkdirs(self, rel_dir: str) -> None:
        parts = [p for p in rel_dir.split("/") if p]
        for depth in range(1, len(parts) + 1):
            sub = "/".join(parts[:depth])
            try:
                os.close(sc.open_in_root(self._root_fd, sub, os.O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFoundError:
                pass
            parent = sc.open_in_root(self._root_fd, "/".join(parts[:depth - 1]) or ".", os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(parts[depth - 1], 0o755, dir_fd=parent)
                os.chown(parts[depth - 1], isolation.UID_BASE, isolation.UID_BASE, dir_fd=parent,
                         follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.close(parent)

    # -- pause / resume ---------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self.cgroup is not None and not self.closed and self.cgroup.frozen()

    def pause(self) -> None:
        with self._lock:
            self._check_alive("pause")
            self.cgroup.freeze()

    def resume(self) -> None:
        with self._lock:
            self._check_alive("resume")
            self.cgroup.thaw()

    def cpu_ns(self) -> int:
        return self.cgroup.cpu_ns()

    def memory_bytes(self) -> int:
        return self.cgroup.memory_bytes()

    # -- fork / checkpoint / restore --------------------------------------------------------------------
    def _upper(self) -> str:
        return os.path.join(f"/proc/self/fd/{self._started.layer_fd}", "upper")

    def fork(self) -> Sandbox:
        """A new sandbox with a copy of this one's writable layer. This one is frozen, and its lock held, only while
        the layer is copied: the child's init then starts with this sandbox free again, so several forks of one
        sandbox boot at once (a judge per completion, ``kimik3.posttrain.sandbox``)."""
        self._lock.acquire()
        held, thaw = True, False

        def copied() -> None:
            nonlocal held, thaw
            if thaw:
                self.cgroup.thaw()
                thaw = False
            held = False
            self._lock.release()

        try:
            self._check_alive("fork")
            child = Sandbox(name=_new_name(), image=self.image, limits=self.limits, base_dir=self.base_dir,
                            store=self.store, allow=self.allow, parts=self.parts)
            thaw = not self.cgroup.frozen()
            self.cgroup.freeze()
            source = self._upper()
            child._boot(lambda target: (_replace_tree(source, target), copied()))
        finally:
            if held:          # the boot failed before (or while) copying
                copied()
        return child

    def checkpoint(self) -> str:
        """Store what changed in the writable layer since this sandbox's last checkpoint; its id.
        ``last_checkpoint`` tells the bytes written and the time taken."""
        with self._lock:
            self._check_alive("checkpoint")
            was_paused = self.cgroup.frozen()
            self.cgroup.freeze()
            try:
                info, self._cache = self.store.save(self._upper(), {"sandbox": self.name, "image": self.image},
                                                    self._cache)
            finally:
                if not was_paused:
                    self.cgroup.thaw()
            self.last_checkpoint = info
            return info.id

    def restore(self, checkpoint_id: str) -> None:
        """Replace this sandbox's files with checkpoint ``checkpoint_id``'s; its processes are ended and
        it restarts with a fresh pid 1 (process state is not checkpointed here)."""
        with self._lock:
            self._check_alive("restore")
            self.store.manifest(checkpoint_id)             # a bad id fails here, before anything is torn down
            self._teardown()
            self.closed = False
            cache: dict[str, tuple] = {}

            def populate(target: str) -> None:
                _clear(target)
                cache.update(self.store.materialize(checkpoint_id, target))
            self._boot(populate)
            self._cache = cache

    @classmethod
    def from_checkpoint(cls, checkpoint_id: str, store: layers.CheckpointStore, *, image: str | None = None,
                        limits: Limits | None = None, allow: Sequence = (), base_dir: str | None = None) -> Sandbox:
        """A new sandbox started from ``checkpoint_id`` of ``store``."""
        facilities.require()
        store.manifest(checkpoint_id)
        base_dir = os.path.abspath(base_dir or DEFAULT_BASE_DIR)
        os.makedirs(os.path.join(base_dir, "run"), exist_ok=True)
        sandbox = cls(name=_new_name(), image=image, limits=limits or Limits(), base_dir=base_dir, store=store,
                      allow=parse_allow(allow), parts=plan_parts(image, base_dir))
        cache: dict[str, tuple] = {}

        def populate(target: str) -> None:
            _clear(target)
            cache.update(store.materialize(checkpoint_id, target))
        sandbox._boot(populate)
        sandbox._cache = cache
        return sandbox

    # -- teardown ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """End every process of the sandbox and free its layer, cgroup and mount point (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self._teardown()

    def _teardown(self) -> None:
        self.closed = True
        if self._forwarder is not None:
            self._forwarder.close()
            self._forwarder = None
        if self._started is not None:
            os.close(self._started.lifeline_fd)
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
        if self._started is not None:
            os.close(self._started.layer_fd)
            self._started = None
        try:
            os.rmdir(self._mountpoint)
        except OSError:
            pass

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if not self.closed:
                self.close()
        except Exception:                    # noqa: BLE001 - interpreter shutdown: nothing to report to
            pass

    def _check_alive(self, what: str) -> None:
        if self.closed or self._started is None:
            raise SandboxError(f"{what}: sandbox {self.name} is closed")

    def _check_running(self, what: str) -> None:
        self._check_alive(what)
        if self.cgroup.frozen():
            raise SandboxError(f"{what}: sandbox {self.name} is paused; resume() it first")

    @property
    def init_pid(self) -> int:
        self._check_alive("init_pid")
        return self._started.init_pid

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("paused" if self.paused else "running")
        return f"Sandbox({self.name}, {state})"


def _new_name() -> str:
    with _counter_lock:
        if not getattr(_new_name, "swept", False):
            sweep_stale()
            _new_name.swept = True
        return f"{os.getpid()}-{next(_counter)}"


def _inside_path(path: str) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"bad path {path!r}")
    if not path.startswith("/"):
        path = "/work/" + path
    rel = os.path.normpath(path).lstrip("/")
    if not rel or rel == ".":
        raise ValueError(f"path {path!r} names the root directory, not a file")
    return rel


JOIN = 'p=$$; while [ "$1" != -- ]; do echo $p > "$1" || exit 125; shift; done; shift; exec "$@"'


def _join_cgroup(procs: list[str]) -> list[str]:
    """A host shell prefix that puts itself into the sandbox's cgroups, then executes the rest of the
    command: the command is inside before it runs anything (a pre-exec hook would do the same at the
    price of a full fork of the manager, tens of ms)."""
    return ["/bin/sh", "-c", JOIN, "sh", *procs, "--"]


def _communicate(process: subprocess.Popen, data: bytes, timeout: float, cap: int):
    """Feed stdin and read stdout/stderr (each kept up to ``cap`` bytes, the rest dropped) until the
    command exits (then briefly drain) or the deadline passes."""
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    truncated = False
    selector = selectors.DefaultSelector()
    streams = {process.stdout: out, process.stderr: err}
    for stream in streams:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    view = memoryview(data)
    if data:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin, selectors.EVENT_WRITE)
    else:
        process.stdin.close()
    exited_at = None
    timed_out = False
    try:
        while selector.get_map():
            now = time.monotonic()
            if exited_at is None and process.poll() is not None:
                exited_at = now
                if view and process.stdin in {k.fileobj for k in selector.get_map().values()}:
                    selector.unregister(process.stdin)          # it exited without reading its input
                    view = view[:0]
            if exited_at is not None and now - exited_at > 0.2:     # background children hold the pipes
                break
            if now > deadline:
                timed_out = process.poll() is None
                break
            wait = min(deadline - now, 0.05 if exited_at is None else 0.02)
            for key, _ in selector.select(wait):
                stream = key.fileobj
                if stream is process.stdin:
                    try:
                        view = view[os.write(stream.fileno(), view[:65536]):]
                    except (BrokenPipeError, OSError):
                        view = view[:0]
                    if not view:
                        selector.unregister(stream)
                        stream.close()
                    continue
                try:
                    chunk = os.read(stream.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(stream)
                    continue
                buffer = streams[stream]
                room = cap - len(buffer)
                if len(chunk) > room:
                    truncated = True
                buffer += chunk[:max(room, 0)]
    finally:
        selector.close()
        for stream in (process.stdin, process.stdout, process.stderr):
            try:
                stream.close()
            except OSError:
                pass
    return bytes(out), bytes(err), timed_out, truncated


def _clear(target: str) -> None:
    for name in os.listdir(target):
        path = os.path.join(target, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _replace_tree(source: str, target: str) -> None:
    """Make the (fresh) layer ``target`` a copy of ``source`` (the per-part upper dirs included)."""
    _clear(target)
    layers.copy_tree(source, target)
    st = os.lstat(source)
    os.chown(target, st.st_uid, st.st_gid)
    os.chmod(target, st.st_mode & 0o7777)
