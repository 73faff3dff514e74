"""Cache-affinity routing over engine replicas.

A request goes to the replica that would restore the longest prefix of its prompt from its prefix
cache (a multi-turn session keeps landing where its history is cached), unless that replica is
overloaded: more than ``slack`` requests (running + waiting) above the least loaded replica. Ties
and cold prompts go to the least loaded replica. A replica whose ``health()`` reports a failure
gets no new requests; the router is healthy while one replica is. The router is itself an
``EngineLike``: the HTTP server cannot tell one engine from several.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import fields

from kimik3.serve.engine import LLMEngine
from kimik3.serve.types import EngineStats, EngineUnavailable, GenerationRequest, TokenEvent


class ReplicaRouter:
    def __init__(self, replicas: Sequence[LLMEngine], slack: int = 4):
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one replica")
        first = replicas[0]
        if any(r.max_context != first.max_context or r.model_name != first.model_name for r in replicas):
            raise ValueError("all replicas must serve the same model with the same context")
        self.replicas = list(replicas)
        self.slack = slack
        self.model_name = first.model_name
        self.max_context = first.max_context
        self.tokenizer = first.tokenizer
        self.eos_token_id = first.eos_token_id
        self.image_rule = first.image_rule
        self._owner: dict[str, LLMEngine] = {}
        self.routed = [0] * len(self.replicas)   # requests sent to each replica
        self.affinity_hits = 0                   # requests sent for their cached prefix

    def choose(self, prompt_ids: list[int], images: list | None = None) -> int:
        alive = [i for i, r in enumerate(self.replicas) if r.health() is None]
        if not alive:
            raise EngineUnavailable(self.health() or "no replica can serve")
        loads = [stats.running + stats.waiting for stats in (r.stats() for r in self.replicas)]
        least = min(loads[i] for i in alive)
        matches = [r.prefix_match(prompt_ids, images) if i in alive else 0 for i, r in enumerate(self.replicas)]
        eligible = [i for i in alive if loads[i] <= least + self.slack]
        best = max(eligible, key=lambda i: (matches[i], -loads[i]))
        if matches[best] > 0:
            self.affinity_hits += 1
        return best

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        index = self.choose(request.prompt_ids, request.images)
        replica = self.replicas[index]
        self.routed[index] += 1
        self._owner[request.request_id] = replica
        try:
            async for event in replica.generate(request):
                yield event
        finally:
            self._owner.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            replica.abort(request_id)

    def stats(self) -> EngineStats:
        total = EngineStats()
        for stats in (r.stats() for r in self.replicas):
            for f in fields(EngineStats):
                mine, theirs = getattr(total, f.name), getattr(stats, f.name)
                if isinstance(mine, tuple):   # per position: summed position by position
                    longest = max(len(mine), len(theirs))
                    mine, theirs = (tuple(v) + (0,) * (longest - len(v)) for v in (mine, theirs))
                    setattr(total, f.name, tuple(a + b for a, b in zip(mine, theirs)))
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    def health(self) -> str | None:
        """None while any replica can serve; otherwise every replica's reason."""
        reasons = [r.health() for r in self.replicas]
        if any(reason is None for reason in reasons):
            return None
        return "; ".join(f"replica {i}: {reason}" for i, reason in enumerate(reasons))

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()
