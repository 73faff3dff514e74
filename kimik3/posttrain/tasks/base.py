"""What every verifiable task shares: the ``Task`` record, effort levels, the split rule and the verdict guard.

A task is a prompt (OpenAI-style ``messages``: a system message stating the reasoning-effort budget,
then the user's problem), a reference continuation (the assistant turns, and for tool use the tool
results between them) and a verifier ``score(completion) -> float in [0, 1]``. ``completion`` is the
assistant's text: for a multi-turn task, its turns joined with newlines (``Task.completion_of``).

**Splits.** Whether a problem is a train or a test problem is a pure function of its *key* (the
domain and the problem's parameters, not the effort or the seed): ``split_of(key)``. A generator draws
candidate problems from a seeded RNG and keeps those of the asked split, so the two splits can never
share a problem, whatever the seeds and sizes, and the same problem is never train at one effort and
test at another.

**Effort.** The effort level is a budget of reasoning tokens, stated in the system prompt
(``EFFORT_BUDGETS``); the reasoning goes in ``<think>...</think>`` before the answer, and the reference
solutions reason more at higher effort (a bare equation at ``low``, the steps at ``high``, the steps
and a check at ``max``), always within the budget.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

DOMAINS = ("general", "agents", "coding")
EFFORTS = ("low", "high", "max")
EFFORT_BUDGETS = {"low": 64, "high": 256, "max": 1024}   # reasoning tokens allowed in <think>
SPLITS = ("train", "test")
TEST_SHARE = 5            # one problem key in TEST_SHARE is a test problem
MAX_COMPLETION_CHARS = 100_000   # a verifier reads no further (garbage can be arbitrarily long)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def check_domain_effort(domain: str, effort: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: choose one of {', '.join(DOMAINS)}")
    if effort not in EFFORTS:
        raise ValueError(f"unknown effort {effort!r}: choose one of {', '.join(EFFORTS)}")


def split_of(key: str) -> str:
    """The split a problem belongs to, from a stable hash of its key (never from a seed)."""
    digest = hashlib.sha256(key.encode()).digest()
    return "test" if int.from_bytes(digest[:4], "little") % TEST_SHARE == 0 else "train"


def problem_rng(domain: str, seed: int, index: int) -> random.Random:
    """The generator of candidate ``index`` (string seeds hash deterministically on every platform)."""
    return random.Random(f"kimik3-task|{domain}|{seed}|{index}")


def system_prompt(effort: str, instructions: str) -> str:
    budget = EFFORT_BUDGETS[effort]
    return (f"Reasoning effort: {effort}. Think inside {THINK_OPEN}...{THINK_CLOSE} using at most {budget} "
            f"tokens, then answer. {instructions}")


def think(text: str) -> str:
    return f"{THINK_OPEN}\n{text}\n{THINK_CLOSE}\n"


def after_think(text: str) -> str:
    """The text after the last ``</think>`` (all of it when there is none): where answers are read."""
    cut = text.rfind(THINK_CLOSE)
    return text[cut + len(THINK_CLOSE):] if cut >= 0 else text


def reasoning_of(text: str) -> str:
    """The text inside every ``<think>...</think>`` of ``text`` (an unclosed one runs to the end), joined by
    newlines: what the effort's budget of reasoning tokens bounds."""
    parts, start = [], text.find(THINK_OPEN)
    while start >= 0:
        end = text.find(THINK_CLOSE, start)
        parts.append(text[start + len(THINK_OPEN):end if end >= 0 else len(text)])
        start = text.find(THINK_OPEN, end) if end >= 0 else -1
    return "\n".join(parts)


def guarded(verdict: Callable[[str], float]) -> Callable[[Any], float]:
    """A verifier that never raises: anything that is not a string, or any failure, scores 0; the score
    is clipped to [0, 1] and the completion cut at ``MAX_COMPLETION_CHARS``."""
    def score(completion: Any) -> float:
        if not isinstance(completion, str):
            return 0.0
        try:
            value = float(verdict(completion[:MAX_COMPLETION_CHARS]))
        except Exception:   # a verifier's verdict on garbage is 0, whatever the garbage broke
            return 0.0
        return min(1.0, max(0.0, value)) if value == value else 0.0
    return score


