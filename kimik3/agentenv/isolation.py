"""Starting a sandbox's process tree: user, mount, pid, network, IPC, UTS and cgroup namespaces, an
overlay root, and a pid 1 that reaps orphans.

``start(plan, populate)`` forks a setup process (P) from the calling (root) process. P:

1. joins the sandbox's cgroup, and takes a private mount namespace (nothing it mounts reaches the host);
2. creates the sandbox's user namespace (in a short-lived helper child) mapping ids 0..65535 inside to
   ``UID_BASE``.. outside, so the sandbox's root is an unprivileged user on the host;
3. mounts the **writable layer**: a tmpfs of ``disk_bytes`` (the disk limit) holding one overlayfs
   upper directory per image part, and hands the manager an fd to it (``SCM_RIGHTS``), then waits while
   the manager fills it (a fork's copy, a checkpoint being restored) or leaves it empty;
4. mounts each image part as an overlay: lower = an **id-mapped**, read-only, nodev view of the host
   directory (its root-owned files appear owned by the sandbox's root, so the sandbox can write over
   them, into its layer only), upper = its directory in the layer;
5. gives the root a minimal ``/dev`` (null, zero, full, random, urandom, tty bound from the host, and a
   tmpfs ``/dev/shm``), enters the user namespace, and unshares mount, pid, net, IPC, UTS and cgroup
   namespaces owned by it;
6. forks I, the sandbox's pid 1, reports I's pid and exits.

I mounts ``/proc`` for its pid namespace, brings the loopback interface up (the network namespace has no
other interface: no route out), pivots into the overlay root and detaches the old root (the host's
files are then unreachable: not hidden, gone from the namespace), and executes a reaper: a ``python -I
-S`` loop (about 3 MB) that reaps orphans and exits when the manager's end of a *lifeline* pipe closes
(a manager that dies takes its sandboxes with it: pid 1 exiting kills its whole pid namespace).

P is a ``fork`` of the manager, so between fork and exit it only calls ``os``/``ctypes``/``socket``
functions imported beforehand, and closes every inherited fd first (other sandboxes' fds must not leak
into this one).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from kimik3.agentenv import syscalls as sc

UID_BASE = 100_000
ID_COUNT = 65_536
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

REAPER = """
import os, select, signal, sys
def reap(*_):
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
signal.signal(signal.SIGCHLD, reap)
lifeline = int(sys.argv[1])
while True:
    reap()
    ready, _w, _x = select.select([lifeline], [], [])
    if ready and not os.read(lifeline, 1):
        sys.exit(0)
"""


@dataclass(frozen=True, slots=True)
class Part:
    """One overlay of the root: ``target`` inside (``/`` for the root) over the host directories
    ``sources`` (first on top), with the layer's ``upper/<index>`` as its writable upper."""
    target: str
    sources: tuple[str, ...]


@dataclass(slots=True)
class Plan:
    name: str
    parts: tuple[Part, ...]
    layer_mountpoint: str                 # an empty host directory (mounted over in P's namespace only)
    cgroup_procs: tuple[str, ...]
    disk_bytes: int
    python: str                           # the interpreter (inside and outside: same path) of the reaper
    workdir: str = "/work"
    hostname: str = "sandbox"
    uid_base: int = UID_BASE
    extra_env: dict = field(default_factory=dict)


@dataclass(slots=True)
class Started:
    init_pid: int
    layer_fd: int                         # O_PATH fd of the layer tmpfs's root (upper/, work/, lower/, root/)
    lifeline_fd: int                      # closing it ends the sandbox


class StartError(RuntimeError):
    """The sandbox's setup process failed; the message names the step."""


