import pytest

from tests.corpus import write_code_corpus


@pytest.fixture(scope="session")
def code_corpus(tmp_path_factory):
    """A small folder of Python-like files (~150 KB), fast to tokenize."""
    return write_code_corpus(tmp_path_factory.mktemp("corpus"), 60)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("KIMIK3_CACHE", str(tmp_path_factory.getbasetemp() / "kimik3-cache"))


@pytest.fixture(scope="session")
def small_config_path(tmp_path_factory):
    """A K3Config JSON of a 3-layer, width-32 model (tests/train/small_run.py)."""
    from tests.train.small_run import write_small_config

    return write_small_config(tmp_path_factory.mktemp("config"))


@pytest.fixture(scope="session")
def straight(small_config_path, code_corpus, tmp_path_factory):
    """An uninterrupted 6-step run of the small model, checkpointed every 2 steps (kept: 4 and 6) and
    evaluated every 3; what it printed is in ``straight.log`` beside it. Shared by every test of the
    session (worker): read it, or damage and continue ``run_copy``."""
    from kimik3.train.trainer import Trainer
    from tests.train.small_run import small_args

    out = tmp_path_factory.mktemp("runs") / "straight"
    log: list[str] = []
    with pytest.MonkeyPatch.context() as patch:   # the cache isolated_cache sets, before it runs
        patch.setenv("KIMIK3_CACHE", str(tmp_path_factory.getbasetemp() / "kimik3-cache"))
        Trainer(small_args(small_config_path, code_corpus, out), log=log.append).run()
    (out.parent / "straight.log").write_text("\n".join(log))
    return out


@pytest.fixture
def run_copy(straight, tmp_path):
    """A private copy of ``straight``, to damage or continue."""
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(straight, target, symlinks=True)
    return target
