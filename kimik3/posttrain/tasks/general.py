"""The **general** domain: multi-digit arithmetic and word problems with exact integer answers.

The completion ends with ``Answer: <integer>``; the verifier reads the last such line after the
reasoning (``</think>``) and compares it exactly. Reference reasoning by effort: ``low`` the bare
equation, ``high`` the computation split by place value (or the word problem's steps), ``max`` the same
followed by a check by the inverse operation.
"""

from __future__ import annotations

import random
import re

from kimik3.posttrain.tasks.base import Builder, Task, after_think, generate, level, system_prompt, think

INSTRUCTIONS = "End with a line 'Answer: N' where N is an integer."
ANSWER = re.compile(r"Answer:[ \t]*(-?\d{1,60})\b")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivo", "Jun", "Kemal", "Lena")
ITEMS = ("apples", "pencils", "stamps", "marbles", "coins", "cards", "shells", "beads")


def read_answer(completion: str) -> int | None:
    """The integer of the last ``Answer: N`` after the reasoning, or None."""
    found = ANSWER.findall(after_think(completion))
    return int(found[-1]) if found else None


def _parts(n: int) -> list[int]:
    """``n``'s nonzero place-value parts, largest first: 4302 -> [4000, 300, 2]."""
    digits = str(n)
    return [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits) if d != "0"] or [0]


def _chain(a: int, op: str, b: int) -> tuple[int, str]:
    """``a op b`` and its steps by place values of ``b`` (``high`` effort's reasoning)."""
    if op == "*":
        parts = _parts(b)
        products = [a * p for p in parts]
        steps = f"{a} * {b} = " + " + ".join(f"{a} * {p}" for p in parts)
        if len(parts) > 1:
            steps += " = " + " + ".join(str(p) for p in products)
        return a * b, steps + f" = {a * b}"
    total, lines = a, []
    for p in _parts(b):
        after = total + p if op == "+" else total - p
        lines.append(f"{total} {op} {p} = {after}")
        total = after
    return total, "\n".join(lines)


def _check(a: int, op: str, b: int, answer: int) -> str:
    if op == "+":
        return f"Check: {answer} - {b} = {answer - b}, which is {a}."
    if op == "-":
        return f"Check: {answer} + {b} = {answer + b}, which is {a}."
    if b == 0:
        return f"Check: anything times 0 is 0, so {answer} is right."
    return f"Check: {answer} / {b} = {answer // b}, which is {a}."


def _arithmetic(rng: random.Random) -> tuple[str, Builder]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 10 ** rng.randint(1, 3) - 1), rng.randint(2, 10 ** rng.randint(1, 2) - 1)
    else:
        a, b = rng.randint(10, 10 ** rng.randint(2, 4) - 1), rng.randint(1, 10 ** rng.randint(1, 4) - 1)
    answer, steps = _chain(a, op, b)
    question = f"Compute {a} {op} {b}."
    reasoning = {"low": f"{a} {op} {b} = {answer}", "high": steps, "max": steps + "\n" + _check(a, op, b, answer)}
    key = f"general|arith|{a}{op}{b}"
    return key, _builder(key, question, answer, reasoning)


def _word(rng: random.Random) -> tuple[str, Builder]:
    kind = rng.randrange(4)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == 0:     # boxes plus loose ones
        per, boxes, loose = rng.randint(3, 60), rng.randint(2, 30), rng.randint(1, 50)
        question = (f"{name} has {boxes} boxes of {per} {item} each and {loose} loose {item}. "
                    f"How many {item} does {name} have?")
        answer = per * boxes + loose
        steps = f"Boxes: {boxes} * {per} = {per * boxes}.\nWith the loose ones: {per * boxes} + {loose} = {answer}."
        check = f"Check: {answer} - {loose} = {per * boxes} = {boxes} * {per}."
        params = f"box{per},{boxes},{loose}"
    elif kind == 1:   # spend then earn
        start = rng.randint(20, 999)
        spent, earned = rng.randint(1, start), rng.randint(1, 500)
        question = (f"{name} had {start} {item}, gave away {spent}, then found {earned} more. "
                    f"How many {item} does {name} have now?")
        answer = start - spent + earned
        steps = (f"After giving away: {start} - {spent} = {start - spent}.\n"
                 f"After finding: {start - spent} + {earned} = {answer}.")
        check = f"Check: {answer} - {earned} + {spent} = {start}."
        params = f"spend{start},{spent},{earned}"
    elif kind == 2:   # rate times time
        speed, hours = rng.randint(12, 250), rng.randint(2, 24)
        question = f"A train travels {speed} km every hour for {hours} hours. How many km does it travel?"
        answer = speed * hours
        steps = f"Distance: {speed} * {hours} = {answer}."
        check = f"Check: {answer} / {hours} = {speed}."
        params = f"rate{speed},{hours}"
    else:             # equal sharing
        kids, each = rng.randint(2, 25), rng.randint(2, 80)
        total = kids * each
        question = f"{total} {item} are shared equally among {kids} children. How many {item} does each child get?"
        answer = each
        steps = f"Each child: {total} / {kids} = {answer}."
        check = f"Check: {answer} * {kids} = {total}."
        params = f"share{total},{kids}"
    reasoning = {"low": f"{answer}", "high": steps, "max": steps + "\n" + check}
    key = f"general|word|{params}"
    return key, _builder(key, question, answer, reasoning)


def _builder(key: str, question: str, answer: int, reasoning: dict[str, str]) -> Builder:
    def build(effort: str, split: str) -> Task:
        return Task(
            domain="general", effort=effort, split=split, key=key,
            messages=({"role": "system", "content": system_prompt(effort, INSTRUCTIONS)},
                      {"role": "user", "content": question}),
            reference=({"role": "assistant", "content": think(reasoning[effort]) + f"Answer: {answer}"},),
            verdict=lambda completion: float(read_answer(completion) == answer))
    return build


def _make(rng: random.Random) -> tuple[str, Builder]:
    return _arithmetic(rng) if rng.random() < 0.5 else _word(rng)


def _easy(rng: random.Random) -> tuple[str, Builder]:
    """``difficulty="easy"``: a two-digit number plus or minus a single digit (1,800 problems, ~360 of them test): a
    level sized for a tiny model, where the standard problems stay out of its reach. A test problem is never a train
    problem, but it is made of the same single-digit facts, so what is learned on the train problems can carry
    over."""
    a, b, op = rng.randint(10, 99), rng.randint(0, 9), rng.choice("+-")
    answer = a + b if op == "+" else a - b
    line = f"{a} {op} {b} = {answer}"
    reasoning = {"low": line, "high": line, "max": line + "\n" + _check(a, op, b, answer)}
    key = f"general|easy|{a}{op}{b}"
    return key, _builder(key, f"Compute {a} {op} {b}.", answer, reasoning)


DIFFICULTIES = {"standard": _make, "easy": _easy}


def general_tasks(split: str, n: int, seed: int = 0, effort: str = "high", difficulty: str = "standard") -> list[Task]:
    return generate("general", level(DIFFICULTIES, difficulty), split, n, seed, effort)
