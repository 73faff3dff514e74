"""Piecewise CUDA graphs: a forward captured as a chain of graphs, split at the calls that cannot be captured.

A prefill chunk's forward is fixed by its token count T everywhere but where an MLA layer attends over the cached
latents: how many there are (a host integer) shapes that work, and it changes with every chunk. ``PiecewiseGraph``
captures the forward once for a given T. Each call that cannot be captured goes through ``eager_region`` (the
paged latent cache's seam, ``PagedLatentView.eager_region``), which ends the graph being captured, runs the call
eagerly, and begins the next graph. ``replay`` replays the graphs in order and runs the eager calls between them
again, copying each one's result to where the next graph reads it. The host then issues a few launches a layer
of MLA instead of the whole forward's.

Contract of an eager region ``fn(*args)``: it returns one tensor, its arguments are tensors the graphs wrote (or
objects whose host state the caller updates before each replay), and it never synchronises with the host.
Outside a capture ``eager_region`` is a plain call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

_state = threading.local()   # the PiecewiseGraph capturing on this thread, if any


def eager_region(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``fn(*args)``; while a ``PiecewiseGraph`` captures on this thread, also a split point of its graphs."""
    recorder = getattr(_state, "recorder", None)
    return fn(*args) if recorder is None else recorder._split(fn, args)


class PiecewiseGraph:
    """One forward as CUDA graphs with eager regions between them (see the module notes). ``pool``: the memory
    pool the graphs share (tensors one graph writes and a later one reads live there between them)."""

    def __init__(self, pool: Any, stream: torch.cuda.Stream):
        self._pool = pool
        self._stream = stream
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.regions: list[tuple[Callable[..., torch.Tensor], tuple, torch.Tensor]] = []
        self.output: torch.Tensor | None = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Capture ``forward()`` (already run once eagerly at these shapes, so that nothing compiles or
        autotunes under capture); returns its output, which every replay rewrites in place."""
        if self.graphs:
            raise RuntimeError("PiecewiseGraph.capture runs once")
        if getattr(_state, "recorder", None) is not None:
            raise RuntimeError("a PiecewiseGraph is already capturing on this thread")
        torch.cuda.synchronize()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self._begin()
            _state.recorder = self
            try:
                self.output = forward()
            finally:
                _state.recorder = None
                # Also on an error: end the graph still capturing (none when an eager region raised, between two).
                if torch.cuda.is_current_stream_capturing():
                    self.graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(self._stream)
        torch.cuda.synchronize()
        return self.output

    def replay(self) -> torch.Tensor:
        """Run the forward again on the current stream: the graphs, and between them the eager regions."""
        for index, graph in enumerate(self.graphs):
            graph.replay()
            if index < len(self.regions):
                fn, args, out = self.regions[index]
                out.copy_(fn(*args))
        return self.output

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self.graphs.append(graph)

    def _split(self, fn: Callable[..., torch.Tensor], args: tuple) -> torch.Tensor:
        self.graphs[-1].capture_end()
        out = fn(*args)   # eagerly, on the capture stream: its result's memory is what the next graph reads
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"an eager region returns one tensor, {fn!r} returned {type(out).__name__}")
        self.regions.append((fn, args, out))
        self._begin()
        return out
