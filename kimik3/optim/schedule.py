"""Learning-rate and context-length schedules.

Cosine decay with linear warmup (the seed's note: cosine beat WSD for K3), and context-length
stages: the sequence length grows on a schedule, as K3's 8K -> 64K -> 256K -> 1M, scaled down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def cosine_lr(step: int, total_steps: int, base_lr: float, warmup_steps: int, min_ratio: float = 0.1) -> float:
    """LR at ``step`` (0-based): linear warmup to ``base_lr``, cosine down to ``min_ratio * base_lr``."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
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


def seq_len_at(step: int, total_steps: int, stages: list[ContextStage]) -> int:
    fraction = step / max(1, total_steps)
    length = stages[0].seq_len
    for stage in stages:
        if fraction >= stage.start_fraction:
            length = stage.seq_len
    return length
