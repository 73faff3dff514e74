"""Files written so that a kill at any moment leaves the old contents or the new, never half.

``atomic_write`` writes a temporary sibling (``.<name>.<random>.tmp``), fsyncs it, renames it over
the target and fsyncs the folder, so the rename itself survives a power cut. Used for model files
(``model/pretrained.py``), the tokenizer cache and a training run's small files (``train/``).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path


def temporary_pattern(name: str) -> str:
    """The regex of the temporaries ``atomic_write`` leaves beside ``name`` if killed mid-write."""
    return rf"\.{re.escape(name)}\.[a-z0-9_]+\.tmp"


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then rename onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace the text file ``path`` by ``text`` all at once (``atomic_write``)."""
    atomic_write(path, lambda tmp: tmp.write_text(text))
