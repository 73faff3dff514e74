"""Engine settings and the up-front memory budget of the hybrid cache.

One byte limit is split, before any request arrives, into:
  - KDA slots for ``max_running`` live sequences (fixed size each, whatever the length),
  - KDA slots for ``checkpoints`` prefix checkpoints (+1 spare used while one is being taken),
  - MLA physical blocks with everything that is left.
Nothing is allocated later, so a burst of requests waits or is refused; it never runs the device
out of memory. At full scale a KDA slot is ~434 MB (the ``k3`` preset's 69 KDA layers) and an MLA
block of 6144 tokens is 6144 x 576 x 24 layers x 2 bytes = 170 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.config.schema import K3Config
from kimik3.serve.paged_cache import LatentPool, StatePool


@dataclass(slots=True)
class EngineConfig:
    memory_bytes: int = 256 * 2**20     # the cache budget (MLA blocks + KDA slots)
    hash_block: int = 16                # prefix-hash granularity (512 at full scale)
    physical_block: int = 192           # MLA tokens per physical block (6144 at full scale)
    max_running: int = 32               # sequences holding cache at once (KDA live slots)
    checkpoints: int = 64               # KDA prefix checkpoints kept (0 disables prefix caching)
    prefix_policy: str = "ours"         # see kimik3.serve.prefix_cache
    max_waiting: int = 128              # queued requests beyond which new ones get 429
    prefill_chunk: int = 512            # tokens per chunked-prefill forward
    max_context: int | None = None      # default: the model's max_seq_len

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hash_block", "physical_block", "max_running", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoints < 0 or self.max_waiting < 0:
            raise ValueError("EngineConfig.checkpoints and max_waiting must be >= 0")
        if self.physical_block % self.hash_block:
            raise ValueError(f"physical_block ({self.physical_block}) must be a multiple of "
                             f"hash_block ({self.hash_block})")


@dataclass(slots=True, frozen=True)
class CacheLayout:
    num_blocks: int
    num_slots: int          # live + checkpoints + 1 spare
    block_bytes: int
    slot_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + self.num_slots * self.slot_bytes


def plan_cache(model_config: K3Config, engine: EngineConfig, dtype: torch.dtype) -> CacheLayout:
    """Split ``engine.memory_bytes``; raise if it cannot hold even one full-context sequence."""
    block_bytes = LatentPool.block_bytes(len(model_config.mla_layer_indices), engine.physical_block,
                                         model_config.mla.cache_width, dtype)
    slot_bytes = StatePool.slot_bytes(model_config, dtype)
    num_slots = engine.max_running + engine.checkpoints + 1
    left = engine.memory_bytes - num_slots * slot_bytes
    context = engine.max_context or model_config.max_seq_len
    needed_blocks = -(-context // engine.physical_block)
    if left < needed_blocks * block_bytes:
        raise ValueError(
            f"memory_bytes={engine.memory_bytes:,} is too small: {num_slots} KDA slots take "
            f"{num_slots * slot_bytes:,} bytes and one {context}-token sequence needs {needed_blocks} MLA "
            f"blocks of {block_bytes:,} bytes; raise memory_bytes or lower max_running/checkpoints/max_context")
    return CacheLayout(num_blocks=left // block_bytes, num_slots=num_slots, block_bytes=block_bytes,
                       slot_bytes=slot_bytes)
