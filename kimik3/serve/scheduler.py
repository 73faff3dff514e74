"""The engine core: admission, the hybrid cache's bookkeeping, and one scheduling step at a time.

A step runs at most one chunked-prefill forward (one sequence, up to ``prefill_chunk`` tokens,
cut at the checkpoint boundaries the prefix cache planned) and one batched decode forward (every
sequence that has its first token, one token each, ragged lengths through the paged view).

Life of a request:
  queued -> admitted (needs a KDA slot and its whole MLA block reservation: prompt + max_tokens,
  so a running sequence never waits for memory; prefix checkpoints are evicted to make room) ->
  restored from the longest prefix checkpoint, if any (blocks wholly below the hit are shared,
  the block the hit lands in is copied: copy-on-write; the KDA state is copied into the
  sequence's own slot) -> prefill from the hit, snapshotting KDA at planned boundaries -> decode,
  snapshotting at hash boundaries the policy wants -> finished or aborted: slot and blocks freed.

A prefix checkpoint's payload is its KDA slot plus references to the MLA blocks that hold its
prefix, so the MLA latents a hit needs live exactly as long as the checkpoint does.

Failures are contained per request: an exception while one sequence is prefilled, sampled or
streamed ends that sequence alone with ``finish_reason="error"`` (its cache freed) and the others
go on; a failed batched forward ends the sequences of that batch. Only ``BROKEN_AFTER`` failed
forwards in a row (a broken device, not a bad request) escape ``step`` as ``EngineBroken``.

This class is single-threaded; ``engine.LLMEngine`` runs it on a worker thread.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kimik3.model.k3 import K3ForCausalLM
from kimik3.model.sampling import apply_penalties, sample_next_token
from kimik3.serve.detokenize import StreamDetokenizer
from kimik3.serve.memory import EngineConfig, plan_cache
from kimik3.serve.paged_cache import BlockAllocator, LatentPool, StatePool, batch_cache
from kimik3.serve.prefix_cache import Checkpoint, PrefixCache
from kimik3.serve.types import (AdmissionRejected, EngineStats, FinishReason, GenerationRequest,
                                RequestTooLong, TokenEvent, Usage)

EventSink = Callable[[TokenEvent], None]
log = logging.getLogger(__name__)
BROKEN_AFTER = 3   # failed forwards in a row after which the engine, not a request, is at fault


class EngineBroken(RuntimeError):
    """Forwards keep failing whatever the batch: the engine cannot serve until it is rebuilt."""


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


class EngineCore:
    def __init__(self, model: K3ForCausalLM, tokenizer: Any, config: EngineConfig,
                 eos_token_id: int | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_id = eos_token_id
        self.max_context = min(config.max_context or model.config.max_seq_len, model.config.max_seq_len)
        device, dtype = model.device, model.dtype
        self.layout = plan_cache(model.config, config, dtype)
        self.allocator = BlockAllocator(self.layout.num_blocks)
        self.latents = LatentPool(len(model.config.mla_layer_indices), self.layout.num_blocks, config.physical_block,
                                  model.config.mla.cache_width, dtype, device)
        self.states = StatePool(model.config, self.layout.num_slots, dtype, device)
        if config.prefix_policy == "oracle":
            raise ValueError("prefix_policy 'oracle' keeps unlimited checkpoints: it exists for the simulator only")
        policy = config.prefix_policy if config.checkpoints else "none"
        self.prefix_cache = PrefixCache(config.hash_block, max(config.checkpoints, 1), policy=policy,
                                        physical_block=config.physical_block, on_evict=self._free_checkpoint)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._counters = EngineStats()
        self._failed_forwards = 0

    # ------------------------------------------------------------------ admission
    def blocks_needed(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.physical_block)

    def check(self, request: GenerationRequest) -> None:
        """Raise ``RequestTooLong`` for a request that could never run; ValueError for bad ids."""
        prompt, params = request.prompt_ids, request.params
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        total = len(prompt) + params.max_tokens
        if total > self.max_context:
            raise RequestTooLong(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                                 f"exceeds the context of {self.max_context} tokens")
        if self.blocks_needed(total) > self.layout.num_blocks:
            raise RequestTooLong(f"{total} tokens need {self.blocks_needed(total)} cache blocks; the engine "
                                 f"has {self.layout.num_blocks}")

    def add(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue a request (after ``check``); refuse it when more than ``max_waiting`` requests
        would be left waiting. Admission is tried first, so a request that can start now is never
        refused (``max_waiting=0`` means: no queue, not: no requests)."""
        self.check(request)
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        seq = Sequence(request, sink, StreamDetokenizer(self.tokenizer, params.stop), generator,
                       tokens=list(request.prompt_ids))
        self.waiting.append(seq)
        if len(self.waiting) > self.config.max_waiting:
            self._admit()
        if len(self.waiting) > self.config.max_waiting and self.waiting[-1] is seq:
            self.waiting.pop()
            self._counters.rejected += 1
            raise AdmissionRejected(f"{len(self.waiting)} requests are already waiting (limit "
                                    f"{self.config.max_waiting}); retry later")

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request.request_id == request_id:
                self.waiting.remove(seq)
                self._emit_finish(seq, "abort", count=False)   # never ran: nothing to bill
                return True
        for seq in self.running:
            if seq.request.request_id == request_id:
                self._finish(seq, "abort")
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            hit = self.prefix_cache.peek(seq.tokens)   # counted by lookup() once admitted
            if hit is not None:
                self.prefix_cache.acquire(hit)         # not evicted while we make room
            shared = hit.boundary // self.config.physical_block if hit is not None else 0
            needed = self.blocks_needed(len(seq.tokens) + seq.request.params.max_tokens) - shared
            while self.allocator.num_free < needed and self.prefix_cache.evict_one():
                pass
            if hit is not None:
                self.prefix_cache.release(hit)
            if self.allocator.num_free < needed:
                return                               # wait for running sequences to free blocks
            hit = self.prefix_cache.lookup(seq.tokens)   # the same checkpoint: nothing ran since peek
            if hit is not None:
                self.prefix_cache.acquire(hit)
            self.waiting.popleft()
            try:
                seq.slot = self.states.allocate()
                if hit is None:
                    self.states.zero(seq.slot)
                    seq.blocks = self.allocator.allocate(needed)
                else:
                    self._restore(seq, hit, shared, needed)
                seq.boundaries = deque(self.prefix_cache.plan(seq.tokens, seq.computed,
                                                              seq.request.boundary_hints))
            except Exception as error:
                if hit is not None:
                    self.prefix_cache.release(hit)
                self._fail(seq, error)
                continue
            if hit is not None:
                if hit.boundary == seq.prompt_tail(self.config.hash_block):
                    seq.pin = hit                        # keep the pin: see Sequence.pin
                else:
                    self.prefix_cache.release(hit)
            self.running.append(seq)

    def _restore(self, seq: Sequence, hit: Checkpoint, shared: int, needed: int) -> None:
        payload: CheckpointPayload = hit.payload
        self.allocator.incref(payload.blocks[:shared])
        seq.blocks = payload.blocks[:shared] + self.allocator.allocate(needed)
        within = hit.boundary % self.config.physical_block
        if within:   # the hit lands inside a block that the checkpoint's owner may still fill
            self.latents.copy_prefix(payload.blocks[shared], seq.blocks[shared], within)
        self.states.copy(payload.slot, seq.slot)
        seq.computed = seq.cached_tokens = hit.boundary

    # ------------------------------------------------------------------ checkpoints
    def _snapshot(self, seq: Sequence) -> Checkpoint | None:
        """Offer the prefix cache a checkpoint of ``seq`` at its current (hash-aligned) length;
        returns the checkpoint stored at that boundary (new or already there), or None."""
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

    def _free_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._free_payload(checkpoint.payload)

    def _free_payload(self, payload: CheckpointPayload) -> None:
        self.states.free(payload.slot)
        self.allocator.decref(payload.blocks)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        self._admit()
        prefilling = next((seq for seq in self.running if seq.prefilling), None)
        decoding = [seq for seq in self.running if not seq.prefilling]
        if prefilling is not None:
            self._prefill_chunk(prefilling)
        if decoding:
            self._decode(decoding)

    def _forward_failed(self, seqs: list[Sequence], error: Exception) -> None:
        """A batched forward raised: its sequences end with the error; repeated failures whatever
        the batch mean the engine itself is broken (``EngineBroken``)."""
        self._failed_forwards += 1
        for seq in seqs:
            self._fail(seq, error)
        if self._failed_forwards >= BROKEN_AFTER:
            raise EngineBroken(f"{self._failed_forwards} forwards in a row failed; the last: "
                               f"{type(error).__name__}: {error}") from error

    def _forward(self, seqs: list[Sequence], input_ids: torch.Tensor) -> torch.Tensor:
        device = self.model.device
        width = max(len(seq.blocks) for seq in seqs)
        tables = torch.tensor([seq.blocks + [seq.blocks[0]] * (width - len(seq.blocks)) for seq in seqs],
                              dtype=torch.long, device=device)
        lengths = torch.tensor([seq.computed for seq in seqs], dtype=torch.long, device=device)
        slots = torch.tensor([seq.slot for seq in seqs], dtype=torch.long, device=device)
        cache, kda_states = batch_cache(self.model.config, self.latents, self.states, slots, tables, lengths)
        logits = self.model(input_ids, cache=cache, last_only=True).logits[:, -1]
        self.states.scatter(slots, kda_states)
        return logits

    def _prefill_chunk(self, seq: Sequence) -> None:
        while seq.boundaries and seq.boundaries[0] <= seq.computed:
            seq.boundaries.popleft()
        end = min(seq.computed + self.config.prefill_chunk, seq.prompt_len)
        if seq.boundaries:
            end = min(end, seq.boundaries[0])
        chunk = torch.tensor([seq.tokens[seq.computed:end]], dtype=torch.long, device=self.model.device)
        try:
            logits = self._forward([seq], chunk)
        except Exception as error:
            self._forward_failed([seq], error)
            return
        self._failed_forwards = 0
        try:
            seq.computed = end
            if seq.boundaries and seq.boundaries[0] == end:
                seq.boundaries.popleft()
                stored = self._snapshot(seq)
                if stored is not None and seq.pin is None and end == seq.prompt_tail(self.config.hash_block):
                    self.prefix_cache.acquire(stored)
                    seq.pin = stored
            if not seq.prefilling:
                self._accept(seq, logits[0])
        except Exception as error:
            self._fail(seq, error)

    def _decode(self, seqs: list[Sequence]) -> None:
        input_ids = torch.tensor([[seq.tokens[-1]] for seq in seqs], dtype=torch.long, device=self.model.device)
        try:
            logits = self._forward(seqs, input_ids)
        except Exception as error:
            self._forward_failed(seqs, error)
            return
        self._failed_forwards = 0
        hash_block = self.config.hash_block
        for row, seq in enumerate(seqs):
            try:
                seq.computed += 1
                if (seq.computed % hash_block == 0
                        and self.prefix_cache.want_decode_checkpoint(seq.tokens[:seq.computed])):
                    self._snapshot(seq)
                self._accept(seq, logits[row])
            except Exception as error:
                self._fail(seq, error)

    def _accept(self, seq: Sequence, logits_V: torch.Tensor) -> None:
        """Sample the next token of ``seq``, stream it, and finish the sequence if it is done."""
        params = seq.request.params
        if params.penalized:
            ids = torch.tensor(seq.tokens, dtype=torch.long, device=logits_V.device)
            logits_V = apply_penalties(logits_V, ids[:seq.prompt_len], ids[seq.prompt_len:], params.presence_penalty,
                                       params.frequency_penalty, params.repetition_penalty)
        token = int(sample_next_token(logits_V[None], params.temperature, params.top_k, params.top_p,
                                      seq.generator, min_p=params.min_p)[0])
        seq.tokens.append(token)
        if token == self.eos_token_id:
            self._finish(seq, "stop", seq.detokenizer.flush(), token)
            return
        text = seq.detokenizer.push(token)
        if seq.detokenizer.stopped:
            self._finish(seq, "stop", text, token)
        elif seq.generated >= params.max_tokens:
            self._finish(seq, "length", text + seq.detokenizer.flush(), token)
        elif not self._send(seq, TokenEvent(seq.request.request_id, token, text)):
            self._finish(seq, "abort")                 # nobody is listening any more

    def _send(self, seq: Sequence, event: TokenEvent) -> bool:
        """Hand ``event`` to the request's sink; False (logged) if the sink raised: a caller whose
        event loop is gone must not take the engine down."""
        try:
            seq.sink(event)
            return True
        except Exception:
            log.exception("delivering an event of request %s failed", seq.request.request_id)
            return False

    # ------------------------------------------------------------------ the end
    def _finish(self, seq: Sequence, reason: FinishReason, text: str = "", token: int | None = None) -> None:
        """End ``seq``; ``token`` is the last sampled one (it rides on the final event), None on abort."""
        if reason != "abort":
            self.prefix_cache.finish(seq.tokens)
        self._release(seq)
        self._emit_finish(seq, reason, text, token)

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        """End ``seq`` alone after ``error``; whatever it held (slot, blocks, pin) is freed."""
        log.error("request %s failed: %s: %s", seq.request.request_id, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        self._release(seq)
        self._emit_finish(seq, "error", error=f"{type(error).__name__}: {error}")

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.pin is not None:
            self.prefix_cache.release(seq.pin)
            seq.pin = None
        if seq.slot >= 0:
            self.states.free(seq.slot)
        self.allocator.decref(seq.blocks)
        seq.slot, seq.blocks = -1, []

    def _emit_finish(self, seq: Sequence, reason: FinishReason, text: str = "", token: int | None = None,
                     count: bool = True, error: str | None = None) -> None:
        usage = Usage(prompt_tokens=seq.prompt_len, completion_tokens=seq.generated, cached_tokens=seq.cached_tokens)
        if count:
            counters = self._counters
            counters.prompt_tokens += usage.prompt_tokens
            counters.cached_prompt_tokens += usage.cached_tokens
            counters.completion_tokens += usage.completion_tokens
            counters.cost_usd += usage.cost_usd
        self._send(seq, TokenEvent(seq.request.request_id, token, text, finished=True, finish_reason=reason,
                                   usage=usage, error=error))

    def fail_all(self, error: BaseException) -> None:
        """End every queued and running request with ``error`` (the engine is being rebuilt or stopped)."""
        for seq in list(self.waiting) + list(self.running):
            self._emit_finish(seq, "error", count=False, error=f"the engine failed: {type(error).__name__}: {error}")
        self.waiting.clear()
        self.running.clear()

    def stats(self) -> EngineStats:
        counters, cache_stats = self._counters, self.prefix_cache.stats
        return EngineStats(
            running=len(self.running), waiting=len(self.waiting),
            cache_blocks_used=self.allocator.num_used, cache_blocks_total=self.allocator.num_blocks,
            checkpoints_used=len(self.prefix_cache), checkpoints_total=self.config.checkpoints,
            prefix_queries=cache_stats.queries, prefix_hits=cache_stats.hits,
            prompt_tokens=counters.prompt_tokens, cached_prompt_tokens=counters.cached_prompt_tokens,
            completion_tokens=counters.completion_tokens, cost_usd=counters.cost_usd, rejected=counters.rejected)
