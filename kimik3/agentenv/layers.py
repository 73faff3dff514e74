"""A sandbox's writable layer: scanning, copying, and incremental checkpoints to a content-addressed store.

The writable layer is the set of overlayfs upper directories of one sandbox (one per mounted part of
the image), on the sandbox's own size-limited tmpfs. What it holds is exactly what the sandbox changed
relative to its read-only base: new and modified files, plus overlayfs's markers for deleted files
(*whiteouts*, character devices 0:0) and replaced directories (the ``trusted.overlay.opaque`` xattr).

``CheckpointStore`` keeps checkpoints on disk as JSON manifests (one per checkpoint: every entry of
the layer with its type, mode, owner, xattrs and, for a file, the sha256 of its content) next to a
``blobs/`` directory of file contents named by their hash. A checkpoint therefore writes only the
contents that are not in the store yet: after a small change, one small blob and the manifest. Which
files changed is found from their stat (inode, size, mtime, ctime) against the previous checkpoint of
the same layer, so unchanged files are not read again. No pickle: manifests are JSON, blobs raw bytes.

The layer is only scanned or written while its sandbox is frozen or has no processes (the callers
ensure it), so the tree cannot change under the walk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass

CHUNK = 1 << 20
_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(slots=True)
class CheckpointInfo:
    id: str
    bytes_written: int         # new blob bytes + the manifest
    files_stored: int          # blobs written (contents the store did not have)
    entries: int               # entries in the layer
    seconds: float


def _xattrs(path: str) -> dict[str, str]:
    out = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for name in names:
        if name.startswith(("trusted.overlay.", "user.")):
            try:
                out[name] = os.getxattr(path, name, follow_symlinks=False).hex()
            except OSError:
                pass
    return out


def scan(root: str) -> dict[str, os.stat_result]:
    """Relative path -> lstat of every entry under ``root`` (not following symlinks), ``root`` itself
    excluded; parents come before their children."""
    entries: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames) + sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            entries[rel] = os.lstat(os.path.join(root, rel))
    return entries


def _kind(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "d"
    if stat.S_ISREG(st.st_mode):
        return "f"
    if stat.S_ISLNK(st.st_mode):
        return "l"
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return "w"                       # an overlayfs whiteout: the file is deleted in the sandbox
    return "x"                           # sockets, fifos, devices: not kept (documented)


def copy_tree(source: str, target: str) -> int:
    """Copy the layer at ``source`` into the empty directory ``target`` (owners, modes, times, whiteouts and
    overlay xattrs kept; hard links inside the layer become separate files); returns the bytes copied."""
    copied, dirs = 0, []
    for rel, st in scan(source).items():
        src, dst = os.path.join(source, rel), os.path.join(target, rel)
        kind = _kind(st)
        if kind == "d":
            os.mkdir(dst, 0o700)
            dirs.append((src, dst, st))
            continue
        elif kind == "f":
            with open(src, "rb") as fin, open(dst, "wb") as fout:
                while block := fin.read(CHUNK):
                    fout.write(block)
                    copied += len(block)
        elif kind == "l":
            os.symlink(os.readlink(src), dst)
        elif kind == "w":
            os.mknod(dst, stat.S_IFCHR | 0o000, 0)
        else:
            continue
        _finish(dst, st, {k: bytes.fromhex(v) for k, v in _xattrs(src).items()})
    for src, dst, st in reversed(dirs):      # children first: their creation bumps the parent's mtime
        _finish(dst, st, {k: bytes.fromhex(v) for k, v in _xattrs(src).items()})
    return copied


def _finish(path: str, st: os.stat_result, xattrs: dict[str, bytes]) -> None:
    for name, value in xattrs.items():
        os.setxattr(path, name, value, follow_symlinks=False)
    os.chown(path, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


class _Attrs:
    """A stand-in stat for ``_finish`` from a manifest entry."""

    def __init__(self, entry: dict):
        self.st_uid, self.st_gid = entry["uid"], entry["gid"]
        self.st_mode = entry["mode"]
        self.st_atime_ns = self.st_mtime_ns = entry["mtime_ns"]


class CheckpointStore:
    """Checkpoints of writable layers in ``directory`` (see the module's notes)."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        os.makedirs(os.path.join(self.directory, "blobs"), exist_ok=True)
        os.makedirs(os.path.join(self.directory, "manifests"), exist_ok=True)

    def _blob(self, digest: str) -> str:
        return os.path.join(self.directory, "blobs", digest[:2], digest)

    def _manifest_path(self, checkpoint_id: str) -> str:
        if not _ID.fullmatch(checkpoint_id):
            raise ValueError(f"bad checkpoint id {checkpoint_id!r}")
        return os.path.join(self.directory, "manifests", checkpoint_id + ".json")

    def exists(self, checkpoint_id: str) -> bool:
        return os.path.exists(self._manifest_path(checkpoint_id))

    def save(self, layer: str, meta: dict, cache: dict[str, tuple]) -> tuple[CheckpointInfo, dict[str, tuple]]:
        """Checkpoint the layer directory ``layer``. ``cache`` maps a file's relative path to
        ``(ino, size, mtime_ns, ctime_ns, sha256)`` from the previous checkpoint of this layer: a file
        whose stat still matches is not read. Returns the checkpoint's info and the new cache."""
        start = time.monotonic()
        entries, new_cache, written, stored = {}, {}, 0, 0
        for rel, st in scan(layer).items():
            kind = _kind(st)
            if kind == "x":
                continue
            path = os.path.join(layer, rel)
            entry = {"type": kind, "mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "mtime_ns": st.st_mtime_ns}
            xattrs = _xattrs(path)
            if xattrs:
                entry["xattrs"] = xattrs
            if kind == "l":
                entry["target"] = os.readlink(path)
            elif kind == "f":
                key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                previous = cache.get(rel)
                if previous is not None and tuple(previous[:4]) == key and os.path.exists(self._blob(previous[4])):
                    digest = previous[4]
                else:
                    digest, size, is_new = self._store_file(path)
                    if is_new:
                        written, stored = written + size, stored + 1
                entry["sha256"], entry["size"] = digest, st.st_size
                new_cache[rel] = (*key, digest)
            entries[rel] = entry
        checkpoint_id = f"{meta.get('sandbox', 'layer')}-{int(time.time() * 1000)}-{secrets.token_hex(4)}"
        manifest = json.dumps({"version": 1, "meta": meta, "entries": entries}, sort_keys=True).encode()
        path = self._manifest_path(checkpoint_id)
        with open(path + ".tmp", "wb") as handle:
            handle.write(manifest)
        os.replace(path + ".tmp", path)
        info = CheckpointInfo(checkpoint_id, written + len(manifest), stored, len(entries), time.monotonic() - start)
        return info, new_cache

    def _store_file(self, path: str) -> tuple[str, int, bool]:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while block := handle.read(CHUNK):
                digest.update(block)
        name = digest.hexdigest()
        blob = self._blob(name)
        if os.path.exists(blob):
            return name, 0, False
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        size = 0
        tmp = f"{blob}.{secrets.token_hex(4)}.tmp"
        with open(path, "rb") as fin, open(tmp, "wb") as fout:
            while block := fin.read(CHUNK):
                fout.write(block)
                size += len(block)
        os.replace(tmp, blob)
        return name, size, True

    def manifest(self, checkpoint_id: str) -> dict:
        path = self._manifest_path(checkpoint_id)
        if not os.path.exists(path):
            raise KeyError(f"no checkpoint {checkpoint_id!r} in {self.directory}")
        with open(path, "rb") as handle:
            data = json.loads(handle.read())
        if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("entries"), dict):
            raise ValueError(f"checkpoint {checkpoint_id!r}: not a version-1 manifest")
        return data

    def materialize(self, checkpoint_id: str, target: str) -> dict[str, tuple]:
        """Write the layer of ``checkpoint_id`` into the empty directory ``target``; returns the stat cache
        for the next checkpoint of this layer."""
        entries = self.manifest(checkpoint_id)["entries"]
        cache: dict[str, tuple] = {}
        dirs = []
        for rel, entry in entries.items():
            if rel.startswith("/") or ".." in rel.split("/"):
                raise ValueError(f"checkpoint {checkpoint_id!r}: entry path {rel!r} leaves the layer")
            path = os.path.join(target, rel)
            kind = entry["type"]
            if kind == "d":
                os.mkdir(path, 0o700)
                dirs.append((path, entry))
                continue
            if kind == "f":
                blob = self._blob(entry["sha256"])
                with open(blob, "rb") as fin, open(path, "wb") as fout:
                    while block := fin.read(CHUNK):
                        fout.write(block)
            elif kind == "l":
                os.symlink(entry["target"], path)
            elif kind == "w":
                os.mknod(path, stat.S_IFCHR, 0)
            else:
                raise ValueError(f"checkpoint {checkpoint_id!r}: unknown entry type {kind!r} at {rel!r}")
            _finish(path, _Attrs(entry), {k: bytes.fromhex(v) for k, v in entry.get("xattrs", {}).items()})
            if kind == "f":
                st = os.lstat(path)
                cache[rel] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, entry["sha256"])
        for path, entry in reversed(dirs):       # children first: their writes would bump the parent's mtime
            _finish(path, _Attrs(entry), {k: bytes.fromhex(v) for k, v in entry.get("xattrs", {}).items()})
        return cache

    def size_bytes(self) -> int:
        total = 0
        for dirpath, _, filenames in os.walk(self.directory):
            total += sum(os.lstat(os.path.join(dirpath, name)).st_size for name in filenames)
        return total
