"""Learning-rate and context-length schedules.

Cosine decay with linear warmup (the seed's note: cosine beat WSD for K3), and context-length
stages: the sequence length grows on a schedule, as K3's 8K -> 64K -> 256K -> 1M, scaled down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def cosine_lr(step: int, total_steps: int, base_lr: float, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """LR at ``step`` (0-based) of ``total_steps``: linear warmup to ``base_lr``, then cosine down to
    ``min_ratio * base_lr``, reached at the last step (``total_steps - 1``)."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = total_steps - 1 - warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup_steps) / span)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(slots=True)
class ContextStage:
    start_fraction: float  # of the total steps
    seq_len: int


def parse_stages(spec: str) -> list[ContextStage]:
    """``"0:128,0.3:256,0.7:512"`` -> stages (fraction of training : sequence length)."""
    stages = []
    for item in spec.split(","):
        try:
            frac, length = item.split(":")
            stages.append(ContextStage(float(frac), int(length)))
        except ValueError:
            raise ValueError(f"context stage {item!r} is not 'fraction:seq_len'") from None
    if not stages or stages[0].start_fraction != 0.0:
        raise ValueError(f"context stages must start at fraction 0, got {spec!r}")
    fracs = [s.start_fraction for s in stages]
    if fracs != sorted(fracs) or fracs[-1] >= 1.0 or any(s.seq_len < 2 for s in stages):
        raise ValueError(f"context stages need increasing fractions in [0, 1) and seq_len >= 2, got {spec!r}")
    return stages


def stage_at(step: int, total_steps: int, stages: list[ContextStage]) -> int:
    """Index of the context stage that ``step`` (0-based) of ``total_steps`` falls in."""
    fraction = step / max(1, total_steps)
    index = 0
    for i, stage in enumerate(stages):
        if fraction >= stage.start_fraction:
            index = i
    return index


def stage_start(index: int, total_steps: int, stages: list[ContextStage]) -> int:
    """The first step of stage ``index`` in a run of ``total_steps`` (``total_steps`` when it has none): the
    smallest step that ``stage_at`` puts in that stage or a later one."""
    total = max(1, total_steps)
    fraction = stages[index].start_fraction
    step = math.ceil(fraction * total)
    while step > 0 and (step - 1) / total >= fraction:   # the float comparison ``stage_at`` makes
        step -= 1
    while step / total < fraction:
        step += 1
    return min(step, total_steps)


def seq_len_at(step: int, total_steps: int, stages: list[ContextStage]) -> int:
    return stages[stage_at(step, total_steps, stages)].seq_len
