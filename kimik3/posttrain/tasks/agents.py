"""The **general agents** domain: multi-step tool use against a small deterministic tool API, judged on
the final state of a key-value store.

**Tools.** A key-value store of integers and a calculator:

* ``calc EXPR``: an integer expression (``+ - * // %``, parentheses, integer literals, and store keys
  standing for their values); returns the value.
* ``set KEY VALUE``: stores the integer VALUE under KEY (``[a-z_][a-z0-9_]*``); returns ``ok``.
* ``get KEY``: returns the value stored under KEY.
* ``delete KEY``: removes KEY; returns ``ok``.

**Format.** The model calls a tool with ``<call>TOOL ARGS</call>`` (one call per turn in the
references); the environment answers with a user message of ``<result>...</result>`` lines, one per
call of the turn (``error: ...`` for a bad call: the episode goes on). A turn without a call ends the
episode (the references say ``Done.``). ``run_calls`` executes a completion's calls in order from the
task's initial store; the verifier compares the final store with the expected one (1 or 0), so what
counts is what the calls did, not what the model claims.

Everything is bounded so garbage cannot hang or blow up the executor: at most ``MAX_CALLS`` calls
per completion, ``MAX_KEYS`` keys, integers below 10**30 in magnitude, expressions of at most
``MAX_EXPR_CHARS`` characters parsed by ``ast`` into a whitelist of nodes (no power, no names other
than keys, no calls).
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kimik3.posttrain.tasks.base import Builder, Task, generate, level, system_prompt, think

CALL = re.compile(r"<call>([^<>]{0,300}?)</call>")
KEY = re.compile(r"[a-z_][a-z0-9_]{0,31}")
MAX_CALLS = 32
MAX_KEYS = 64
MAX_EXPR_CHARS = 200
LIMIT = 10 ** 30
INSTRUCTIONS = ("Tools: calc EXPR (integers, + - * // % and parentheses; store keys stand for their values), "
                "set KEY VALUE, get KEY, delete KEY. Call one tool per turn as <call>TOOL ARGS</call>; the "
                "result comes back as <result>...</result>. When the task is done, reply Done.")
KEYS = ("apples", "pears", "price", "qty", "stock", "total", "cost", "score", "bonus", "level", "width", "height",
        "count", "limit", "budget", "fee")


class ToolError(ValueError):
    """A call the tools refuse (its result is ``error: <message>``)."""


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def calculate(expression: str, store: Mapping[str, int]) -> int:
    """The value of an integer expression over ``store``'s keys; ``ToolError`` for anything else."""
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError("not an expression") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.Name):
            if node.id not in store:
                raise ToolError(f"no key {node.id}")
            result = store[node.id]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            result = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError("division by zero")
            result = _BINARY[type(node.op)](left, right)
        else:
            raise ToolError(f"unsupported: {type(node).__name__}")
        if abs(result) >= LIMIT:
            raise ToolError("number too large")
        return result

    try:
        return value(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def _integer(text: str) -> int:
    if not re.fullmatch(r"-?\d{1,30}", text):
        raise ToolError(f"not an integer: {text[:40]!r}")
    return int(text)


def execute(call: str, store: dict[str, int]) -> str:
    """Run one call (the text inside ``<call>...</call>``) on ``store`` in place; returns its result."""
    try:
        name, _, args = call.strip().partition(" ")
        args = args.strip()
        if name == "calc":
            return str(calculate(args, store))
        if name in ("get", "delete"):
            if not KEY.fullmatch(args):
                raise ToolError(f"not a key: {args[:40]!r}")
            if args not in store:
                raise ToolError(f"no key {args}")
            if name == "get":
                return str(store[args])
            del store[args]
            return "ok"
        if name == "set":
            key, _, text = args.partition(" ")
            if not KEY.fullmatch(key):
                raise ToolError(f"not a key: {key[:40]!r}")
            number = _integer(text.strip())
            if key not in store and len(store) >= MAX_KEYS:
                raise ToolError(f"the store holds {MAX_KEYS} keys already")
            store[key] = number
            return "ok"
        raise ToolError(f"unknown tool {name[:40]!r} (calc, set, get, delete)")
    except ToolError as err:
        return f"error: {err}"


def parse_calls(text: str) -> list[str]:
    """The calls of ``text`` in order (at most ``MAX_CALLS``)."""
    return [m.group(1) for m, _ in zip(CALL.finditer(text), range(MAX_CALLS))]


def run_calls(text: str, initial: Mapping[str, int]) -> tuple[dict[str, int], list[str]]:
    """Execute every call of ``text`` from a copy of ``initial``: (final store, results in order)."""
    store = dict(initial)
    return store, [execute(call, store) for call in parse_calls(text)]


def format_results(results: Sequence[str]) -> str:
    return "\n".join(f"<result>{r}</result>" for r in results)


@dataclass(slots=True)
class _Plan:
    store: dict[str, int]
    sentences: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)    # the reference's calls, in order


