"""The hybrid cache of the serving engine: where every sequence's MLA latents and KDA states live, and the prefix
checkpoints that share them.

It owns the storage (``LatentPool``, ``StatePool``), the block bookkeeping (``BlockAllocator``) and the prefix
cache, and answers the scheduler's three questions: can this waiting sequence start now (``admit``: its KDA slot
and its whole block reservation, prompt + max_tokens, restored from the longest prefix checkpoint when there is
one), take a checkpoint of this sequence here (``snapshot``), and give back what this sequence holds
(``release``). The model runner reads and writes the pools; only this class hands out their rows.

Restoring a hit: blocks wholly below the checkpoint's boundary are shared, the block the boundary lands in is
copied (copy-on-write), and the KDA state is copied into the sequence's own slot. A checkpoint's payload is its
KDA slot plus references to the MLA blocks that hold its prefix, so the latents a hit needs live exactly as long
as the checkpoint does.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from kimik3.config.schema import K3Config
from kimik3.serve.memory import CacheLayout, EngineConfig
from kimik3.serve.paged_cache import BlockAllocator, LatentPool, StatePool
from kimik3.serve.prefix_cache import Checkpoint, PrefixCache
from kimik3.serve.sequence import CheckpointPayload, Sequence


class CacheManager:
    def __init__(self, model_config: K3Config, config: EngineConfig, layout: CacheLayout, dtype: torch.dtype,
                 device: torch.device):
        self.config = config
        self.layout = layout
        self.allocator = BlockAllocator(layout.num_blocks)
        # With speculative decoding, one more latent layer: the draft's (its last).
        draft_layers = 1 if config.speculative_tokens else 0
        self.latents = LatentPool(len(model_config.mla_layer_indices) + draft_layers, layout.num_blocks,
                                  config.physical_block,
                                  model_config.mla.cache_width, dtype, device)
        self.states = StatePool(model_config, layout.num_slots, dtype, device)
        if config.prefix_policy == "oracle":
            raise ValueError("prefix_policy 'oracle' keeps unlimited checkpoints: it exists for the simulator only")
        policy = config.prefix_policy if config.checkpoints else "none"
        self.prefix_cache = PrefixCache(config.hash_block, max(config.checkpoints, 1), policy=policy,
                                        physical_block=config.physical_block, on_evict=self._free_checkpoint)

    def blocks_needed(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.physical_block)

    # ------------------------------------------------------------------ admission
    def admit(self, seq: Sequence) -> bool:
        """Give ``seq`` its KDA slot and block reservation, restored from a prefix hit if any; False when the
        blocks are not free now (prefix checkpoints are evicted first to make room). On an error, whatever was
        taken is given back (``release``) before it propagates."""
        hit = self.prefix_cache.peek(seq.tokens)   # counted by lookup() below
        if hit is not None:
            self.prefix_cache.acquire(hit)         # not evicted while we make room
        shared = hit.boundary // self.config.physical_block if hit is not None else 0
        needed = self.blocks_needed(len(seq.tokens) + seq.request.params.max_tokens) - shared
        while self.allocator.num_free < needed and self.prefix_cache.evict_one():
            pass
        if hit is not None:
            self.prefix_cache.release(hit)
        if self.allocator.num_free < needed:
            return False                           # wait for running sequences to free blocks
        hit = self.prefix_cache.lookup(seq.tokens)   # the same checkpoint: nothing ran since peek
        if hit is not None:
            self.prefix_cache.acquire(hit)
        try:
            seq.slot = self.states.allocate()
            if hit is None:
                self.states.zero(seq.slot)
                seq.blocks = self.allocator.allocate(needed)
            else:
                self._restore(seq, hit, shared, needed)
            seq.boundaries = deque(self.prefix_cache.plan(seq.tokens, seq.computed, seq.request.boundary_hints))
        except BaseException:
            if hit is not None:
                self.prefix_cache.release(hit)
            self.release(seq)
            raise
        if hit is not None:
            if hit.boundary == seq.prompt_tail(self.config.hash_block):
                seq.pin = hit                      # keep the pin: see Sequence.pin
            else:
                self.prefix_cache.release(hit)
        return True

    def _restore(self, seq: Sequence, hit: Checkpoint, shared: int, needed: int) -> None:
        payload: CheckpointPayload = hit.payload
        self.allocator.incref(payload.blocks[:shared])
        seq.blocks = payload.blocks[:shared]           # held now, so that a failed allocate still releases them
        seq.blocks = seq.blocks + self.allocator.allocate(needed)
        within = hit.boundary % self.config.physical_block
        if within:   # the hit lands inside a block that the checkpoint's owner may still fill
            self.latents.copy_prefix(payload.blocks[shared], seq.blocks[shared], within)
        self.states.copy(payload.slot, seq.slot)
        seq.computed = seq.cached_tokens = hit.boundary

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self, seq: Sequence) -> Checkpoint | None:
        """Offer the prefix cache a checkpoint of ``seq`` at its current (hash-aligned) length; returns the
        checkpoint stored at that boundary (new or already there), or None."""
        boundary = seq.computed
        slot = self.states.allocate()                 # the spare slot: the pool has one more than needed
        blocks = seq.blocks[:self.blocks_needed(boundary)]
        self.allocator.incref(blocks)
        payload = CheckpointPayload(slot, blocks)
        try:
            self.states.copy(seq.slot, slot)
            stored = self.prefix_cache.insert(seq.tokens, boundary, payload)   # the hasher extends, not rehashes
        except BaseException:
            self._free_payload(payload)
            raise
        if stored is None or stored.payload is not payload:
            self._free_payload(payload)
        return stored

    def snapshot_prompt(self, seq: Sequence) -> None:
        """Checkpoint ``seq`` at a planned prefill boundary; the prompt's deepest one stays pinned while it lives."""
        stored = self.snapshot(seq)
        if stored is not None and seq.pin is None and seq.computed == seq.prompt_tail(self.config.hash_block):
            self.prefix_cache.acquire(stored)
            seq.pin = stored

    def maybe_snapshot_decode(self, seq: Sequence) -> None:
        """Checkpoint a decoding ``seq`` at a hash boundary when the prefix cache's policy wants one there."""
        if (seq.computed % self.config.hash_block == 0
                and self.prefix_cache.want_decode_checkpoint(seq.tokens[:seq.computed])):
            self.snapshot(seq)

    def _free_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._free_payload(checkpoint.payload)

    def _free_payload(self, payload: CheckpointPayload) -> None:
        self.states.free(payload.slot)
        self.allocator.decref(payload.blocks)

    # ------------------------------------------------------------------ the end
    def release(self, seq: Sequence) -> None:
        """Give back everything ``seq`` holds (pin, KDA slot, blocks); safe on a partly admitted sequence."""
        if seq.pin is not None:
            self.prefix_cache.release(seq.pin)
            seq.pin = None
        if seq.slot >= 0:
            self.states.free(seq.slot)
        self.allocator.decref(seq.blocks)
        seq.slot, seq.blocks = -1, []
