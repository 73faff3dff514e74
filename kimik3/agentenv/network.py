"""A sandbox's only way out: an explicit allow-list of the host's loopback services.

The sandbox's network namespace has just ``lo``: no interface leads out, so any connection to another
address fails (``ENETUNREACH``). For each allowed ``(port, host_port)`` the manager opens a listening
socket on ``127.0.0.1:port`` *inside* the sandbox's namespace (a short-lived thread ``setns``-es into it,
creates the socket and ends: the socket stays in that namespace) and forwards each connection to the
host's ``127.0.0.1:host_port`` from its own namespace. Only loopback targets exist in this design, so an
allow-list entry cannot open a path to the outside world.
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
from collections.abc import Sequence

from kimik3.agentenv import syscalls as sc

MAX_CONNECTIONS = 64


def parse_allow(allow: Sequence) -> tuple[tuple[int, int], ...]:
    """``[8080, (9000, 19000)]`` -> ``((8080, 8080), (9000, 19000))``; bad entries raise ``ValueError``."""
    if isinstance(allow, (str, bytes)):
        raise ValueError(f"allow must be a list of ports or (port, host_port) pairs, got {allow!r}")
    out = []
    for entry in allow:
        pair = (entry, entry) if isinstance(entry, int) else tuple(entry) if isinstance(entry, (tuple, list)) else ()
        if len(pair) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in pair):
            raise ValueError(f"allow entry {entry!r}: expected a port or a (port, host_port) pair, ports in 1..65535")
        out.append(pair)
    if len({p for p, _ in out}) != len(out):
        raise ValueError(f"allow lists a sandbox port twice: {allow!r}")
    return tuple(out)


class LoopbackForwarder:
    """Listeners inside the sandbox of ``init_pid`` forwarding to host loopback ports."""

    def __init__(self, init_pid: int, allow: Sequence[tuple[int, int]]):
        self._listeners: list[socket.socket] = []
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        for port, host_port in allow:
            listener = _listen_in(init_pid, port)
            self._listeners.append(listener)
            thread = threading.Thread(target=self._accept, args=(listener, host_port), daemon=True,
                                      name=f"agentenv-forward-{port}")
            thread.start()
            self._threads.append(thread)

    def _accept(self, listener: socket.socket, host_port: int) -> None:
        active = threading.BoundedSemaphore(MAX_CONNECTIONS)
        while not self._closing.is_set():
            try:
                inside, _ = listener.accept()
            except OSError:
                return
            if not active.acquire(blocking=False):
                inside.close()
                continue
            threading.Thread(target=self._pump, args=(inside, host_port, active), daemon=True).start()

    def _pump(self, inside: socket.socket, host_port: int, active: threading.BoundedSemaphore) -> None:
        try:
            try:
                outside = socket.create_connection(("127.0.0.1", host_port), timeout=5)
            except OSError:
                inside.close()
                return
            with inside, outside, selectors.DefaultSelector() as selector:
                selector.register(inside, selectors.EVENT_READ, outside)
                selector.register(outside, selectors.EVENT_READ, inside)
                while not self._closing.is_set() and selector.get_map():
                    for key, _ in selector.select(0.5):
                        try:
                            data = key.fileobj.recv(65536)
                        except OSError:
                            data = b""
                        if not data:
                            return
                        key.data.sendall(data)
        except OSError:
            pass
        finally:
            active.release()

    def close(self) -> None:
        self._closing.set()
        for listener in self._listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for thread in self._threads:
            thread.join(timeout=2)


def _listen_in(init_pid: int, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` in the network namespace of ``init_pid``."""
    result: dict = {}

    def make() -> None:
        try:
            fd = os.open(f"/proc/{init_pid}/ns/net", os.O_RDONLY)
            try:
                sc.setns(fd, sc.CLONE_NEWNET)        # this thread only; it ends right after
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(16)
            result["socket"] = sock
        except OSError as err:
            result["error"] = err

    thread = threading.Thread(target=make, name="agentenv-netns")
    thread.start()
    thread.join()
    if "error" in result:
        raise OSError(f"cannot listen on 127.0.0.1:{port} inside the sandbox: {result['error']}")
    return result["socket"]
