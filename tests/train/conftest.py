import pytest

from tests.corpus import write_code_corpus


@pytest.fixture(scope="session")
def code_corpus(tmp_path_factory):
    """A small folder of Python-like files (~150 KB), fast to tokenize."""
    return write_code_corpus(tmp_path_factory.mktemp("corpus"), 60)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KIMIK3_CACHE", str(tmp_path_factory.getbasetemp() / "kimik3-cache"))
