"""The model runner: the serving engine's forwards over the hybrid cache, and its sampling.

Legend: B = sequences in a step, b = the CUDA-graph bucket that runs them (b >= B), W = block-table width
(blocks of the longest sequence the engine admits), V = vocabulary.

- A prefill chunk (one sequence, T tokens) is padded on a GPU to the smallest prefill size P >= T (``PREFILL_MIN``,
  twice that, ... up to ``prefill_chunk``) and replays piecewise CUDA graphs captured at start-up for P
  (``serve/piecewise.py``): the whole forward but the MLA layers' attention over the cached latents, which runs
  eagerly between the graphs (its shapes follow the cached length). They read a static int64 buffer [P + 3 + W]
  (the chunk's ids, then KDA slot, cached length, real token count T, block table) filled by one copy. The P - T
  padding tokens change nothing a later step reads: the KDA layers leave their state as the real tokens leave it
  (``KDAState.valid_B``), the logits are taken at token T - 1, and their MLA latents land past the cached length
  (or in the scratch block), where they are overwritten before anything attends to them. With ``enforce_eager``
  the same padded forward runs eagerly (so both give the same tokens). On the CPU a chunk runs unpadded, and the
  chunks of several sequences run as one forward (``prefill_many``), right-padded to the longest by the same rule:
  a small model's forward there is largely a fixed per-op cost (the tiny preset: ~37 ms for one row of 64 tokens,
  ~124 ms for eight, one thread), which one forward per sequence would pay once per sequence.
- A decode batch (one token for each of B sequences) replays a CUDA graph captured at start-up for the smallest
  bucket b >= B (``BUCKETS``, up to ``max_running``). Every graph reads one static int64 buffer [b, 3 + W]
  (token id, KDA slot, cached length, block table per row) that the host fills with one copy per step, and
  writes static logits. Rows B..b-1 are padding: KDA slot -1 (``kda_decode`` skips it; its conv inputs go to
  the state pool's scratch row), length 0 and a block table of the latent pool's scratch block, so they never
  touch a live sequence's cache. Without CUDA, or with ``EngineConfig.enforce_eager``, the same forward runs
  eagerly on the B rows: the peer the graphs are measured against.
- Sampling runs on the device for the whole batch (``serve/sampler.py``); the step's tokens reach the host in
  one transfer, the step's only synchronisation (log-probabilities add one more when a request asks for them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kimik3.cuda_graph import warm_up
from kimik3.model.fused_linear import pack_projections
from kimik3.model.cache import K3Cache
from kimik3.model.draft import EagleDraft
from kimik3.model.k3 import K3ForCausalLM
from kimik3.model.sampling import apply_penalties
from kimik3.ops.mla.paged_decode import check_paged_mla_widths
from kimik3.serve.cache_manager import CacheManager
from kimik3.serve.memory import EngineConfig
from kimik3.serve.paged_cache import PagedLatentView, batch_cache
from kimik3.serve.piecewise import PiecewiseGraph
from kimik3.serve.sampler import SamplingBatch, held_end_tokens, logprob_logits, sample, token_logprobs
from kimik3.serve.sequence import Sequence
from kimik3.serve.speculative import Speculator

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
_ID, _SLOT, _LENGTH, _TABLE = 0, 1, 2, 3   # columns of the static input buffer
_P_SLOT, _P_LENGTH, _P_VALID, _P_TABLE = 0, 1, 2, 3   # a prefill buffer's fields after the chunk's P ids
PREFILL_MIN = 16   # the smallest prefill size: shorter chunks are padded to it


@dataclass(slots=True)
class Sampled:
    """One sequence's next token, with its log-probabilities when the request asked for them."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def graph_buckets(max_running: int) -> list[int]:
    """The decode batch sizes to capture: every bucket below ``max_running`` and the first one at or above it."""
    buckets = [b for b in BUCKETS if b < max_running]
    return buckets + [next((b for b in BUCKETS if b >= max_running), max_running)]


def prefill_sizes(chunk: int) -> list[int]:
    """The prefill sizes to capture: ``PREFILL_MIN``, twice that, ... below ``chunk``, then ``chunk``."""
    sizes = []
    size = PREFILL_MIN
    while size < chunk:
        sizes.append(size)
        size *= 2
    return sizes + [chunk]


