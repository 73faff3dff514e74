"""What every CUDA-graph capture here does first (the serving runner's decode and prefill graphs, the training
step's ``CapturedStep``): run the work once, eagerly, on the side stream the capture will use."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def warm_up(device: torch.device, side: torch.cuda.Stream, forward: Callable[[], T]) -> T:
    """Run ``forward`` once on ``side`` (a stream of ``device``), ordered after the current stream's work and before
    what follows it: its kernels compile and autotune, its workspaces and lazy state are made before a capture,
    which must see none of that. Returns what ``forward`` returns."""
    current = torch.cuda.current_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = forward()
    current.wait_stream(side)
    return out