def _close_fds_except(keep: set[int]) -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def start(plan: Plan, populate: Callable[[str], None] | None = None, timeout_s: float = 30.0) -> Started:
    """Start the sandbox of ``plan``; ``populate(upper_path)`` may fill its empty writable layer first."""
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    life_r, life_w = os.pipe()
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:                                                       # P
        code = 1
        try:
            keep = {status_w, go_r, life_r, child_sock.fileno()}
            _close_fds_except(keep)
            _setup(plan, status_w, go_r, life_r, child_sock)
            code = 0
        except BaseException as err:                                   # noqa: BLE001 - reported, then exit
            try:
                os.write(status_w, ("error " + json.dumps(f"{type(err).__name__}: {err}") + "\n").encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    for fd in (status_w, go_r, life_r):
        os.close(fd)
    child_sock.close()
    layer_fd = -1
    try:
        ready, _, _ = select.select([parent_sock, status_r], [], [], timeout_s)
        if parent_sock in ready:
            _, fds, _, _ = socket.recv_fds(parent_sock, 16, 1)
            if fds:
                layer_fd = fds[0]
        if layer_fd < 0:
            raise StartError(f"sandbox {plan.name}: setup failed before its layer was mounted: {_status(status_r)}")
        if populate is not None:
            populate(os.path.join(f"/proc/self/fd/{layer_fd}", "upper"))
        os.write(go_w, b"g")
        os.close(go_w)
        go_w = -1
        reply = _status(status_r, timeout_s)
        if not reply.startswith("ok "):
            raise StartError(f"sandbox {plan.name}: setup failed: {reply}")
        return Started(int(reply.split()[1]), layer_fd, life_w)
    except BaseException:
        if layer_fd >= 0:
            os.close(layer_fd)
        os.close(life_w)
        raise
    finally:
        if go_w >= 0:
            os.close(go_w)
        os.close(status_r)
        parent_sock.close()
        os.waitpid(pid, 0)


def _status(fd: int, timeout_s: float = 5.0) -> str:
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return "no answer (timed out)"
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    text = data.decode(errors="replace").strip()
    if text.startswith("error "):
        try:
            return json.loads(text[6:])
        except ValueError:
            pass
    return text or "the setup process exited without a word"


def _setup(plan: Plan, status_w: int, go_r: int, life_r: int, sock: socket.socket) -> None:
    step = "join cgroup"
    try:
        for path in plan.cgroup_procs:
            _write(path, str(os.getpid()))
        os.setsid()
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        step = "private mount namespace"
        sc.unshare(sc.CLONE_NEWNS)
        sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
        step = "user namespace"
        userns_fd = _user_namespace(plan.uid_base)
        step = "writable layer (tmpfs)"
        layer = plan.layer_mountpoint
        inodes = max(16_384, plan.disk_bytes // 4096)
        sc.mount("agentenv-layer", layer, "tmpfs", sc.MS_NOSUID | sc.MS_NODEV,
                 f"size={plan.disk_bytes},nr_inodes={inodes},mode=0711")
        for sub in ("upper", "work", "lower", "root"):     # pid 1 (the sandbox's root) only passes through root/
            os.mkdir(os.path.join(layer, sub), 0o711 if sub == "root" else 0o700)
        for index in range(len(plan.parts)):
            upper = os.path.join(layer, "upper", str(index))
            os.mkdir(upper, 0o755)
            os.chown(upper, plan.uid_base, plan.uid_base)
            os.mkdir(os.path.join(layer, "work", str(index)), 0o700)
        layer_fd = os.open(layer, os.O_PATH | os.O_DIRECTORY)
        socket.send_fds(sock, [b"L"], [layer_fd])
        os.close(layer_fd)
        step = "waiting for the layer to be filled"
        if os.read(go_r, 1) != b"g":
            raise StartError("the manager gave up before the layer was filled")
        os.close(go_r)
        step = "overlay root"
        root = os.path.join(layer, "root")
        for index, part in enumerate(plan.parts):
            step = f"overlay of {part.target}"
            lowers = []
            for j, source in enumerate(part.sources):
                point = os.path.join(layer, "lower", f"{index}.{j}")
                os.mkdir(point, 0o700)
                tree = sc.idmapped_tree(source, userns_fd)
                try:
                    sc.move_mount(tree, point)
                finally:
                    os.close(tree)
                lowers.append(point)
            target = root if part.target == "/" else os.path.join(root, part.target.lstrip("/"))
            options = (f"lowerdir={':'.join(lowers)},upperdir={layer}/upper/{index},workdir={layer}/work/{index}")
            sc.mount("overlay", target, "overlay", sc.MS_NODEV, options)
        step = "/dev"
        _make_dev(os.path.join(root, "dev"), plan.uid_base)
        step = "pivot into the overlay root"
        os.chdir(root)
        sc.pivot_root(".", ".")
        sc.umount2(".", sc.MNT_DETACH)       # the host's root is gone from this namespace, not hidden
        os.chdir("/")
        step = "unshare pid, net, ipc, uts, cgroup namespaces"
        sc.unshare(sc.CLONE_NEWPID | sc.CLONE_NEWNET | sc.CLONE_NEWIPC | sc.CLONE_NEWUTS | sc.CLONE_NEWCGROUP)
        step = "fork pid 1"
        exec_r, exec_w = os.pipe()           # close-on-exec: EOF without a word = pid 1 executed the reaper
        init = os.fork()
        if init == 0:
            try:
                os.close(status_w)
                os.close(exec_r)
                _init(plan, life_r, exec_w, userns_fd)
            except BaseException as err:                               # noqa: BLE001 - reported to P
                try:
                    os.write(exec_w, f"{type(err).__name__}: {err}".encode())
                except OSError:
                    pass
            finally:
                os._exit(1)
        os.close(exec_w)
        step = "pid 1 setup"
        word = os.read(exec_r, 4096)
        if word:
            raise StartError(word.decode(errors="replace"))
        os.write(status_w, f"ok {init}\n".encode())
    except BaseException as err:
        raise StartError(f"{step}: {type(err).__name__}: {err}") from err


def _user_namespace(uid_base: int) -> int:
    """A user namespace mapping 0..65535 to ``uid_base``..; an fd to it (the helper that made it exits)."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(hold_w)
            sc.unshare(sc.CLONE_NEWUSER)
            os.write(ready_w, b"u")
            os.read(hold_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(hold_r)
    try:
        if os.read(ready_r, 1) != b"u":
            raise StartError("the helper could not create a user namespace")
        _write(f"/proc/{helper}/uid_map", f"0 {uid_base} {ID_COUNT}\n")
        _write(f"/proc/{helper}/setgroups", "deny")
        _write(f"/proc/{helper}/gid_map", f"0 {uid_base} {ID_COUNT}\n")
        return os.open(f"/proc/{helper}/ns/user", os.O_RDONLY)
    finally:
        os.close(ready_r)
        os.close(hold_w)
        os.waitpid(helper, 0)


def _make_dev(dev: str, uid_base: int) -> None:
    sc.mount("agentenv-dev", dev, "tmpfs", sc.MS_NOSUID | sc.MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in DEVICES:
        path = os.path.join(dev, name)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
        sc.mount(f"/dev/{name}", path, None, sc.MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(os.path.join(dev, "shm"), 0o1777)
    sc.mount("agentenv-shm", os.path.join(dev, "shm"), "tmpfs", sc.MS_NOSUID | sc.MS_NODEV,
             f"size=64m,mode=1777,uid={uid_base},gid={uid_base}")


def _loopback_up() -> None:
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, request[:18].ljust(40, b"\0"))[:18])[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up).ljust(40, b"\0"))


def _init(plan: Plan, life_r: int, exec_w: int, userns_fd: int) -> None:
    """Pid 1: still privileged (host root) while it mounts /proc and configures the namespaces, which
    are therefore owned by the host's user namespace: nothing in the sandbox can remount, unmount or
    reconfigure them. Then it enters the sandbox's user namespace, drops every capability from its
    bounding set and executes the reaper."""
    step = "mount /proc"
    try:
        sc.mount("proc", "/proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
        step = "loopback up"
        _loopback_up()
        step = "hostname"
        socket.sethostname(plan.hostname)
        step = "enter the user namespace"
        os.setgroups([])
        sc.setns(userns_fd, sc.CLONE_NEWUSER)
        os.close(userns_fd)
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        step = "drop capabilities"
        for cap in range(sc.last_cap() + 1):
            sc.capbset_drop(cap)
        step = "working directory"
        try:
            os.chdir(plan.workdir)
        except OSError:
            pass
        _close_fds_except({life_r, exec_w})
        os.set_inheritable(life_r, True)
        env = {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        step = f"execute the reaper {plan.python}"
        os.execve(plan.python, [plan.python, "-I", "-S", "-c", REAPER, str(life_r)], env)
    except BaseException as err:
        raise StartError(f"{step}: {type(err).__name__}: {err}") from err


def host_python() -> str:
    return os.path.realpath(sys.executable)
