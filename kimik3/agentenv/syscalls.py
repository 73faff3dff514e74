"""The Linux system calls AgentENV needs that Python 3.11's ``os`` lacks, through ``ctypes``.

Namespaces (``unshare``, ``setns``), mounts (``mount``, ``umount2``, ``pivot_root``), id-mapped
mounts (``open_tree``, ``mount_setattr``, ``move_mount``: a view of the host's read-only base whose
root-owned files appear owned by the sandbox's own root), ``openat2`` with ``RESOLVE_IN_ROOT`` (the
host reads and writes a sandbox's files resolving every path, symlinks included, inside the sandbox's
root), and ``prctl`` for the parent-death signal. Numbers are x86_64 and aarch64's (the generic table).
Each call raises ``OSError`` with the errno and the call's name on failure.
"""

from __future__ import annotations

import ctypes
import os
import platform

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x00100000

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24

_NUMBERS = {
    "x86_64": {"pivot_root": 155, "open_tree": 428, "move_mount": 429, "openat2": 437, "mount_setattr": 442},
    "aarch64": {"pivot_root": 41, "open_tree": 428, "move_mount": 429, "openat2": 437, "mount_setattr": 442},
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _number(name: str) -> int:
    machine = platform.machine()
    if machine not in _NUMBERS:
        raise OSError(f"kimik3.agentenv knows the system call numbers of {sorted(_NUMBERS)}, not {machine}")
    return _NUMBERS[machine][name]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or ''} {source} on {target}")


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_number("pivot_root"), new_root.encode(), put_old.encode()), "pivot_root")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def idmapped_tree(path: str, userns_fd: int, read_only: bool = True) -> int:
    """A detached recursive copy of the mount tree at ``path`` whose file owners are mapped through the
    user namespace ``userns_fd`` (root-owned files appear owned by that namespace's root); an fd."""
    fd = _check(_libc.syscall(_number("open_tree"), AT_FDCWD, path.encode(),
                              OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE), f"open_tree {path}")
    attr = _MountAttr(MOUNT_ATTR_IDMAP | MOUNT_ATTR_NODEV | (MOUNT_ATTR_RDONLY if read_only else 0), 0, 0, userns_fd)
    try:
        _check(_libc.syscall(_number("mount_setattr"), fd, b"", AT_EMPTY_PATH | AT_RECURSIVE, ctypes.byref(attr),
                             ctypes.sizeof(attr)), f"mount_setattr (id-mapped) {path}")
    except OSError:
        os.close(fd)
        raise
    return fd


def move_mount(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` at ``target``."""
    _check(_libc.syscall(_number("move_mount"), fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
           f"move_mount to {target}")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_root(root_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
    """``path`` opened relative to the directory ``root_fd`` as if it were ``/``: ``..``, absolute
    symlinks and magic links cannot lead outside it (``openat2`` + ``RESOLVE_IN_ROOT``)."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
    return _check(_libc.syscall(_number("openat2"), root_fd, path.encode(), ctypes.byref(how), ctypes.sizeof(how)),
                  f"openat2 {path}")


def set_parent_death_signal(signum: int) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signum), 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def capbset_drop(cap: int) -> None:
    """Remove capability ``cap`` from this process's bounding set (no exec can regain it)."""
    result = _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
    if result < 0 and ctypes.get_errno() != 22:           # EINVAL: a capability this kernel lacks
        _check(result, f"prctl(PR_CAPBSET_DROP, {cap})")


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return 40
