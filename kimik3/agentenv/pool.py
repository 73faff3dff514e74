"""``SandboxPool``: many sandboxes, mostly paused, inside a memory budget.

A sandbox in the pool is *active* while a caller holds it (``with pool.use(key) as sandbox``), *paused*
otherwise (its cgroup frozen: zero CPU), or *evicted* (its writable layer checkpointed to disk, its
processes ended, its memory and tmpfs freed: near-zero memory, a few files on disk). After every
release the pool sums the memory of its live sandboxes (each cgroup's ``memory.usage_in_bytes``:
process memory, page cache, the tmpfs layer) and evicts the least recently used paused ones until the
sum fits ``memory_budget``. Using an evicted sandbox restores it from its checkpoint (files come back;
processes do not, as in ``Sandbox.restore``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kimik3.agentenv import layers
from kimik3.agentenv.sandbox import Limits, Sandbox


@dataclass(slots=True)
class _Entry:
    sandbox: Sandbox | None          # None when evicted
    checkpoint: str | None = None    # the checkpoint it was evicted to
    busy: bool = False


class SandboxPool:
    """Sandboxes keyed by id, paused when idle, evicted to disk past ``memory_budget`` bytes."""

    def __init__(self, memory_budget: int, *, image: str | None = None, limits: Limits | None = None,
                 allow: Sequence = (), store: str | None = None, base_dir: str | None = None):
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget}")
        self.memory_budget = memory_budget
        self.image, self.limits, self.allow, self.base_dir = image, limits or Limits(), tuple(allow), base_dir
        self._store_dir = store
        self.store: layers.CheckpointStore | None = None
        self._entries: OrderedDict[str, _Entry] = OrderedDict()       # least recently used first
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self.evictions = 0

    def _new(self, sandbox: Sandbox) -> str:
        if self.store is None:
            self.store = sandbox.store
        key = f"sb{next(self._ids)}"
        sandbox.pause()
        self._entries[key] = _Entry(sandbox)
        return key

    def create(self) -> str:
        """A new paused sandbox; its key."""
        with self._lock:
            sandbox = Sandbox.create(self.image, limits=self.limits, allow=self.allow, base_dir=self.base_dir,
                                     store=self.store or self._store_dir)
            key = self._new(sandbox)
            self._enforce()
            return key

    def fork(self, key: str) -> str:
        """A new paused sandbox with a copy of ``key``'s files; its key."""
        with self.use(key) as sandbox:
            child = sandbox.fork()
        with self._lock:
            new = self._new(child)
            self._enforce()
            return new

    @contextlib.contextmanager
    def use(self, key: str) -> Iterator[Sandbox]:
        """The running sandbox of ``key`` (resumed, or restored from disk if evicted); paused after."""
        with self._lock:
            entry = self._get(key)
            if entry.busy:
                raise RuntimeError(f"sandbox {key} is already in use")
            if entry.sandbox is None:
                entry.sandbox = Sandbox.from_checkpoint(entry.checkpoint, self.store, image=self.image,
                                                        limits=self.limits, allow=self.allow, base_dir=self.base_dir)
                entry.sandbox.pause()
            entry.busy = True
            self._entries.move_to_end(key)
        try:
            entry.sandbox.resume()
            yield entry.sandbox
        finally:
            with self._lock:
                entry.busy = False
                if entry.sandbox is not None and not entry.sandbox.closed:
                    entry.sandbox.pause()
                self._enforce()

    def resume_seconds(self, key: str) -> float:
        """How long making ``key`` runnable takes now (thaw, or restore from disk if evicted); it is
        paused again after."""
        start = time.perf_counter()
        with self.use(key):
            elapsed = time.perf_counter() - start
        return elapsed

    def _get(self, key: str) -> _Entry:
        if key not in self._entries:
            raise KeyError(f"no sandbox {key!r} in this pool")
        return self._entries[key]

    def live_memory(self) -> int:
        return sum(e.sandbox.memory_bytes() for e in self._entries.values() if e.sandbox is not None)

    def _enforce(self) -> None:
        total = self.live_memory()
        for key, entry in list(self._entries.items()):
            if total <= self.memory_budget:
                return
            if entry.sandbox is None or entry.busy:
                continue
            used = entry.sandbox.memory_bytes()
            entry.checkpoint = entry.sandbox.checkpoint()
            entry.sandbox.close()
            entry.sandbox = None
            self.evictions += 1
            total -= used

    def evict(self, key: str) -> None:
        """Checkpoint ``key`` to disk and free its memory now."""
        with self._lock:
            entry = self._get(key)
            if entry.busy:
                raise RuntimeError(f"sandbox {key} is in use")
            if entry.sandbox is not None:
                entry.checkpoint = entry.sandbox.checkpoint()
                entry.sandbox.close()
                entry.sandbox = None
                self.evictions += 1

    def state(self, key: str) -> str:
        entry = self._get(key)
        return "evicted" if entry.sandbox is None else ("active" if entry.busy else "paused")

    def stats(self) -> dict:
        with self._lock:
            states = [self.state(k) for k in self._entries]
            return {"sandboxes": len(states), "active": states.count("active"), "paused": states.count("paused"),
                    "evicted": states.count("evicted"), "live_memory": self.live_memory(),
                    "evictions": self.evictions}

    def close(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None and entry.sandbox is not None:
                entry.sandbox.close()

    def close_all(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self.close(key)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close_all()

    def __len__(self) -> int:
        return len(self._entries)
