"""Packaging as a user installs it: every package kimik3 imports is declared in pyproject.toml, the
extras there are the ones ``kimik3/extras.py`` names, and the core (no extra installed) imports,
trains and generates, while ``kimik3 serve`` without its extra stops with one clear line.

The core is run in a subprocess whose import system hides the extras' packages: every finder of
``sys.meta_path`` is wrapped so that it does not find them, which is what an environment without
them looks like (``import`` raises ModuleNotFoundError, ``importlib.util.find_spec`` returns None).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from kimik3.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kimik3"
HIDDEN = sorted({module for modules in EXTRAS.values() for module in modules})

# Prepended to every subprocess below: hide the extras' packages from the import system.
WITHOUT_EXTRAS = f"""
import sys

HIDDEN = {HIDDEN!r}
leaked = sorted(name for name in sys.modules if name.partition(".")[0] in HIDDEN)
assert not leaked, f"already imported before the finders were wrapped: {{leaked}}"


class Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
"""


def _distribution(requirement: str) -> str:
    return _normal(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0))


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imported_packages() -> dict[str, set[str]]:
    """Top-level names of the third-party packages imported anywhere in kimik3/, each with the files."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top != "kimik3" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    project = _project()
    declared = {_distribution(r) for r in project["dependencies"]}
    for requirements in project["optional-dependencies"].values():
        declared |= {_distribution(r) for r in requirements}
    distributions = packages_distributions()
    missing = {}
    for module, files in _imported_packages().items():
        names = {_normal(d) for d in distributions.get(module, [module])}
        if not names & declared:
            missing[module] = sorted(files)
    assert not missing, f"imported by kimik3 but declared in no dependency list of pyproject.toml: {missing}"


def test_the_extras_are_the_ones_kimik3_names():
    project = _project()
    core = {_distribution(r) for r in project["dependencies"]}
    extras = {name: {_distribution(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    distributions = packages_distributions()
    for extra, modules in EXTRAS.items():
        for module in modules:
            names = {_normal(d) for d in distributions.get(module, [module])}
            assert names & extras[extra], f"[{extra}] does not declare {module}"
            assert not names & core, f"{module} belongs to [{extra}] but is a core dependency"
    # pip install -e '.[dev]' (.ci/run) brings every extra the tests use.
    dev = " ".join(project["optional-dependencies"]["dev"])
    for extra in ("serve", "plot", "parquet"):
        assert re.search(rf"kimik3\[[^\]]*\b{extra}\b", dev), f"[dev] does not include [{extra}]"
    assert "triton" in extras["dev"]


def _run_without_extras(code: str, *args: str, env: dict[str, str] | None = None,
                        timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS + code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


IMPORT_ALL = """
import contextlib, importlib, io, json, pkgutil
import kimik3

outcome = {"kimik3": None}
for info in pkgutil.walk_packages(kimik3.__path__, "kimik3."):
    if info.name == "kimik3.__main__":   # runs the command line
        continue
    try:
        importlib.import_module(info.name)
        outcome[info.name] = None
    except ImportError as err:
        outcome[info.name] = [type(err).__name__, err.name, str(err)]
from kimik3.train.plot import plot_run

printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    plotted = plot_run(sys.argv[1], sys.argv[2])
hidden = sorted(n for n in sys.modules if n.partition(".")[0] in HIDDEN)
print(json.dumps({"modules": outcome, "hidden imported": hidden, "plotted": plotted, "printed": printed.getvalue()}))
"""


def test_the_core_imports_and_skips_the_plot_without_any_extra(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(3)))
    done = _run_without_extras(IMPORT_ALL, str(metrics), str(tmp_path / "loss.png"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["hidden imported"] == []
    outcome = result["modules"]
    failed = {module: error for module, error in outcome.items() if error is not None}
    for module, (kind, name, message) in failed.items():
        # Only the HTTP server needs [serve], and only kernel modules under ops/ import triton.
        if module in ("kimik3.serve.server", "kimik3.serve.openai_protocol"):
            assert kind == "MissingExtra" and "pip install 'kimik3[serve]'" in message, (module, message)
        else:
            assert module.startswith("kimik3.ops.") and name == "triton", (module, kind, message)
    core = [m for m in outcome if outcome[m] is None]
    for module in ("kimik3", "kimik3.cli", "kimik3.model.k3", "kimik3.model.sampling", "kimik3.ops.kda",
                   "kimik3.train.trainer", "kimik3.train.plot", "kimik3.train.data", "kimik3.serve.engine",
                   "kimik3.serve.types", "kimik3.serve.metrics", "kimik3.extras", "kimik3.files"):
        assert module in core, f"{module} does not import without the extras: {failed.get(module)}"
    # Training's plot is skipped with one line saying why, and nothing is written.
    assert result["plotted"] is None
    assert result["printed"] == PLOT_NOTICE + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


PLOT_NOTICE = ("skipping loss.png: the loss plot needs the [plot] extra: pip install 'kimik3[plot]' "
               "(no module named 'matplotlib')")
CLI = """
from kimik3.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def core_env(tmp_path_factory):
    return dict(os.environ, KIMIK3_CACHE=str(tmp_path_factory.mktemp("cache")))


def test_generate_without_any_extra(tmp_path, core_env):
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.train.data import Document
    from kimik3.train.tokenizer import train_tokenizer
    from tests.corpus import write_code_corpus
    from tests.train.small_run import small_config

    config = small_config()
    run = tmp_path / "run"
    K3ForCausalLM(config, seed=0).save_pretrained(run)
    corpus = write_code_corpus(tmp_path, 4)
    docs = [Document(p.name, p.read_text()) for p in sorted(corpus.glob("*.py"))]
    train_tokenizer(docs, config.vocab_size).save(str(run / "tokenizer.json"))

    # An untrained model samples ids across its whole vocabulary, past the small BPE's (those decode to nothing):
    # enough tokens that some are text.
    generated = _run_without_extras(CLI, "generate", "--run", str(run), "--prompt", "def alpha", "--max-tokens", "16",
                                    env=core_env)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("def alpha") and len(generated.stdout) > len("def alpha\n")


def test_serve_without_its_extra_says_what_to_install(tmp_path, core_env):
    served = _run_without_extras(CLI, "serve", "--run", str(tmp_path), env=core_env)
    assert served.returncode == 2 and served.stdout == ""
    assert served.stderr == ("kimik3 serve: error: kimik3 serve needs the [serve] extra: pip install 'kimik3[serve]' "
                             "(no module named 'fastapi')\n")


@pytest.mark.slow
def test_train_without_any_extra(tmp_path, core_env):
    """The whole of `kimik3 train` (two steps, evaluation, sample, checkpoint) with no extra installed."""
    from tests.corpus import write_code_corpus
    from tests.train.small_run import write_small_config

    (tmp_path / "corpus").mkdir()
    corpus = write_code_corpus(tmp_path / "corpus", 20)
    out = tmp_path / "run"
    trained = _run_without_extras(CLI, "train", "--config", str(write_small_config(tmp_path)), "--data", str(corpus),
                                  "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--out", str(out),
                                  "--no-progress", env=core_env)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert trained.stdout.count(PLOT_NOTICE) == 1, trained.stdout
    assert (out / "model.safetensors").is_file() and not (out / "loss.png").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
