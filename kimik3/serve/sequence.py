"""One request as the engine tracks it: its tokens, how far its cache is computed, and what cache it holds."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kimik3.serve.detokenize import StreamDetokenizer
from kimik3.serve.multimodal import ImageEmbedder
from kimik3.serve.prefix_cache import Checkpoint
from kimik3.serve.types import GenerationRequest, TokenEvent

EventSink = Callable[[TokenEvent], None]


@dataclass(slots=True)
class CheckpointPayload:
    slot: int                 # KDA state pool slot holding the snapshot
    blocks: list[int]         # MLA blocks covering the prefix (one reference each)


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    sink: EventSink
    detokenizer: StreamDetokenizer
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)   # prompt + generated
    computed: int = 0                                  # tokens whose state is in the cache
    cached_tokens: int = 0                             # restored from the prefix cache
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    boundaries: deque[int] = field(default_factory=deque)   # planned prefill checkpoints
    # The checkpoint of the prompt's deepest boundary, pinned while the sequence lives so that its
    # own decode checkpoints (which dominate it) cannot evict it: an identical resend must hit.
    pin: Checkpoint | None = None
    # Speculative decoding: the pairs (target features, next token) the draft has yet to run, ending at the last
    # computed position (``kimik3.serve.speculative``); 0 until the prompt is computed.
    spec_pending: int = 0
    # A prompt with images: their embeddings for the prefill chunks (``kimik3.serve.multimodal``); None without.
    media: ImageEmbedder | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    def prompt_tail(self, hash_block: int) -> int:
        """The deepest boundary a lookup of this prompt can hit (one token is always recomputed)."""
        return (self.prompt_len - 1) // hash_block * hash_block
