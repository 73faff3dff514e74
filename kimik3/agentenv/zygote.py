"""Python REPLs forked from one preloaded *zygote* into sandboxes: copy-on-write memory across sandboxes.

A ``Zygote`` is a host process (root, outside any sandbox) that runs a trusted ``preload`` once (say
``import numpy; table = ...``), freezes its objects out of the garbage collector's reach (``gc.freeze``:
a collection would otherwise write to every object's header and copy every page) and then forks on
request. Each fork joins one sandbox: its cgroups first (pages it copies from then on are charged to
the sandbox), then the sandbox's mount, network, IPC, UTS, cgroup and pid namespaces, then its user
namespace as the sandbox's root with the same bounding set as ``Sandbox.exec`` commands, and forks once
more to be inside the pid namespace (the grandchild's parent then is the sandbox's pid 1). The REPL
shares every page of the preloaded state with the zygote and its siblings until it writes to one: N
such sandboxes cost one copy of the preload plus what each one changed, where N separately started
interpreters cost N copies (``benchmarks/agentenv.py`` measures the ratio).

The REPL serves ``Repl.run(code)`` over a Unix socket: the code runs with ``exec`` in the REPL's globals
(which start as the preload's), stdout and stderr captured; the reply is their text.

The preload runs as root on the host: it is the environment's configuration, never model output.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys

if __package__:
    from kimik3.agentenv import syscalls as sc
else:   # run as the zygote script: the sibling module by path, not the kimik3 package (which imports torch)
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_agentenv_syscalls",
                                                   os.path.join(os.path.dirname(__file__), "syscalls.py"))
    sc = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sc)

NAMESPACES = ("mnt", "net", "ipc", "uts", "cgroup", "pid")
_FLAGS = {"mnt": sc.CLONE_NEWNS, "net": sc.CLONE_NEWNET, "ipc": sc.CLONE_NEWIPC, "uts": sc.CLONE_NEWUTS,
          "cgroup": sc.CLONE_NEWCGROUP, "pid": sc.CLONE_NEWPID}
KEEP_CAPS = (0, 1, 3, 4, 5, 6, 7, 8, 10, 29)     # the capabilities of sandbox.KEEP_CAPS, by number
MAX_MESSAGE = 16 << 20


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock: socket.socket) -> bytes:
    head = _exact(sock, 4)
    (size,) = struct.unpack("!I", head)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes is over the {MAX_MESSAGE}-byte limit")
    return _exact(sock, size)


def _exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the other end closed the connection")
        data += chunk
    return data


class Repl:
    """A REPL forked from a zygote into a sandbox."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def run(self, code: str, timeout: float = 30.0) -> str:
        self._sock.settimeout(timeout)
        _send(self._sock, code.encode())
        return _recv(self._sock).decode("utf-8", "replace")

    def close(self) -> None:
        self._sock.close()


class Zygote:
    """The preloaded host process (see the module's notes)."""

    def __init__(self, preload: str = "", python: str = sys.executable):
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.process = subprocess.Popen([python, "-I", os.path.abspath(__file__), str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        _send(self._control, preload.encode())
        reply = _recv(self._control).decode()
        if reply != "ready":
            self.close()
            raise RuntimeError(f"the zygote's preload failed: {reply}")

    def spawn(self, sandbox) -> Repl:
        """A REPL forked from the zygote into ``sandbox`` (running, not paused)."""
        pid = sandbox.init_pid
        fds = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in (*NAMESPACES, "user")]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            request = json.dumps({"procs": sandbox.cgroup.procs_files(), "workdir": "/work"}).encode()
            socket.send_fds(self._control, [struct.pack("!I", len(request)) + request], [*fds, theirs.fileno()])
            reply = _recv(self._control).decode()
        finally:
            for fd in fds:
                os.close(fd)
            theirs.close()
        if reply != "forked":
            ours.close()
            raise RuntimeError(f"the zygote could not fork into sandbox {sandbox.name}: {reply}")
        repl = Repl(ours)
        if repl.run("print('up')").strip() != "up":
            raise RuntimeError(f"the REPL in sandbox {sandbox.name} did not answer")
        return repl

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        self._control.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the zygote process -------------------------------------------------------------------------------------
def _serve(control: socket.socket) -> None:
    import gc

    namespace: dict = {"__name__": "__repl__"}
    try:
        exec(compile(_recv(control).decode(), "<preload>", "exec"), namespace)
    except Exception as err:                               # noqa: BLE001 - reported to the manager
        _send(control, f"{type(err).__name__}: {err}".encode())
        return
    gc.collect()
    gc.freeze()
    _send(control, b"ready")
    while True:
        try:
            head, fds, _, _ = socket.recv_fds(control, 4, len(NAMESPACES) + 2)
        except OSError:
            return
        if not head:
            return
        request = json.loads(_exact(control, struct.unpack("!I", head)[0]))
        child = os.fork()
        if child == 0:
            code = 1
            try:
                control.close()
                _enter(request, fds, namespace)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(child, 0)
        _send(control, b"forked" if status == 0 else f"setup exited with status {status}".encode())


def _enter(request: dict, fds: list[int], namespace: dict) -> None:
    *ns_fds, user_fd, conn_fd = fds
    for path in request["procs"]:
        with open(path, "w") as handle:
            handle.write(str(os.getpid()))
    for name, fd in zip(NAMESPACES, ns_fds):
        sc.setns(fd, _FLAGS[name])
        os.close(fd)
    os.setgroups([])
    sc.setns(user_fd, sc.CLONE_NEWUSER)
    os.close(user_fd)
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    for cap in range(sc.last_cap() + 1):
        if cap not in KEEP_CAPS:
            sc.capbset_drop(cap)
    os.chdir("/")
    try:
        os.chdir(request["workdir"])
    except OSError:
        pass
    if os.fork() != 0:                 # the grandchild is inside the pid namespace; this one reports
        return
    os.setsid()
    _repl(socket.socket(fileno=conn_fd), namespace)
    os._exit(0)


def _repl(conn: socket.socket, namespace: dict) -> None:
    import contextlib
    import io

    while True:
        try:
            code = _recv(conn).decode("utf-8", "replace")
        except (EOFError, OSError, ValueError):
            return
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                exec(compile(code, "<repl>", "exec"), namespace)
            except BaseException as err:           # noqa: BLE001 - the REPL reports and goes on
                print(f"{type(err).__name__}: {err}")
        _send(conn, out.getvalue().encode())


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
