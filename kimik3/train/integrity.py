"""Checksums for checkpoint directories: a ``manifest.json`` of the sha256 and size of every file.

The manifest is written (and fsynced) inside a checkpoint's temporary directory after its other
files, so a published checkpoint always carries one. ``verify_manifest`` re-hashes every listed
file and names the first one that is missing, unreadable, of the wrong size or whose bytes changed
(a disk or copy that zeroed or truncated it). Files are hashed in fixed-size chunks, so a checkpoint
of any size is checked in constant memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

MANIFEST_FILE = "manifest.json"
CHUNK_BYTES = 8 << 20


class IntegrityError(ValueError):
    """A file of a checksummed directory is missing, unreadable or changed; the message names it."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, files: Iterable[str]) -> None:
    """Hash ``files`` (names inside ``directory``) into ``directory/manifest.json`` and fsync it.

    The directory is expected to be private (a checkpoint's temporary directory): the manifest is
    written in place, the atomic step is the caller's rename of the whole directory.
    """
    entries = {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
               for name in files}
    path = directory / MANIFEST_FILE
    with open(path, "w") as handle:
        json.dump({"algorithm": "sha256", "files": entries}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(directory: Path) -> dict[str, dict[str, object]] | None:
    """The manifest's ``{name: {"bytes", "sha256"}}``, or None when the directory has no manifest."""
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("algorithm") != "sha256":
            raise ValueError(f"unknown algorithm {data.get('algorithm')!r}")
        entries = data["files"]
        for name, entry in entries.items():
            if (not isinstance(entry["bytes"], int) or not isinstance(entry["sha256"], str)
                    or Path(name).name != name):
                raise ValueError(f"bad entry for {name!r}")
        return entries
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise IntegrityError(f"{path}: unreadable or malformed manifest ({err})") from None


def verify_manifest(directory: Path) -> bool:
    """Check every file the manifest lists. Returns False when there is no manifest (nothing to
    check), True when every file matches; raises ``IntegrityError`` naming the first bad file."""
    entries = read_manifest(directory)
    if entries is None:
        return False
    for name, entry in entries.items():
        path = directory / name
        try:
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise IntegrityError(f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated "
                                     "or overwritten)")
            if sha256_file(path) != entry["sha256"]:
                raise IntegrityError(f"{path}: sha256 differs from the manifest (the file is corrupt)")
        except FileNotFoundError:
            raise IntegrityError(f"{path}: missing (listed in {MANIFEST_FILE})") from None
        except OSError as err:
            raise IntegrityError(f"{path}: unreadable ({err.strerror or err})") from None
    return True
