"""Training corpora: the embedded default (the Python standard library's own sources) or a folder.

The default corpus needs no download and exists wherever Python does: every ``.py`` file under
``sysconfig``'s stdlib path, minus test suites, site-packages and generated data tables (code
pages, entity and alias tables, ``pydoc_data``; see ``stdlib_skip_reason`` and ``data_table_reason``:
they teach nothing about Python, and a model trained on them completes ``def f(n):`` with
``0x57 -> LATIN SMALL LETTER ...``). A folder given with ``--data``
may hold text and code files (read as UTF-8), ``.jsonl`` (one JSON object per line with a
``text`` field) and ``.parquet`` (a ``text`` column; needs pyarrow).

Validation files are held out by a stable hash of their relative path, so the split does not
depend on the file system's listing order or on the machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sysconfig
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js",
    ".ts", ".java", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".html", ".css", ".tex",
})
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
MIN_CORPUS_CHARS = 20_000

# Generated data tables in the stdlib, skipped by path. ``encodings/`` is mostly gencodec output
# (``cp1252.py`` & co.: a 256-line decoding table each), alias tables and ~40 one-screen wrappers of C
# codecs that differ only in a name; these few are ordinary, hand-written code and stay.
STDLIB_KEPT_ENCODINGS = frozenset({
    "__init__.py", "idna.py", "punycode.py", "utf_8.py", "utf_8_sig.py", "utf_16.py", "utf_32.py",
    "charmap.py", "base64_codec.py", "bz2_codec.py", "hex_codec.py", "quopri_codec.py", "uu_codec.py",
    "zlib_codec.py",
})
STDLIB_SKIPPED_DIRS = ("pydoc_data/",)             # topics.py: the whole language reference as one dict
STDLIB_SKIPPED_PREFIXES = ("_sysconfigdata_",)     # this machine's build variables (not even portable)

# Generated data tables anywhere, skipped by content (``data_table_reason``).
DATA_LINE_SHARE = 2 / 3         # of the code characters on lines holding only literals
DATA_MIN_CODE_CHARS = 1_000     # smaller files are not judged by that share (an ``__all__`` list is fine)
GIANT_STRING_CHARS = 20_000     # one string literal this long is data (stdlib docstrings stay under 10K)
LONG_LINE_CHARS = 1_000         # no hand-written line is this long (the stdlib's longest: under 200)

# A "data line": only literals (strings, bytes, numbers, hex, None/True/False) with the punctuation of
# a table between them (``,`` ``:`` brackets ``+``), perhaps a trailing comment, e.g.
# ``'\xea'     #  0x88 -> LATIN SMALL LETTER E WITH CIRCUMFLEX`` or ``0x00a0: 0x00ff,``; or one
# run of base64/hex digits (an embedded blob). Numbers cannot split in two (``(?![\w.])``), so a
# failing line fails in linear time.
_SEP = r"[\s,:()\[\]{}+]*"
_LITERAL = ("(?:"
            r"[rRbBuU]{0,2}'(?:[^'\\\n]|\\.)*'"                                 # 'string', b'\x00'
            r'|[rRbBuU]{0,2}"(?:[^"\\\n]|\\.)*"'                                # "string"
            r"|-?(?:0[xXoObB][0-9a-fA-F_]+|\d[\d_]*(?:\.\d*)?(?:[eE][-+]?\d+)?)(?![\w.])"  # 0x1f, -2.5e3
            r"|(?:None|True|False)(?!\w))")
_DATA_LINE = re.compile(rf"{_SEP}(?:{_LITERAL}{_SEP})+(?:#.*)?")
_BLOB_LINE = re.compile(r"[A-Za-z0-9+/=\\]{32,}")
_DATA_LINE_STARTS = frozenset("'\"0123456789-([{,:+bBrRuUNTF")  # a data line starts with one of these
_TRIPLE_QUOTED = re.compile(r"(\"\"\"|\'\'\').*?\1", re.S)


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
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why): generated data tables

    @property
    def num_chars(self) -> int:
        return sum(len(d.text) for d in self.train) + sum(len(d.text) for d in self.val)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_skip_reason(rel: str) -> str | None:
    """Why the stdlib file at ``rel`` (a POSIX path relative to the stdlib root) is skipped, or None."""
    if rel.startswith("encodings/") and rel.count("/") == 1 and rel[len("encodings/"):] not in STDLIB_KEPT_ENCODINGS:
        return "generated codec table or wrapper (encodings/)"
    if rel.startswith(STDLIB_SKIPPED_DIRS) or rel.rsplit("/", 1)[-1].startswith(STDLIB_SKIPPED_PREFIXES):
        return "generated data (by path)"
    return None


def _data_line_share(text: str) -> tuple[int, float]:
    """(code characters, share of them on data lines); blank and comment-only lines do not count."""
    code = data = 0
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] == "#":
            continue
        code += len(s)
        if (s[0] in _DATA_LINE_STARTS and _DATA_LINE.fullmatch(s)) or (len(s) >= 32 and _BLOB_LINE.fullmatch(s)):
            data += len(s)
    return code, data / max(code, 1)


def _longest_string(text: str) -> int:
    """The longest string literal in ``text`` (0 when it does not tokenize as Python)."""
    try:
        return max((len(t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                    if t.type == tokenize.STRING), default=0)
    except (tokenize.TokenError, SyntaxError):
        return 0


def data_table_reason(text: str) -> str | None:
    """Why ``text`` (Python source) looks like a generated data table rather than code, or None.

    Cheap (under a second over the whole stdlib) and deliberately conservative; a file is a
    table when either

    * at least 2/3 of its code characters (stripped lines, comments and blank lines left out) are on
      lines holding only literals and table punctuation, in a file of at least 1,000 such characters
      (code pages, entity/alias/case-folding tables, ``_sysconfigdata``, ``stringprep``; also three
      hand-written modules that are mostly a table: ``locale`` 74%, ``_compat_pickle`` 85% and
      ``idlelib/mainmenu`` 75%; the highest share kept in Python 3.10-3.13 is ``html/__init__``, 61%); or
    * it has a line over 1,000 characters, or a string literal over 20,000 (embedded blobs, a
      reference manual as one string). The triple-quoted spans are found by a regular expression
      and a long one is confirmed with ``tokenize`` (a quote inside another string can fool the
      former).
    """
    code, share = _data_line_share(text)
    if code >= DATA_MIN_CODE_CHARS and share >= DATA_LINE_SHARE:
        return f"{share:.0%} of {code:,} code characters are literal-only lines"
    longest_line = max(map(len, text.splitlines()), default=0)
    if longest_line > LONG_LINE_CHARS:
        return f"a line of {longest_line:,} characters"
    if any(len(m.group(0)) > GIANT_STRING_CHARS for m in _TRIPLE_QUOTED.finditer(text)):
        longest = _longest_string(text)
        if longest > GIANT_STRING_CHARS:
            return f"a string literal of {longest:,} characters"
    return None


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
    stdlib = data is None
    if stdlib:
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
    skipped: list[tuple[str, str]] = []
    hasher = hashlib.sha256()   # over the kept documents only: skipping a file changes the fingerprint
    for path in paths:
        rel = path.relative_to(root).as_posix()
        if stdlib and (reason := stdlib_skip_reason(rel)):
            skipped.append((rel, reason))
            continue
        for doc in _documents(path, rel):
            if stdlib and (reason := data_table_reason(doc.text)):
                skipped.append((doc.name, reason))
            elif doc.text.strip():
                docs.append(doc)
                hasher.update(f"{doc.name}\0{len(doc.text)}\0".encode())
                hasher.update(hashlib.sha1(doc.text.encode("utf-8", "replace")).digest())
    if skipped:
        description += f", {len(skipped)} generated data files skipped"
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
    return Corpus(train=train, val=val, root=str(root), description=description, fingerprint=hasher.hexdigest(),
                  skipped=skipped)
