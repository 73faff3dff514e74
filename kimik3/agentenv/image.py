"""What a sandbox's root filesystem is made of: the read-only parts of the base image.

``image=None`` (the default) is the host's own system, read-only: ``/usr`` (with the merged-/usr
symlinks ``/bin``, ``/lib``, ... as the host has them), ``/etc`` with its secrets masked (shadow
files, SSH keys: overlayfs whiteouts in a layer above the host's ``/etc``), ``/opt``, and the
directory of the running Python interpreter at its host path (so ``python3`` and its packages work
inside). Nothing else of the host is in the image: not ``/root``, ``/home``, ``/work``, ``/tmp``,
``/var``, ``/proc`` or ``/sys`` of the host.

``image="/path/to/rootfs"`` uses that directory tree as the root, read-only, plus the interpreter's
directory (the sandbox's pid 1 is a small Python loop).

Every sandbox also gets a *skeleton* layer on top of its root: empty ``/proc``, ``/dev``, ``/tmp``
(1777), ``/work`` (the default working directory), ``/root``, ``/home`` and the mount points of the
other parts; it is built once per base directory and shared by all sandboxes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys

from kimik3.agentenv.isolation import Part

SYSTEM_DIRS = ("usr", "etc", "opt")
MERGED_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
SECRETS = ("etc/shadow", "etc/shadow-", "etc/gshadow", "etc/gshadow-", "etc/ssh", "etc/ssl/private",
           "etc/sudoers", "etc/sudoers.d", "etc/machine-id")
EMPTY_DIRS = (("proc", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("work", 0o755), ("root", 0o700),
              ("home", 0o755), ("var", 0o755), ("var/tmp", 0o1777), ("run", 0o755), ("mnt", 0o755))


def interpreter_dirs() -> list[str]:
    """The host directories the running interpreter needs (its prefix, and a venv's if in one)."""
    dirs = []
    for prefix in (sys.base_prefix, sys.prefix):
        real = os.path.realpath(prefix)
        if real not in dirs:
            dirs.append(real)
    return dirs


def _inside(path: str, parents: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def plan_parts(image: str | None, base_dir: str) -> tuple[Part, ...]:
    """The overlay parts of a root for ``image`` (see the module's notes); builds the shared skeleton."""
    if image is not None:
        image = os.path.realpath(image)
        if not os.path.isdir(image):
            raise ValueError(f"image {image!r} is not a directory (a root filesystem tree is expected)")
        if image == "/":
            raise ValueError("image '/' would give the sandbox the host's whole filesystem; use image=None")
    host_parts = []
    if image is None:
        host_parts = [f"/{name}" for name in SYSTEM_DIRS if os.path.isdir(f"/{name}")]
    extra = [d for d in interpreter_dirs() if not _inside(d, host_parts)]
    targets = host_parts + extra
    skeleton = _skeleton(base_dir, targets, links=image is None)
    parts = [Part("/", (skeleton,) if image is None else (skeleton, image))]
    for target in host_parts:
        sources = (target,)
        if target == "/etc":
            sources = (_mask(base_dir, "etc"), "/etc")
        parts.append(Part(target, sources))
    parts += [Part(d, (d,)) for d in extra]
    return tuple(parts)


def _build_once(path: str, fill) -> str:
    """The directory ``path``, built by ``fill(tmp)`` in a temporary sibling and renamed into place the first
    time; another manager building it meanwhile builds the same, so losing the rename is fine."""
    if os.path.isdir(path):
        return path
    tmp = f"{path}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, 0o755)
    os.chmod(tmp, 0o755)
    fill(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _skeleton(base_dir: str, targets: list[str], links: bool) -> str:
    layout = repr((sorted(targets), links, EMPTY_DIRS, [(n, os.path.islink(f"/{n}") and os.readlink(f"/{n}"))
                                                          for n in MERGED_LINKS]))

    def fill(tmp: str) -> None:
        for name, mode in EMPTY_DIRS:
            os.makedirs(os.path.join(tmp, name), exist_ok=True)
            os.chmod(os.path.join(tmp, name), mode)
        if links:
            for name in MERGED_LINKS:
                if os.path.islink(f"/{name}"):
                    os.symlink(os.readlink(f"/{name}"), os.path.join(tmp, name))
        for target in targets:
            os.makedirs(os.path.join(tmp, target.lstrip("/")), 0o755, exist_ok=True)

    return _build_once(os.path.join(base_dir, "skeleton-" + hashlib.sha256(layout.encode()).hexdigest()[:16]), fill)


def _mask(base_dir: str, part: str) -> str:
    """A layer of whiteouts that hides the host's secrets under ``/<part>`` from the sandbox."""
    names = [s.split("/", 1)[1] for s in SECRETS if s.startswith(part + "/")]

    def fill(tmp: str) -> None:
        for name in names:
            where = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(where), 0o755, exist_ok=True)
            os.mknod(where, stat.S_IFCHR, 0)       # an overlayfs whiteout: the lower file is not there

    return _build_once(os.path.join(base_dir, f"mask-{part}-" + hashlib.sha256(repr(names).encode()).hexdigest()[:16]),
                       fill)
