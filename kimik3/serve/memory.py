"""Engine settings and the up-front memory budget of the hybrid cache.

One byte limit is split, before any request arrives, into:
  - KDA slots for ``max_running`` live sequences (fixed size each, whatever the length),
  - KDA slots for ``checkpoints`` prefix checkpoints (+1 spare used while one is being taken),
  - MLA physical blocks with everything that is left,
each pool keeping one scratch row for the padding rows of a graph-replayed decode batch.
Nothing is allocated later, so a burst of requests waits or is refused; it never runs the device
out of memory. At full scale a KDA slot is ~434 MB (the ``k3`` preset's 69 KDA layers) and an MLA
block of 6144 tokens is 6144 x 576 x 24 layers x 2 bytes = 170 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimik3.config.schema import K3Config
from kimik3.serve.paged_cache import LatentPool, StatePool, StepStates


MAX_SPECULATIVE_TOKENS = 8


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
    # On a GPU: the share of its whole memory this engine may fill (weights, activations, CUDA graphs and the
    # cache); the cache budget is what is left of it (``memory_bytes`` is then ignored). vLLM's option.
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False         # no CUDA graphs: decode steps and prefill chunks run the eager forward
    # Speculative decoding: tokens the draft (``kimik3.model.draft``) proposes per step, verified by one target
    # forward (``kimik3.serve.speculative``); 0 is off. The draft's latents take one more MLA layer in every block,
    # and each of max_running sequences keeps K + 1 KDA states during a verification.
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hash_block", "physical_block", "max_running", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"EngineConfig.speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.speculative_tokens}")
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
        """What the pools take, their scratch rows included."""
        return (self.num_blocks + 1) * self.block_bytes + (self.num_slots + 1) * self.slot_bytes

    def describe(self, physical_block: int, max_running: int, max_context: int) -> str:
        """One line for the start-up log: the budget and how many sequences it holds."""
        tokens = self.num_blocks * physical_block
        full = self.num_blocks // -(-max_context // physical_block)
        return (f"cache {self.total_bytes / 2**30:.2f} GiB: {self.num_blocks} MLA blocks ({tokens:,} tokens) and "
                f"{self.num_slots} KDA slots; up to {max_running} sequences at once "
                f"({full} of them at the full {max_context:,}-token context)")


def plan_cache(model_config: K3Config, engine: EngineConfig, dtype: torch.dtype) -> CacheLayout:
    """Split ``engine.memory_bytes``; raise if it cannot hold even one full-context sequence."""
    draft_layers = 1 if engine.speculative_tokens else 0
    block_bytes = LatentPool.block_bytes(len(model_config.mla_layer_indices) + draft_layers, engine.physical_block,
                                         model_config.mla.cache_width, dtype)
    slot_bytes = StatePool.slot_bytes(model_config, dtype)
    num_slots = engine.max_running + engine.checkpoints + 1
    steps = StepStates.nbytes(model_config, dtype, engine.speculative_tokens + 1, engine.max_running) \
        if engine.speculative_tokens else 0
    left = engine.memory_bytes - (num_slots + 1) * slot_bytes - block_bytes - steps   # + the scratch slot and block
    context = engine.max_context or model_config.max_seq_len
    needed_blocks = -(-context // engine.physical_block)
    if left < needed_blocks * block_bytes:
        raise ValueError(
            f"memory_bytes={engine.memory_bytes:,} is too small: {num_slots} KDA slots take "
            f"{num_slots * slot_bytes:,} bytes (+ {steps:,} of speculative step states) and one {context}-token "
            f"sequence needs {needed_blocks} MLA "
            f"blocks of {block_bytes:,} bytes; raise memory_bytes or lower max_running/checkpoints/max_context")
    return CacheLayout(num_blocks=left // block_bytes, num_slots=num_slots, block_bytes=block_bytes,
                       slot_bytes=slot_bytes)


GRAPH_RESERVE_BYTES = 512 * 2**20   # the decode graphs' activations and the allocator's slack


def gpu_cache_budget(model: torch.nn.Module, engine: EngineConfig) -> int:
    """The cache budget on the model's GPU, as vLLM sizes it: ``gpu_memory_utilization`` x the GPU's memory, less
    what the weights take, less the peak activations of one ``prefill_chunk``-token forward (measured here, run on
    zeros; twice unless ``enforce_eager``: the prefill chunk's CUDA graphs keep a pool of their own, and shorter
    chunks run eagerly beside it), less ``GRAPH_RESERVE_BYTES``. Raises when nothing is left, or when other
    processes hold memory this would need."""
    device = model.device
    util = engine.gpu_memory_utilization
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.synchronize(device)
    # This model's own bytes (not memory_allocated: replicas sharing the GPU hold weights and caches already).
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        model(torch.zeros(1, engine.prefill_chunk, dtype=torch.long, device=device), last_only=True)
    copies = 1 if engine.enforce_eager else 2
    activations = (torch.cuda.max_memory_allocated(device) - before) * copies
    torch.cuda.empty_cache()
    budget = int(total * util) - weights - activations - GRAPH_RESERVE_BYTES
    gib = 2**30
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={util} leaves no cache: {total * util / gib:.1f} GiB of "
                         f"{total / gib:.1f} GiB, of which the weights take {weights / gib:.1f} GiB and one "
                         f"{engine.prefill_chunk}-token prefill {activations / gib:.1f} GiB"
                         f"{' (eager and as graphs)' if copies == 2 else ''}; raise it")
    free_after = torch.cuda.mem_get_info(device)[0]
    if budget > free_after - GRAPH_RESERVE_BYTES:
        raise ValueError(f"gpu_memory_utilization={util} asks for a {budget / gib:.1f} GiB cache but only "
                         f"{free_after / gib:.1f} GiB of the GPU is free (other processes hold "
                         f"{(total - free) / gib - torch.cuda.memory_reserved(device) / gib:.1f} GiB); lower it")
    return budget
