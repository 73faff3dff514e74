"""Training corpora: the embedded default (the Python standard library's own sources) or a folder.

The default corpus needs no download and exists wherever Python does: every ``.py`` file under
``sysconfig``'s stdlib path, minus test suites and site-packages. A folder given with ``--data``
may hold text and code files (read as UTF-8), ``.jsonl`` (one JSON object per line with a
``text`` field) and ``.parquet`` (a ``text`` column; needs pyarrow).

Validation files are held out by a stable hash of their relative path, so the split does not
depend on the file system's listing order or on the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js",
    ".ts", ".java", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".html", ".css", ".tex",
})
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MIN_CORPUS_CHARS = 20_000


class DataError(ValueError):
    """The data path cannot give a usable corpus; raised before any training starts."""


@dataclass(slots=True)
class Document:
    name: str   # path relative to the corpus root (plus ':line' for jsonl/parquet rows)
    text: str


@dataclass(slots=True)
class Corpus:
    train: list[Document]
    val: list[Document]
    root: str
    description: str
    fingerprint: str = field(default="")  # changes when any file's name, size or content changes

    @property
    def num_chars(self) -> int:
        return sum(len(d.text) for d in self.train) + sum(len(d.text) for d in self.val)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_validation(name: str, val_every: int) -> bool:
    digest = hashlib.sha1(name.encode()).digest()
    return int.from_bytes(digest[:4], "little") % val_every == 0


def _walk(root: Path, excluded_dirs: frozenset[str] = frozenset()) -> list[Path]:
    files = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded_dirs and not d.startswith("."))
        files.extend(Path(directory) / f for f in sorted(filenames) if not f.startswith("."))
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise DataError(f"cannot read {path}: {err}") from None


def _read_jsonl(path: Path, rel: str) -> list[Document]:
    docs = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: malformed JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{path}:{number}: each line must be an object with a string 'text' field")
        docs.append(Document(f"{rel}:{number}", record["text"]))
    return docs


def _read_parquet(path: Path, rel: str) -> list[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install 'kimik3[parquet]')") from None
    try:
        table = pq.read_table(path, columns=["text"])
    except Exception as err:  # pyarrow raises several types for bad files and missing columns
        raise DataError(f"{path}: cannot read a 'text' column ({err})") from None
    return [Document(f"{rel}:{i}", t) for i, t in enumerate(table.column("text").to_pylist()) if isinstance(t, str)]


def _documents(path: Path, rel: str) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, rel)
    if suffix == ".parquet":
        return _read_parquet(path, rel)
    if suffix in TEXT_SUFFIXES:
        return [Document(rel, _read_text(path))]
    return []


def load_corpus(data: str | Path | None = None, val_every: int = 30) -> Corpus:
    """Read the corpus at ``data`` (default: the stdlib sources) and split off validation files.

    Raises ``DataError`` when the path does not exist, holds no readable documents, or is too
    small to train on (fewer than 20,000 characters, or nothing left for validation).
    """
    if data is None:
        root = stdlib_root()
        paths = [p for p in _walk(root, STDLIB_EXCLUDED_DIRS) if p.suffix == ".py"]
        description = f"Python {sysconfig.get_python_version()} standard library sources ({root})"
    else:
        root = Path(data).expanduser()
        if not root.exists():
            raise DataError(f"data path {str(root)!r} does not exist")
        paths = [root] if root.is_file() else _walk(root)
        description = f"files under {root}"
        if root.is_file():
            root = root.parent

    docs: list[Document] = []
    hasher = hashlib.sha256()
    for path in paths:
        rel = path.relative_to(root).as_posix()
        for doc in _documents(path, rel):
            if doc.text.strip():
                docs.append(doc)
                hasher.update(f"{doc.name}\0{len(doc.text)}\0".encode())
                hasher.update(hashlib.sha1(doc.text.encode("utf-8", "replace")).digest())
    if not docs:
        kinds = ", ".join(sorted(TEXT_SUFFIXES | {".jsonl", ".parquet"}))
        raise DataError(f"no readable documents under {str(data or root)!r} (looked for {kinds})")
    total = sum(len(d.text) for d in docs)
    if total < MIN_CORPUS_CHARS:
        raise DataError(f"corpus under {str(data or root)!r} is too small: {total:,} characters "
                        f"(need at least {MIN_CORPUS_CHARS:,})")

    val = [d for d in docs if _is_validation(d.name, val_every)]
    train = [d for d in docs if not _is_validation(d.name, val_every)]
    if not val:  # tiny corpora: hold out the last document rather than none
        val, train = train[-1:], train[:-1]
    if not train:
        raise DataError(f"corpus under {str(data or root)!r} has a single document: nothing left to train on")
    return Corpus(train=train, val=val, root=str(root), description=description, fingerprint=hasher.hexdigest())