def _step(rng: random.Random, plan: _Plan, simulated: dict[str, int], easy: bool = False) -> None:
    """One random instruction, its reference calls, applied to ``simulated`` (``easy``: a set or a delete, one
    call)."""
    keys = sorted(simulated)
    free = [k for k in KEYS if k not in simulated]
    if easy:
        kind = rng.choice(("set", "del"))
    else:
        kind = rng.choice(("mul", "add", "set", "del") if len(keys) > 2 else ("mul", "add", "set"))
    if kind == "mul" and len(keys) >= 2 and free:
        a, b = rng.sample(keys, 2)
        new = rng.choice(free)
        plan.sentences.append(f"Store {a} times {b} as {new}.")
        plan.calls += [f"calc {a} * {b}", f"set {new} {{calc}}"]
        simulated[new] = simulated[a] * simulated[b]
    elif kind == "add":
        key, amount = rng.choice(keys), rng.randint(1, 99)
        plan.sentences.append(f"Increase {key} by {amount}.")
        plan.calls += [f"calc {key} + {amount}", f"set {key} {{calc}}"]
        simulated[key] += amount
    elif kind == "del":
        key = rng.choice(keys)
        plan.sentences.append(f"Delete {key}.")
        plan.calls.append(f"delete {key}")
        del simulated[key]
    else:
        key, number = rng.choice(free or keys), rng.randint(0, 500)
        plan.sentences.append(f"Set {key} to {number}.")
        plan.calls.append(f"set {key} {number}")
        simulated[key] = number


def _make(rng: random.Random, easy: bool = False) -> tuple[str, Builder]:
    start = {k: rng.randint(1, 99) for k in rng.sample(KEYS, rng.randint(1, 2) if easy else rng.randint(2, 3))}
    plan = _Plan(dict(start))
    simulated = dict(start)
    for _ in range(1 if easy else rng.randint(2, 3)):
        _step(rng, plan, simulated, easy)
    expected = dict(simulated)
    # The reference turns: each call with the calculator's last result filled in, the tool results between.
    store, turns, results, last = dict(start), [], [], ""
    for template in plan.calls:
        call = template.replace("{calc}", last)
        result = execute(call, store)
        if call.startswith("calc"):
            last = result
        turns.append(f"<call>{call}</call>")
        results.append(format_results([result]))
    if store != expected:   # the reference is built from the same steps: a mismatch is a bug here
        raise AssertionError(f"agents reference ends at {store}, expected {expected}")
    state = ", ".join(f"{k}={v}" for k, v in sorted(start.items()))
    question = f"The store holds: {state}.\nTask: " + " ".join(plan.sentences)
    key = f"agents|{state}|{' '.join(plan.sentences)}"
    steps = "\n".join(f"{i + 1}. {c.replace('{calc}', '<result>')}" for i, c in enumerate(plan.calls))
    final = ", ".join(f"{k}={v}" for k, v in sorted(expected.items()))
    count = f"{len(plan.calls)} call" + ("s" if len(plan.calls) > 1 else "")
    reasoning = {"low": f"{count}.", "high": f"Plan:\n{steps}",
                 "max": f"Plan:\n{steps}\nThen the store should be: {final}."}

    def build(effort: str, split: str) -> Task:
        reference: list[dict[str, str]] = []
        for i, (turn, result) in enumerate(zip(turns, results)):
            content = (think(reasoning[effort]) if i == 0 else "") + turn
            reference += [{"role": "assistant", "content": content}, {"role": "user", "content": result}]
        reference.append({"role": "assistant", "content": "Done."})

        def verdict(completion: str) -> float:
            return float(run_calls(completion, start)[0] == expected)

        def responder(turns_so_far: Sequence[str]) -> str | None:
            calls = parse_calls(turns_so_far[-1]) if turns_so_far else []
            if not calls:
                return None
            store, results = run_calls(Task.completion_of(turns_so_far), start)
            return format_results(results[-len(calls):])

        return Task(domain="agents", effort=effort, split=split, key=key,
                    messages=({"role": "system", "content": system_prompt(effort, INSTRUCTIONS)},
                              {"role": "user", "content": question}),
                    reference=tuple(reference), verdict=verdict, responder=responder,
                    max_turns=min(len(turns) + 4, 12))
    return key, build


def _easy(rng: random.Random) -> tuple[str, Builder]:
    """``difficulty="easy"``: one instruction, ``Set KEY to N.`` or ``Delete KEY.``, on a store of one or two keys:
    one call whose arguments are in the prompt, a level sized for a tiny model."""
    return _make(rng, easy=True)


DIFFICULTIES = {"standard": _make, "easy": _easy}


def agent_tasks(split: str, n: int, seed: int = 0, effort: str = "high", difficulty: str = "standard") -> list[Task]:
    return generate("agents", level(DIFFICULTIES, difficulty), split, n, seed, effort)