class ModelRunner:
    def __init__(self, model: K3ForCausalLM, cache: CacheManager, config: EngineConfig, max_context: int,
                 draft: EagleDraft | None = None, eos_token_id: int | None = None):
        self.model = model
        self.eos_token_id = eos_token_id     # held back with the stop tokens until a request's min_tokens
        # The forward every step calls. A multimodal model's own forward counts its placeholders on the host (a
        # synchronisation no CUDA graph can capture) and refuses placeholders without pixels; here images enter
        # as prefill embeddings (``serve/multimodal.py``), so the text model's forward runs for both kinds.
        self.lm = model if type(model).forward is K3ForCausalLM.forward else partial(K3ForCausalLM.forward, model)
        pack_projections(model)   # each layer's input projections read as one matmul's weight, in place
        # Quantisation-aware experts (moe.expert_quant = "mxfp4") are served packed: MXFP4 codes + scales, the
        # full-precision copies freed; the same values the trained forward used.
        self.packed_expert_bytes = sum(module.pack_mxfp4() for module in model.modules()
                                       if getattr(module, "quant", None) == "mxfp4" and hasattr(module, "pack_mxfp4"))
        self.cache = cache
        self.device = model.device
        # A speculative verification writes up to K tokens past a sequence's last: its tables reach that far.
        self.table_width = -(-(max_context + config.speculative_tokens) // config.physical_block)
        self.max_running = config.max_running
        self.capacity = self.table_width * config.physical_block   # tokens a block table reaches
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefill_graphs: dict[int, _PrefillGraph] = {}
        self.capture_seconds = 0.0
        self.speculator = None
        if config.speculative_tokens:
            if draft is None:
                raise ValueError("speculative_tokens needs a draft model (kimik3.model.draft.EagleDraft)")
            self.speculator = Speculator(self, draft, config.speculative_tokens)
        # Decode batches and prefill chunks are padded to a size on a GPU, with graphs or without; on the CPU they
        # run as they are.
        on_gpu = self.device.type == "cuda"
        if on_gpu and model.config.mla_layer_indices:
            check_paged_mla_widths(model.config.mla.kv_lora_rank, model.config.mla.qk_rope_head_dim)
        self.buckets = graph_buckets(config.max_running) if on_gpu else []
        self.prefill_sizes = prefill_sizes(min(config.prefill_chunk, max_context)) if on_gpu else []
        if on_gpu and not config.enforce_eager:
            self._capture(self.buckets)
            self._capture_prefill(self.prefill_sizes)
            if self.speculator is not None:
                self._capture_speculative(sorted({min(b, self.max_running) for b in self.buckets}))

    @property
    def uses_graphs(self) -> bool:
        return bool(self.graphs)

    # ------------------------------------------------------------------ forwards
    def _forward(self, input_ids_BT: torch.Tensor, slots_B: torch.Tensor, tables_BW: torch.Tensor,
                 lengths_B: torch.Tensor, max_length: int | None = None, features: bool = False,
                 inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over pooled sequences: (last-position logits [B, V], with ``features`` the draft's fused
        features of every position [B, T, D] or else None); the cache advances in place. ``inputs_embeds``: a
        prefill chunk's embeddings with its images' (``serve/multimodal.py``)."""
        cache = batch_cache(self.model.config, self.cache.latents, self.cache.states, slots_B, tables_BW, lengths_B,
                            max_length)
        out = self.lm(input_ids_BT, cache=cache, last_only=True,
                      features_at=self._features_at if features else (), inputs_embeds=inputs_embeds)
        return out.logits[:, -1], self._features(out) if features else None

    def _features(self, out) -> torch.Tensor | None:
        """The draft's fused input features of a forward run with ``features_at`` (None without speculation)."""
        return self.speculator.draft.fuse_features(out.features) if self.speculator is not None else None

    @property
    def _features_at(self) -> tuple[int, ...]:
        return self.speculator.feature_layers if self.speculator is not None else ()

    def prefill(self, seq: Sequence, end: int) -> torch.Tensor:
        """Compute ``seq.tokens[seq.computed:end]`` into its cache: logits [1, V] after the last of them (a view
        valid until the next call). With speculation, the draft runs over the same chunk."""
        start = seq.computed
        tokens = end - start
        size = next((s for s in self.prefill_sizes if s >= tokens), None)
        device = self.device
        images = seq.media is not None and seq.media.touches(start, end)
        if size is None or start + size > self.capacity or images:
            # On the CPU; or padding past the tables; or a chunk holding image placeholders, whose embeddings are
            # written here (eagerly: the graphs read token ids).
            ids = torch.tensor([seq.tokens[start:end]], dtype=torch.long, device=device)
            logits, features = self._forward(
                ids, torch.tensor([seq.slot], dtype=torch.long, device=device),
                torch.tensor([seq.blocks], dtype=torch.long, device=device),
                torch.tensor([start], dtype=torch.long, device=device), start, self.speculator is not None,
                seq.media.embeds(self.model, ids, start) if images else None)
        else:
            graph = self.prefill_graphs.get(size)
            if graph is not None:
                logits, features = graph.run(seq, end)
            else:
                row = torch.from_numpy(self._prefill_row(seq, end, size)).to(device)
                logits, features, _ = self._prefill_forward(row, size, start)
        if self.speculator is not None:
            self.speculator.prefill(seq, start, end, features)
        return logits

    @property
    def prefill_rows(self) -> int:
        """How many sequences' chunks one prefill step may hold: every running one where chunks run eagerly and
        unpadded (the CPU, no draft: ``prefill_many`` makes them one forward), else one (a GPU's padded chunks
        replay graphs captured for one row; a draft prefills sequence by sequence)."""
        return self.max_running if not self.prefill_sizes and self.speculator is None else 1

    def prefill_many(self, seqs: list[Sequence], ends: list[int]) -> torch.Tensor:
        """``prefill`` for several sequences in one forward: logits [B, V] after each row's chunk. The chunks are
        right-padded to the longest; the padding leaves every cache as the real tokens leave it, as in a padded
        prefill graph (see the module notes). At most ``prefill_rows`` sequences."""
        if len(seqs) > self.prefill_rows:
            raise ValueError(f"prefill_many: {len(seqs)} sequences, but this runner prefills {self.prefill_rows} "
                             "at a time")
        if len(seqs) == 1:
            return self.prefill(seqs[0], ends[0])
        starts = [seq.computed for seq in seqs]
        valid = [end - start for start, end in zip(starts, ends, strict=True)]
        size = max(valid)
        if any(start + size > self.capacity for start in starts) or any(
                seq.media is not None and seq.media.touches(start, end) for seq, start, end in zip(seqs, starts, ends)):
            # Padding past a block table, or image placeholders (their embeddings are written per sequence): the
            # plain chunk of each.
            return torch.cat([self.prefill(seq, end).clone() for seq, end in zip(seqs, ends)])
        ids = np.zeros((len(seqs), size), dtype=np.int64)
        tables = np.full((len(seqs), self.table_width), self.cache.latents.scratch_block, dtype=np.int64)
        for row, (seq, start, end) in enumerate(zip(seqs, starts, ends)):
            ids[row, :end - start] = seq.tokens[start:end]
            tables[row, :len(seq.blocks)] = seq.blocks
        device = self.device
        valid_B = torch.tensor(valid, dtype=torch.long, device=device)
        cache = batch_cache(self.model.config, self.cache.latents, self.cache.states,
                            torch.tensor([seq.slot for seq in seqs], dtype=torch.long, device=device),
                            torch.from_numpy(tables).to(device), torch.tensor(starts, dtype=torch.long, device=device),
                            max(starts), valid_B=valid_B)
        out = self.lm(torch.from_numpy(ids).to(device), cache=cache, logits_at=valid_B - 1)
        return out.logits[:, -1]

    def _prefill_row(self, seq: Sequence, end: int, size: int, out: np.ndarray | None = None) -> np.ndarray:
        """The input buffer of a prefill padded to ``size`` tokens (see the module notes)."""
        row = np.zeros(size + _P_TABLE + self.table_width, dtype=np.int64) if out is None else out
        tokens = end - seq.computed
        row[:tokens] = seq.tokens[seq.computed:end]
        row[tokens:size] = 0
        row[size + _P_SLOT], row[size + _P_LENGTH], row[size + _P_VALID] = seq.slot, seq.computed, tokens
        table = row[size + _P_TABLE:]
        table[:] = self.cache.latents.scratch_block
        table[:len(seq.blocks)] = seq.blocks
        return row

    def _prefill_forward(self, row: torch.Tensor, size: int, max_length: int
                         ) -> tuple[torch.Tensor, torch.Tensor | None, K3Cache]:
        """The padded prefill over the device buffer ``row``: (logits [1, V] at its last real token, the draft's
        fused features [1, size, D] with speculation, the cache the forward ran on)."""
        valid_1 = row[size + _P_VALID:size + _P_VALID + 1]
        cache = batch_cache(self.model.config, self.cache.latents, self.cache.states,
                            row[size + _P_SLOT:size + _P_SLOT + 1], row[size + _P_TABLE:][None],
                            row[size + _P_LENGTH:size + _P_LENGTH + 1], max_length, valid_B=valid_1)
        out = self.lm(row[:size][None], cache=cache, logits_at=valid_1 - 1, features_at=self._features_at)
        return out.logits[:, -1], self._features(out), cache

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for every sequence (its last): logits [B, V]. The view is only valid until the next call."""
        bucket = next((b for b in self.buckets if b >= len(seqs)), len(seqs))
        if bucket not in self.graphs:
            # Eagerly at the graphs' batch size (on a GPU): the same shapes, hence the same kernels and the same
            # rounding as a replay, so --enforce-eager gives the graphs' tokens.
            rows = torch.from_numpy(self._rows(seqs, bucket)).to(self.device)
            logits_bV = self._forward(rows[:, _ID:_ID + 1], rows[:, _SLOT].contiguous(),
                                      rows[:, _TABLE:].contiguous(), rows[:, _LENGTH].contiguous())[0]
            return logits_bV[:len(seqs)]
        self._stage(seqs, bucket)
        graph, logits_bV = self.graphs[bucket]
        graph.replay()
        return logits_bV[:len(seqs)]

    def _rows(self, seqs: list[Sequence], bucket: int) -> np.ndarray:
        """The static input rows of a decode batch, padded to ``bucket`` rows (see the module's docstring)."""
        rows = np.zeros((bucket, _TABLE + self.table_width), dtype=np.int64)
        rows[:, _SLOT] = -1
        rows[:, _TABLE:] = self.cache.latents.scratch_block
        for i, seq in enumerate(seqs):
            rows[i, _ID], rows[i, _SLOT], rows[i, _LENGTH] = seq.tokens[-1], seq.slot, seq.computed
            rows[i, _TABLE:_TABLE + len(seq.blocks)] = seq.blocks
        return rows

    def _stage(self, seqs: list[Sequence], bucket: int) -> None:
        """Fill the static input buffer for a replay at ``bucket``: one host-to-device copy."""
        self._host_np[:bucket] = self._rows(seqs, bucket)
        self._staging[:bucket].copy_(self._host[:bucket], non_blocking=True)

    def _graph_body(self, bucket: int) -> torch.Tensor:
        rows = self._staging[:bucket]
        return self._forward(rows[:, _ID:_ID + 1].contiguous(), rows[:, _SLOT].contiguous(),
                             rows[:, _TABLE:].contiguous(), rows[:, _LENGTH].contiguous())[0]

    def _prepare_static(self, largest: int) -> None:
        """The static input buffer on the device (all padding rows) and its pinned host twin."""
        self._host = torch.empty(largest, _TABLE + self.table_width, dtype=torch.long,
                                 pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._staging = torch.from_numpy(self._rows([], largest)).to(self.device)

    def _capture(self, buckets: list[int]) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool. The warm-up and the
        capture run on padding rows only, so they write nothing but the scratch rows."""
        start = time.perf_counter()
        self._prepare_static(max(buckets))
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with torch.no_grad():
            for bucket in sorted(buckets, reverse=True):
                warm_up(self.device, side, lambda: self._graph_body(bucket))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits_bV = self._graph_body(bucket)
                self.graphs[bucket] = (graph, logits_bV)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(buckets),
                 ", ".join(map(str, sorted(buckets))), self.capture_seconds)

    def _capture_prefill(self, sizes: list[int]) -> None:
        """Capture the piecewise graphs of every prefill size, largest first, sharing one memory pool. The warm-up
        and the capture run on the scratch rows (KDA slot -1, the latent pool's scratch block), so they write into
        no live cache."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):
            self.prefill_graphs[size] = _PrefillGraph(self, size, pool)
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        log.info("captured the piecewise prefill graphs of %s tokens in %.1f s", ", ".join(map(str, sizes)), elapsed)

    def _capture_speculative(self, buckets: list[int]) -> None:
        """Capture the speculative step's draft and verification graphs per bucket (``Speculator.capture``)."""
        start = time.perf_counter()
        self.speculator.capture(buckets, torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device))
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.capture_seconds += elapsed
        log.info("captured the speculative step's graphs (batch %s) in %.1f s", ", ".join(map(str, buckets)),
                 elapsed)

    # ------------------------------------------------------------------ sampling
    def sample(self, seqs: list[Sequence], logits_BV: torch.Tensor) -> list[Sampled]:
        """The next token of every sequence, drawn on the device as its request asks; one host transfer."""
        params = [seq.request.params for seq in seqs]
        logits = logits_BV
        held = [held_end_tokens(seq, self.eos_token_id) for seq in seqs]
        if any(p.penalized for p in params) or any(held):
            logits = logits_BV.to(torch.float32, copy=True)
            for row, (seq, p) in enumerate(zip(seqs, params)):
                if p.penalized:
                    ids = torch.tensor(seq.tokens, dtype=torch.long, device=logits.device)
                    logits[row] = apply_penalties(logits[row], ids[:seq.prompt_len], ids[seq.prompt_len:],
                                                  p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                if held[row]:
                    logits[row, held[row]] = float("-inf")
        batch = SamplingBatch.build(params, [seq.generator for seq in seqs], logits.device)
        tokens_B = sample(logits, batch)
        if batch.max_logprobs is None:
            return [Sampled(token) for token in tokens_B.tolist()]
        chosen_B, top_ids_BN, top_BN = token_logprobs(logprob_logits(logits_BV, logits, params), tokens_B,
                                                      batch.max_logprobs)
        out = []
        for token, lp, ids, lps, p in zip(tokens_B.tolist(), chosen_B.tolist(), top_ids_BN.tolist(),
                                          top_BN.tolist(), params):
            if p.logprobs is None:
                out.append(Sampled(token))
            else:
                out.append(Sampled(token, lp, list(zip(ids[:p.logprobs], lps[:p.logprobs]))))
        return out


class _PrefillGraph:
    """The piecewise CUDA graphs of one prefill size, with their static input buffer (see the module notes)."""

    def __init__(self, runner: ModelRunner, size: int, pool):
        self.size = size
        self._runner = runner
        device = runner.device
        self._host = torch.zeros(size + _P_TABLE + runner.table_width, dtype=torch.long, pin_memory=True)
        self._host_np = self._host.numpy()
        self._host_np[size + _P_SLOT] = -1
        self._host_np[size + _P_VALID] = size
        self._host_np[size + _P_TABLE:] = runner.cache.latents.scratch_block
        self._copied = torch.cuda.Event()
        self._static = self._host.to(device)
        caches = []

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            logits, features, cache = runner._prefill_forward(self._static, size, 0)
            caches.append(cache)
            return logits, features

        side = torch.cuda.Stream(device)
        with torch.no_grad():
            warm_up(device, side, forward)
            self.graph = PiecewiseGraph(pool, side)
            self.graph.capture(forward)
        self._views = [layer for layer in caches[-1].layers if isinstance(layer, PagedLatentView)]

    def run(self, seq: Sequence, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay for ``seq.tokens[seq.computed:end]`` (at most ``size`` of them): (logits [1, V], the draft's
        fused features [1, size, D] or None)."""
        self._copied.synchronize()   # the previous chunk's copy has left the pinned buffer (no sample since)
        self._runner._prefill_row(seq, end, self.size, out=self._host_np)
        self._static.copy_(self._host, non_blocking=True)
        self._copied.record()
        for view in self._views:   # the eager regions run again: this row's cached length, fresh index tensors
            view.index.reset(seq.computed)
        with torch.no_grad():
            return self.graph.replay()