@dataclass(frozen=True)
class Task:
    """One verifiable problem at one effort level.

    ``messages``: the prompt (system + user). ``reference``: the messages that follow it in a correct
    solution: one assistant message, or for tool use assistant turns with the tool results (user
    messages) between them. ``score(completion)``: 1.0 when the completion solves the problem, else 0.0;
    it never raises. ``reply(turns)``: for a multi-turn task, the user message answering the assistant's
    turns so far (the tool results of the last one), or None when the episode is over."""

    domain: str
    effort: str
    split: str
    key: str                                   # the problem's identity (the split is a function of it)
    messages: tuple[dict[str, str], ...]
    reference: tuple[dict[str, str], ...]
    verdict: Callable[[str], float] = field(repr=False, compare=False)
    responder: Callable[[Sequence[str]], str | None] | None = field(default=None, repr=False, compare=False)
    max_turns: int = 1

    def score(self, completion: Any, reasoning_tokens: int | None = None) -> float:
        """``reasoning_tokens``: how many tokens the completion spent inside ``<think>`` (counted by the caller,
        who has the tokenizer); over the effort's budget scores 0, whatever the answer."""
        if reasoning_tokens is not None and reasoning_tokens > EFFORT_BUDGETS[self.effort]:
            return 0.0
        return guarded(self.verdict)(completion)

    def reply(self, turns: Sequence[str]) -> str | None:
        if self.responder is None or len(turns) >= self.max_turns:
            return None
        try:
            return self.responder(list(turns))
        except Exception:   # a turn the environment cannot answer ends the episode
            return None

    @property
    def prompt(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages]

    def sft_messages(self) -> list[dict[str, str]]:
        """The prompt followed by the reference: one supervised conversation."""
        return [dict(m) for m in self.messages + self.reference]

    def reference_completion(self) -> str:
        return self.completion_of([m["content"] for m in self.reference if m["role"] == "assistant"])

    @staticmethod
    def completion_of(turns: Sequence[str]) -> str:
        """The completion a verifier reads from a multi-turn episode's assistant turns."""
        return "\n".join(turns)

    def to_json(self) -> dict[str, Any]:
        return {"domain": self.domain, "effort": self.effort, "split": self.split, "key": self.key,
                "messages": self.prompt, "reference": [dict(m) for m in self.reference]}


Builder = Callable[[str, str], Task]   # (effort, split) -> Task


def level(difficulties: dict[str, Callable[[random.Random], tuple[str, Builder]]], difficulty: str):
    """A domain's problem maker at ``difficulty``, or a clear error naming the levels it has."""
    if difficulty not in difficulties:
        raise ValueError(f"unknown difficulty {difficulty!r}: choose one of {', '.join(difficulties)}")
    return difficulties[difficulty]


def generate(domain: str, make: Callable[[random.Random], tuple[str, Builder]], split: str, n: int, seed: int,
             effort: str, max_tries_per_task: int = 200) -> list[Task]:
    """``n`` distinct tasks of ``split`` at ``effort``: candidates ``make(rng)`` -> (key, build) drawn with
    ``problem_rng(domain, seed, i)`` for i = 0, 1, ..., keeping the new keys of the split."""
    check_domain_effort(domain, effort)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: choose train or test")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    tasks: list[Task] = []
    seen: set[str] = set()
    index = 0
    while len(tasks) < n:
        if index > max_tries_per_task * (n + 10):
            raise ValueError(f"{domain}: found only {len(tasks)} distinct {split} problems of the {n} asked")
        key, build = make(problem_rng(domain, seed, index))
        index += 1
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        tasks.append(build(effort, split))
    return tasks
