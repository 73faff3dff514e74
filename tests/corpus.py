"""A small generated corpus of Python-like files for the training tests: fast to tokenize, and the
same bytes on every machine (seeded)."""

import random
from pathlib import Path


def _code_file(rng: random.Random, index: int) -> str:
    names = ["alpha", "beta", "gamma", "delta", "value", "items", "total", "count", "result", "node"]
    lines = [f'"""Module {index}: generated for the training tests."""', "", "import math", ""]
    for f in range(rng.randint(6, 12)):
        a, b = rng.sample(names, 2)
        lines += [f"def {a}_{f}({a}, {b}=None):",
                  f'    """Return the {a} combined with the {b}."""',
                  f"    if {b} is None:",
                  f"        {b} = [{rng.randint(0, 9)}, {rng.randint(0, 9)}]",
                  f"    for i in range({rng.randint(2, 20)}):",
                  f"        {a} = {a} + i * {rng.randint(1, 5)}",
                  f"    return math.sqrt(abs({a})) + len({b})", ""]
    return "\n".join(lines) + "\n"


def write_code_corpus(root: Path, files: int) -> Path:
    rng = random.Random(0)
    for i in range(files):
        (root / f"mod_{i:03d}.py").write_text(_code_file(rng, i))
    return root
