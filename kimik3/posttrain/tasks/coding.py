"""The **coding agents** domain: write a small Python function that passes hidden unit tests.

The prompt describes the function (its name, arguments and one example); the completion holds it in a
```` ```python ```` block (the last one counts; with no block, the text after the reasoning is taken as
code). The verifier runs the code with the hidden tests in a sandbox (``kimik3.posttrain.sandbox``:
timeout, no network; by default an AgentENV sandbox where the machine allows, in which each judging runs
in a fork of the trajectory's sandbox, so judging never changes the environment the agent works in)
and scores 1 when every test passes, else 0. Code that loops
forever, raises, exits, floods its output or reads the network scores 0.

The tests run in a harness (``HARNESS``) that reads the code and the tests from stdin, silences the
code's output, calls the function on each test's arguments and compares the result with the expected
one as canonical JSON (so ``True`` is not ``1``), then prints one line of counts after a random nonce
the code never sees directly.
"""

from __future__ import annotations

import json
import random
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kimik3.posttrain.sandbox import Sandbox, default_sandbox
from kimik3.posttrain.tasks.base import Builder, Task, after_think, generate, level, system_prompt, think

INSTRUCTIONS = "Write the Python function in a ```python code block."
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.{0,20000}?)```", re.S)
TIMEOUT_S = 5.0
MAX_CODE_CHARS = 20_000

HARNESS = """
import json, os, sys
def _main():
    spec = json.loads(sys.stdin.read())
    nonce, code, name, tests = spec["nonce"], spec["code"], spec["function"], spec["tests"]
    del spec
    out = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr = open(os.devnull, "w")
    passed = 0
    try:
        namespace = {"__name__": "solution"}
        exec(compile(code, "solution.py", "exec"), namespace)
        function = namespace[name]
        for args, expected in tests:
            try:
                if json.dumps(function(*args), sort_keys=True) == expected:
                    passed += 1
            except Exception:
                pass
    except Exception:
        pass
    out.write(nonce + json.dumps({"passed": passed, "total": len(tests)}) + "\\n")
    out.flush()
    os._exit(0)
_main()
"""


def extract_code(completion: str) -> str:
    """The last ```python block of the completion, else the text after its reasoning."""
    blocks = CODE_BLOCK.findall(completion)
    return (blocks[-1] if blocks else after_think(completion))[:MAX_CODE_CHARS]


def run_tests(code: str, function: str, tests: list[tuple[list[Any], Any]], sandbox: Sandbox | None = None,
              timeout_s: float | None = None) -> tuple[int, int]:
    """(tests passed, tests run) of ``code``'s ``function``; (0, n) when the code fails to run or times out
    (``timeout_s``, default ``TIMEOUT_S``, for all the tests together)."""
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "code": code, "function": function,
            "tests": [[list(args), json.dumps(expected, sort_keys=True)] for args, expected in tests]}
    result = (sandbox or default_sandbox()).run(HARNESS, json.dumps(spec), timeout_s or TIMEOUT_S)
    if result.timed_out:
        return 0, len(tests)
    for line in result.stdout.splitlines():
        if line.startswith(nonce):
            try:
                counts = json.loads(line[len(nonce):])
                return int(counts["passed"]), len(tests)
            except (ValueError, KeyError, TypeError):
                break
    return 0, len(tests)


@dataclass(frozen=True, slots=True)
class _Family:
    """A kind of function: its name choices, description, reference code, oracle and test inputs."""
    names: tuple[str, ...]
    params: Callable[[random.Random], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]
    body: Callable[[dict[str, Any]], str]            # the reference body (indented), after the def line
    signature: str
    oracle: Callable[[dict[str, Any], tuple], Any]
    inputs: Callable[[random.Random, dict[str, Any]], tuple]
    idea: Callable[[dict[str, Any]], str]              # one line: how (the high/max reasoning)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcde") for _ in range(rng.randint(0, 9)))


FAMILIES = (
    _Family(("shift", "bump", "offset"), lambda r: {"k": r.choice([i for i in range(-40, 41) if i])},
            lambda p: f"returns the integer x plus {p['k']}", lambda p: f"    return x + {p['k']}", "x",
            lambda p, a: a[0] + p["k"], lambda r, p: (r.randint(-1000, 1000),),
            lambda p: f"Add {p['k']} to x."),
    _Family(("affine", "line", "scale_add"), lambda r: {"a": r.randint(2, 9), "b": r.randint(-20, 20)},
            lambda p: f"returns {p['a']} * x + {p['b']} for an integer x",
            lambda p: f"    return {p['a']} * x + {p['b']}", "x",
            lambda p, a: p["a"] * a[0] + p["b"], lambda r, p: (r.randint(-500, 500),),
            lambda p: f"Multiply x by {p['a']}, then add {p['b']}."),
    _Family(("count_letter", "letter_count", "tally"), lambda r: {"c": r.choice("abcde")},
            lambda p: f"returns how many times the letter '{p['c']}' occurs in the string s",
            lambda p: f"    return s.count({p['c']!r})", "s",
            lambda p, a: a[0].count(p["c"]), lambda r, p: (_word(r),),
            lambda p: f"Count the '{p['c']}' characters with str.count."),
    _Family(("clamp", "bound", "limit"), lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(1, 50)})(
                r.randint(-50, 50)),
            lambda p: f"returns x limited to the range [{p['lo']}, {p['hi']}]",
            lambda p: f"    return max({p['lo']}, min({p['hi']}, x))", "x",
            lambda p, a: max(p["lo"], min(p["hi"], a[0])), lambda r, p: (r.randint(p["lo"] - 30, p["hi"] + 30),),
            lambda p: f"Take min with {p['hi']}, then max with {p['lo']}."),
    _Family(("sum_multiples", "multiples_sum"), lambda r: {"k": r.randint(2, 9)},
            lambda p: f"returns the sum of the integers i with 0 <= i < n that are divisible by {p['k']}",
            lambda p: f"    return sum(i for i in range(n) if i % {p['k']} == 0)", "n",
            lambda p, a: sum(i for i in range(a[0]) if i % p["k"] == 0), lambda r, p: (r.randint(0, 200),),
            lambda p: f"Loop over range(n) and add the i with i % {p['k']} == 0."),
    _Family(("power_sum", "sum_powers"), lambda r: {"p": r.randint(1, 3)},
            lambda p: f"returns 1**{p['p']} + 2**{p['p']} + ... + n**{p['p']} (0 when n is 0)",
            lambda p: f"    return sum(i ** {p['p']} for i in range(1, n + 1))", "n",
            lambda p, a: sum(i ** p["p"] for i in range(1, a[0] + 1)), lambda r, p: (r.randint(0, 60),),
            lambda p: f"Sum i ** {p['p']} for i from 1 to n."),
    _Family(("above", "greater_than", "keep_large"), lambda r: {"t": r.randint(-20, 20)},
            lambda p: f"returns the list of the numbers in the list xs that are greater than {p['t']}, in order",
            lambda p: f"    return [x for x in xs if x > {p['t']}]", "xs",
            lambda p, a: [x for x in a[0] if x > p["t"]],
            lambda r, p: ([r.randint(-40, 40) for _ in range(r.randint(0, 8))],),
            lambda p: f"Keep the x with x > {p['t']} in a list comprehension."),
    _Family(("repeat", "echo", "stutter"), lambda r: {"k": r.randint(2, 5), "sep": r.choice(["-", ",", " ", ""])},
            lambda p: f"returns the string s repeated {p['k']} times, joined by {p['sep']!r}",
            lambda p: f"    return {p['sep']!r}.join([s] * {p['k']})", "s",
            lambda p, a: p["sep"].join([a[0]] * p["k"]), lambda r, p: (_word(r),),
            lambda p: f"Join {p['k']} copies of s with {p['sep']!r}."),
    _Family(("digit_sum", "digits_total"), lambda r: {"base": r.choice([2, 3, 8, 10, 16])},
            lambda p: f"returns the sum of the digits of the non-negative integer n written in base {p['base']}",
            lambda p: (f"    total = 0\n    while n > 0:\n        total += n % {p['base']}\n"
                       f"        n //= {p['base']}\n    return total"), "n",
            lambda p, a: _digit_sum(a[0], p["base"]), lambda r, p: (r.randint(0, 100000),),
            lambda p: f"Add n % {p['base']} and divide n by {p['base']} until it is 0."),
)


def _digit_sum(n: int, base: int) -> int:
    total = 0
    while n > 0:
        total, n = total + n % base, n // base
    return total


def _make(rng: random.Random, families: int = len(FAMILIES)) -> tuple[str, Builder]:
    """A task of one of the first ``families`` families (all of them by default)."""
    index = rng.randrange(families)
    family = FAMILIES[index]
    params = family.params(rng)
    name = rng.choice(family.names)
    inputs, seen = [], set()
    for _ in range(40):
        args = family.inputs(rng, params)
        if repr(args) not in seen:
            seen.add(repr(args))
            inputs.append(args)
        if len(inputs) == 6:
            break
    tests = [(list(args), family.oracle(params, args)) for args in inputs]
    example_args, example = tests[0]
    call = f"{name}({', '.join(repr(a) for a in example_args)})"
    question = (f"Write a Python function `{name}({family.signature})` that {family.describe(params)}.\n"
                f"Example: {call} == {example!r}")
    code = f"def {name}({family.signature}):\n{family.body(params)}\n"
    idea = family.idea(params)
    reasoning = {"low": idea, "high": f"{idea}\nFor example {call} should give {example!r}.",
                 "max": (f"{idea}\nFor example {call} should give {example!r}.\n"
                         + "\n".join(f"Also {name}({', '.join(repr(a) for a in args)}) gives {out!r}."
                                     for args, out in tests[1:3]))}
    key = f"coding|{index}|{name}|{json.dumps(params, sort_keys=True)}"

    def build(effort: str, split: str) -> Task:
        def verdict(completion: str) -> float:
            passed, total = run_tests(extract_code(completion), name, tests)
            return float(total > 0 and passed == total)

        return Task(domain="coding", effort=effort, split=split, key=key,
                    messages=({"role": "system", "content": system_prompt(effort, INSTRUCTIONS)},
                              {"role": "user", "content": question}),
                    reference=({"role": "assistant",
                                "content": think(reasoning[effort]) + f"```python\n{code}```"},),
                    verdict=verdict)
    return key, build


def _easy(rng: random.Random) -> tuple[str, Builder]:
    """``difficulty="easy"``: the first two families only (``x + k`` and ``a * x + b``, ~1,200 problems), one-line
    functions whose constants the prompt states: a level sized for a tiny model. An easy task
    is also a standard one (same key, same split)."""
    return _make(rng, families=2)


DIFFICULTIES = {"standard": _make, "easy": _easy}


def coding_tasks(split: str, n: int, seed: int = 0, effort: str = "high", difficulty: str = "standard") -> list[Task]:
    return generate("coding", level(DIFFICULTIES, difficulty), split, n, seed, effort)
