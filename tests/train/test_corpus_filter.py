"""The embedded stdlib corpus skips generated data tables (issue 39): by path and by content."""

import base64
import random

import pytest

from kimik3.train.data import _DATA_LINE, data_table_reason, load_corpus, stdlib_root, stdlib_skip_reason
from tests.corpus import _code_file


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus()


def _code_page() -> str:
    """A gencodec-style module: a little codec code, then a 256-entry decoding table."""
    head = ['""" Python Character Mapping Codec generated for a test."""', "", "import codecs", "",
            "class Codec(codecs.Codec):", "    def encode(self, input, errors='strict'):",
            "        return codecs.charmap_encode(input, errors, encoding_table)", "",
            "decoding_table = ("]
    rows = [f"    '\\x{i:02x}'     #  0x{i:02X} -> LATIN LETTER NUMBER {i}" for i in range(256)]
    return "\n".join(head + rows + [")", "", "encoding_table = codecs.charmap_build(decoding_table)", ""])


def _giant_string() -> str:
    rng = random.Random(0)
    words = ["the", "statement", "evaluates", "expression", "object", "returns", "value", "list"]
    prose = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2_500))  # ~140 KB
    return f'"""Topics."""\n\nTOPICS = """\n{prose}\n"""\n\n\ndef topic(name):\n    return TOPICS\n'


def test_code_page_like_file_is_a_table():
    assert "literal-only lines" in data_table_reason(_code_page())


def test_giant_string_and_blob_files_are_tables():
    assert "string literal of" in data_table_reason(_giant_string())
    blob = base64.b64encode(random.Random(1).randbytes(12_000)).decode()
    one_line = f"import zlib\n\nDATA = {blob!r}\n\n\ndef load():\n    return zlib.decompress(DATA)\n"
    assert "a line of" in data_table_reason(one_line)
    wrapped = "\n".join(blob[i:i + 76] for i in range(0, len(blob), 76))  # under the giant-string size
    assert "literal-only lines" in data_table_reason(f'ICON = b"""\n{wrapped}\n"""\n\n\ndef icon():\n    return ICON\n')


def test_ordinary_code_is_kept():
    assert data_table_reason(_code_file(random.Random(0), 0)) is None
    root = stdlib_root()
    for rel in ["json/decoder.py", "os.py", "typing.py", "encodings/idna.py", "html/__init__.py", "opcode.py",
                "mimetypes.py", "keyword.py"]:
        assert stdlib_skip_reason(rel) is None, rel
        assert data_table_reason((root / rel).read_text(encoding="utf-8")) is None, rel


def test_stdlib_tables_are_skipped_by_path_and_content():
    for rel in ["encodings/cp1252.py", "encodings/aliases.py", "encodings/big5.py", "pydoc_data/topics.py",
                "_sysconfigdata__linux_x86_64-linux-gnu.py"]:
        assert stdlib_skip_reason(rel), rel
    root = stdlib_root()
    for rel in ["encodings/cp1252.py", "encodings/cp437.py", "html/entities.py"]:  # content alone catches these
        assert data_table_reason((root / rel).read_text(encoding="utf-8")), rel


def test_data_lines_fail_fast_on_long_numbers():
    assert _DATA_LINE.fullmatch("1" * 5_000 + "x") is None  # numbers cannot split: no exponential backtracking
    assert _DATA_LINE.fullmatch("0x00a0: 0x00ff,  # NO-BREAK SPACE")
    assert not _DATA_LINE.fullmatch("x = 1")


def test_stdlib_corpus_skips_tables_and_keeps_modules(stdlib_corpus):
    names = {d.name for d in stdlib_corpus.train + stdlib_corpus.val}
    skipped = {name for name, _ in stdlib_corpus.skipped}
    assert {"json/decoder.py", "os.py", "encodings/__init__.py", "encodings/idna.py"} <= names
    assert {"encodings/cp1252.py", "html/entities.py"} <= skipped
    assert not names & skipped
    assert not any(n.startswith("pydoc_data/") or n.startswith("_sysconfigdata_") for n in names)
    assert not any(data_table_reason(d.text) for d in stdlib_corpus.train[:50])
    assert "generated data files skipped" in stdlib_corpus.description


def test_stdlib_document_list_is_deterministic(stdlib_corpus):
    again = load_corpus()
    assert [d.name for d in again.train] == [d.name for d in stdlib_corpus.train]
    assert [d.name for d in again.val] == [d.name for d in stdlib_corpus.val]
    assert again.skipped == stdlib_corpus.skipped and again.fingerprint == stdlib_corpus.fingerprint


def test_a_data_folder_is_not_filtered(tmp_path):
    (tmp_path / "table.py").write_text(_code_page())
    for i in range(12):
        (tmp_path / f"mod_{i:02d}.py").write_text(_code_file(random.Random(i), i))
    corpus = load_corpus(tmp_path)
    assert "table.py" in {d.name for d in corpus.train + corpus.val} and not corpus.skipped
