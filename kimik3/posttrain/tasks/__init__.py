"""Verifiable tasks for post-training, generated locally and deterministically from a seed.

Three domains (``DOMAINS``) x three effort levels (``EFFORTS``): ``general`` (arithmetic and word
problems, ``tasks/general.py``), ``agents`` (tool use on a key-value store and a calculator,
``tasks/agents.py``) and ``coding`` (a Python function against hidden unit tests, ``tasks/coding.py``).
``make_tasks(domain, split, n, seed, effort)`` gives ``n`` distinct tasks; train and test problems
never overlap (``base.split_of``). Each ``Task`` has its prompt ``messages``, a ``reference`` solution
and ``score(completion) -> float`` in [0, 1] that never raises.
"""

from __future__ import annotations

from kimik3.posttrain.tasks.agents import agent_tasks
from kimik3.posttrain.tasks.base import DOMAINS, EFFORT_BUDGETS, EFFORTS, SPLITS, Task, check_domain_effort, split_of
from kimik3.posttrain.tasks.coding import coding_tasks
from kimik3.posttrain.tasks.general import general_tasks

_GENERATORS = {"general": general_tasks, "agents": agent_tasks, "coding": coding_tasks}


def make_tasks(domain: str, split: str, n: int, seed: int = 0, effort: str = "high",
               difficulty: str = "standard") -> list[Task]:
    """``n`` distinct ``split`` tasks of ``domain`` at ``effort``, a pure function of the arguments.
    ``difficulty``: ``standard``, or ``easy``: a level sized for a tiny model (general: a two-digit
    number plus or minus a single digit; agents: one set or delete call whose arguments the prompt gives;
    coding: ``x + k`` and ``a * x + b`` one-liners)."""
    check_domain_effort(domain, effort)
    return _GENERATORS[domain](split, n, seed, effort, difficulty)


__all__ = ["DOMAINS", "EFFORTS", "EFFORT_BUDGETS", "SPLITS", "Task", "make_tasks", "split_of"]
