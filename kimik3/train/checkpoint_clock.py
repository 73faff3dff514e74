"""When a training run writes a checkpoint: every N steps, or every so many seconds of wall time.

``--checkpoint-every`` takes either; the default is every 60 s, so a kill loses about a minute of
work at most. A time-based interval stretches to ``WRITE_SHARE`` x the last write's duration when
writes are slow (a big model), so checkpointing never takes more than ~10% of the run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_CHECKPOINT_EVERY = "60s"
WRITE_SHARE = 10           # a time-based checkpoint interval is at least 10x the last write's duration


@dataclass(frozen=True, slots=True)
class CheckpointEvery:
    """How often to checkpoint: every ``steps`` steps, or every ``seconds`` of wall time."""

    steps: int | None = None
    seconds: float | None = None


_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_checkpoint_every(value: int | str | None) -> CheckpointEvery:
    """``--checkpoint-every``: a step count (``100``, or an int as older checkpoints saved it) or a
    duration (``30s``, ``2m``, ``1.5h``); None means the default, every 60 s."""
    value = DEFAULT_CHECKPOINT_EVERY if value is None else value
    text = value.strip().lower() if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        steps = value
    elif text is not None and text.isdigit():
        steps = int(text)
    elif text is not None and (match := re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([smh])", text)):
        seconds = float(match[1]) * _UNIT_SECONDS[match[2]]
        if seconds <= 0:
            raise ValueError(f"--checkpoint-every must be a positive duration, got {value!r}")
        return CheckpointEvery(seconds=seconds)
    else:
        raise ValueError(f"--checkpoint-every must be a step count (100) or a duration (30s, 2m), got {value!r}")
    if steps < 1:
        raise ValueError(f"--checkpoint-every must be >= 1 step, got {value!r}")
    return CheckpointEvery(steps=steps)


class CheckpointClock:
    """Says after each step whether a checkpoint is due.

    By steps: every N-th step. By time: once ``interval`` seconds have passed since the last write
    ended, where ``interval`` = max(the duration asked for, 10 x the last write's duration), so
    that writing a big model never takes more than ~10% of the run.
    """

    def __init__(self, every: CheckpointEvery, log: Callable[[str], None] = print,
                 now: Callable[[], float] = time.monotonic):
        self.every, self.log, self.now = every, log, now
        self.interval = every.seconds
        self.last = now()
        self.stretched = False

    @property
    def timed(self) -> bool:
        return self.every.seconds is not None

    def restart(self) -> None:
        self.last = self.now()

    def due(self, step: int) -> bool:
        if self.every.steps is not None:
            return step % self.every.steps == 0
        return self.now() - self.last >= self.interval

    def written(self, seconds: float) -> None:
        """A checkpoint write of ``seconds`` just ended."""
        self.last = self.now()
        if not self.timed:
            return
        self.interval = max(self.every.seconds, WRITE_SHARE * seconds)
        if self.interval > self.every.seconds and not self.stretched:
            self.stretched = True
            self.log(f"a checkpoint write takes {seconds:.1f} s: checkpointing every {self.interval:.0f} s "
                     f"instead of every {self.every.seconds:g} s, so that writing costs at most "
                     f"~{100 // WRITE_SHARE}% of the run")
