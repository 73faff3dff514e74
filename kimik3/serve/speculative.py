"""Speculative decoding in the engine: the draft proposes K tokens per sequence, one target forward verifies them.

Legend: B = sequences in the step, K = drafted tokens per step, V = vocabulary, D = model width.

A speculating sequence with ``c`` tokens in the target's cache (its last token x_c not yet fed) runs, per step:

1. The draft chain (``kimik3.model.draft``; with a reduced vocabulary its head covers N target ids, which are all
   it proposes). The draft's own MLA latents live in one more layer of the latent pool,
   under the sequence's block tables; its position s holds the pair (target features at s, token s + 1). The m
   pairs the last step left pending (m = the tokens it emitted; 1 after the prompt) run first, as one m-token
   forward (padded to K + 1) whose last real output gives the first draft d_1; each later draft d_k is one more
   single-token step fed the draft's previous output and d_{k-1}. Greedy rows take the draft's argmax; sampled
   rows draw from the draft's distribution after their own temperature, min_p, top_k and top_p.
2. The verification: the target over [x_c, d_1 .. d_K] as one forward of K + 1 tokens per row. Its MLA layers run
   the paged absorbed attention with every token a row of its own (``PagedLatentView.multi_token``); its KDA
   layers walk each row's tokens from the pooled state and record the state after each, leaving the pool as it
   was (``KDAState.stepwise``, ``kimik3.ops.kda.verify``, ``StepStates``).
3. Acceptance (``kimik3.serve.spec_verify``): greedy rows keep the drafts that match the target's argmax; sampled
   rows the standard rejection rule against the target's distributions under the same options (a row's end tokens
   held back at the positions before its ``min_tokens``, as the sampler holds them). n accepted drafts
   emit n + 1 tokens.
4. The cache keeps what was accepted: every KDA state becomes the one recorded after token n
   (``StatePool.commit_steps``); MLA latents past the accepted tokens stay where they were written, past the
   sequence's length, and are overwritten before anything attends to them. The verification's fused features
   become the next step's pending pairs.

The prompt's pairs are drafted during prefill (``prefill``), chunk by chunk, so a prefix-cache checkpoint's blocks
carry the draft's latents with the target's. Greedy output is the target's greedy output whatever the draft
proposes; sampled output has the target's distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kimik3.cuda_graph import warm_up
from kimik3.model.draft import EagleDraft
from kimik3.model.fused_linear import pack_projections
from kimik3.model.sampling import GREEDY_BELOW
from kimik3.ops.sampling import row_argmax
from kimik3.serve.paged_cache import StepStates, batch_cache
from kimik3.serve.sampler import SamplingBatch, draw, held_end_tokens, probabilities
from kimik3.serve.sequence import Sequence
from kimik3.serve.spec_verify import verify_greedy, verify_sampled


def eligible(seq: Sequence) -> bool:
    """Whether a sequence decodes speculatively: penalties depend on every emitted token and log-probabilities are
    reported per token, so those requests decode one token at a time, for their whole life (a sequence that
    switched would leave its draft without the features of the tokens decoded in between). ``min_tokens`` does not
    stop speculation: the verification holds the end tokens back at the positions before the minimum, as the
    sampler does."""
    params = seq.request.params
    return not params.penalized and params.logprobs is None


@dataclass
class SpecStats:
    """What speculation did, cumulative: drafts proposed and accepted per chain position, verification steps,
    tokens emitted, and the host-side seconds spent drafting and verifying."""

    tokens: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: int = 0
    emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.proposed = self.proposed or [0] * self.tokens
        self.accepted = self.accepted or [0] * self.tokens

    def record(self, counts: list[int]) -> None:
        """One verification: each row emitted ``counts[b]`` tokens (its accepted drafts + 1)."""
        self.steps += len(counts)
        self.emitted += sum(counts)
        for k in range(self.tokens):
            self.proposed[k] += len(counts)
            self.accepted[k] += sum(1 for n in counts if n - 1 > k)

    @property
    def acceptance(self) -> list[float]:
        """Per chain position k, the share of verified rows whose drafts 1..k were all accepted (not conditional on
        1..k-1: position k's rate given the earlier ones is ``acceptance[k] / acceptance[k - 1]``)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_emitted(self) -> float:
        """Tokens emitted per sequence and verification (accepted drafts + 1)."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def draft_share(self) -> float:
        total = self.draft_seconds + self.verify_seconds
        return self.draft_seconds / total if total else 0.0


class Speculator:
    """The draft, its pending features and the verification's step states, for one model runner."""

    def __init__(self, runner, draft: EagleDraft, tokens: int):
        if tokens < 1:
            raise ValueError(f"speculative tokens must be >= 1, got {tokens}")
        self.runner = runner
        self.model = runner.model
        self.draft = draft.eval()
        pack_projections(draft)
        self.tokens = tokens
        config = self.model.config
        cache = runner.cache
        self.draft_layer = len(config.mla_layer_indices)
        if len(cache.latents.tensors) != self.draft_layer + 1:
            raise ValueError("the latent pool has no layer for the draft: plan the cache with speculative_tokens")
        self.steps = StepStates(cache.states, tokens + 1, runner.max_running)
        # Per KDA slot: the fused target features of the pairs the draft has not run yet (see the module notes).
        self.pending = torch.zeros(cache.states.num_slots + 1, tokens + 1, config.dim, dtype=self.model.dtype,
                                   device=runner.device)
        self.stats = SpecStats(tokens)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.buckets: list[int] = []   # the batch sizes with captured graphs (none on the CPU or eager)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.draft.feature_layers

    # ------------------------------------------------------------------ prefill
    def prefill(self, seq: Sequence, start: int, end: int, features_1TD: torch.Tensor) -> None:
        """After the target computed ``seq.tokens[start:end]`` of the prompt (fused features ``features_1TD``, its
        first ``end - start`` positions real): draft the pairs whose next token is known, keep the last prompt
        position's features pending."""
        prompt = seq.prompt_len
        pairs = min(end, prompt - 1) - start
        device = self.runner.device
        if pairs > 0:
            tokens = torch.tensor([seq.tokens[start + 1:start + 1 + pairs]], dtype=torch.long, device=device)
            view = self.runner.cache.latents.view(
                self.draft_layer, torch.tensor([seq.blocks], dtype=torch.long, device=device),
                torch.tensor([start], dtype=torch.long, device=device), start)
            self.draft(features_1TD[:, :pairs], self.model.embed(tokens), view)
        if end == prompt:
            self.pending[seq.slot, 0] = features_1TD[0, prompt - 1 - start]
            seq.spec_pending = 1

    # ------------------------------------------------------------------ a step
    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One speculative step for ``seqs``: the tokens each emits (1 to K + 1; the engine stops at a sequence's
        end). Their caches advance past the emitted tokens but the last. An all-greedy batch replays the captured
        graphs of its bucket when there are some; otherwise the same work runs eagerly."""
        greedy = all(seq.request.params.temperature < GREEDY_BELOW for seq in seqs)
        bucket = next((b for b in self.buckets if b >= len(seqs)), None)
        held = [held_end_tokens(seq, self.runner.eos_token_id) for seq in seqs]
        held = held if any(held) else None
        if greedy and bucket is not None and held is None:
            out_BT = self._replay(seqs, bucket)
        else:
            start = time.perf_counter()
            inputs = torch.from_numpy(self._rows(seqs, len(seqs))).to(self.runner.device)
            sampling = None if greedy else SamplingBatch.build(
                [s.request.params for s in seqs], [s.generator for s in seqs], self.runner.device)
            drafts_BK, draft_probs_BKV = self._propose(seqs, inputs, sampling)
            drafted = time.perf_counter()
            out_BT = self._verify(seqs, inputs, drafts_BK, draft_probs_BKV, sampling, held)
            self.stats.draft_seconds += drafted - start
            self.stats.verify_seconds += time.perf_counter() - drafted
        host = out_BT.tolist()   # the step's one synchronisation
        emitted = [row[1:1 + row[0]] for row in host[:len(seqs)]]
        self.stats.record([len(e) for e in emitted])
        return emitted

    def _fields(self, inputs: torch.Tensor):
        """The columns of the input rows (``_rows``): last tokens [B, K + 1], slots, cached lengths, pending pairs
        [B] and block tables [B, W]."""
        K = self.tokens
        return (inputs[:, :K + 1], inputs[:, K + 1].contiguous(), inputs[:, K + 2].contiguous(),
                inputs[:, K + 3].contiguous(), inputs[:, K + 4:].contiguous())

    def _verify(self, seqs: list[Sequence] | None, inputs: torch.Tensor, drafts_BK: torch.Tensor,
                draft_probs_BKV: torch.Tensor | None, sampling: SamplingBatch | None,
                held: list[list[int]] | None = None) -> torch.Tensor:
        """The target's forward over [x_c, drafts], acceptance, and the cache kept to match: [B, K + 2] int64, each
        row's emitted count then its tokens. ``held``: each row's end tokens held back until its ``min_tokens``
        (``held_end_tokens``), None when no row holds any."""
        model, cache = self.model, self.runner.cache
        last_BT, slots_B, computed_B, pending_B, tables_BW = self._fields(inputs)
        kv = batch_cache(model.config, cache.latents, cache.states, slots_B, tables_BW, computed_B, steps=self.steps)
        ids_BT = torch.cat([last_BT.gather(1, (pending_B - 1)[:, None]), drafts_BK], dim=1)
        out = self.runner.lm(ids_BT, cache=kv, features_at=self.feature_layers)
        logits_BTV = out.logits if held is None else _hold_back(out.logits, seqs, held)
        tokens_BT, counts_B = verify_greedy(drafts_BK, logits_BTV)
        if sampling is not None:
            self._verify_sampled(seqs, drafts_BK, draft_probs_BKV, logits_BTV, tokens_BT, counts_B)
        cache.states.commit_steps(slots_B, counts_B - 1, self.steps)
        self.pending[slots_B] = self.draft.fuse_features(out.features)
        return torch.cat([counts_B[:, None], tokens_BT], dim=1)

    # ------------------------------------------------------------------ CUDA graphs
    def capture(self, buckets: list[int], pool, side: torch.cuda.Stream) -> None:
        """Capture, per bucket, the all-greedy step as two graphs sharing ``pool``: the draft chain, then the
        verification (timed apart with events between the replays). Warm-up and capture run on padding rows."""
        device = self.runner.device
        largest = max(buckets)
        self._host = torch.empty(largest, self.tokens + 4 + self.runner.table_width, dtype=torch.long,
                                 pin_memory=True)
        self._host_np = self._host.numpy()
        self._static = torch.from_numpy(self._rows([], largest)).to(device)
        self._drafts = torch.zeros(largest, self.tokens, dtype=torch.long, device=device)
        with torch.no_grad():
            for bucket in sorted(buckets, reverse=True):
                inputs, drafts = self._static[:bucket], self._drafts[:bucket]

                def draft_body():
                    drafts.copy_(self._propose(None, inputs, None)[0])
                    return drafts

                def verify_body():
                    return self._verify(None, inputs, drafts, None, None)

                graphs = []
                for body in (draft_body, verify_body):
                    warm_up(device, side, body)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = body()
                    graphs.append(graph)
                self.graphs[bucket] = (graphs[0], graphs[1], out)
        self.buckets = sorted(self.graphs)
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        self._timed = False

    def _replay(self, seqs: list[Sequence], bucket: int) -> torch.Tensor:
        """Stage the inputs of ``seqs`` padded to ``bucket`` rows (one copy), replay its draft and verification
        graphs: [bucket, K + 2] (see ``_verify``)."""
        if self._timed:   # the previous replay's times, read now that its tokens reached the host
            start, drafted, verified = self._events
            self.stats.draft_seconds += start.elapsed_time(drafted) / 1e3
            self.stats.verify_seconds += drafted.elapsed_time(verified) / 1e3
        self._host_np[:bucket] = self._rows(seqs, bucket)
        self._static[:bucket].copy_(self._host[:bucket], non_blocking=True)
        draft_graph, verify_graph, out = self.graphs[bucket]
        start, drafted, verified = self._events
        start.record()
        draft_graph.replay()
        drafted.record()
        verify_graph.replay()
        verified.record()
        self._timed = True
        return out

    def _rows(self, seqs: list[Sequence], rows: int) -> np.ndarray:
        """The step's host inputs, one int64 row per sequence, padded to ``rows``: the K + 1 last tokens' slots (its
        m pending pairs' next tokens, then padding), KDA slot, cached length c, pending pairs m, block table. A
        padding row has slot -1, c = m = 1 and the scratch block's table: it writes nothing a live sequence reads."""
        K = self.tokens
        runner = self.runner
        out = np.zeros((rows, K + 4 + runner.table_width), dtype=np.int64)
        out[:, K + 1], out[:, K + 2], out[:, K + 3] = -1, 1, 1
        out[:, K + 4:] = runner.cache.latents.scratch_block
        for i, seq in enumerate(seqs):
            m = seq.spec_pending
            if not 1 <= m <= K + 1:
                raise RuntimeError(f"sequence {seq.request.request_id} has {m} pending draft pairs (1..{K + 1})")
            out[i, :m] = seq.tokens[-m:]
            out[i, K + 1], out[i, K + 2], out[i, K + 3] = seq.slot, seq.computed, m
            out[i, K + 4:K + 4 + len(seq.blocks)] = seq.blocks
        return out

    def _propose(self, seqs: list[Sequence] | None, inputs: torch.Tensor, sampling: SamplingBatch | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft chain: K tokens per row [B, K] and, when some row samples (``sampling`` given), the
        distributions they were drawn from [B, K, V]; the argmax of the draft's logits otherwise."""
        model, draft, latents = self.model, self.draft, self.runner.cache.latents
        last_BT, slots_B, computed_B, pending_B, tables_BW = self._fields(inputs)
        rows_B = torch.arange(len(slots_B), device=slots_B.device)
        view = latents.view(self.draft_layer, tables_BW, computed_B - pending_B, multi_token=True)
        feature_BTD, normed_BTD = draft(self.pending[slots_B], model.embed(last_BT), view)
        feature_B1D = feature_BTD[rows_B, pending_B - 1][:, None]
        normed_BD = normed_BTD[rows_B, pending_B - 1]
        drafts, probs = [], []
        for k in range(self.tokens):
            logits_BN = draft.logits(model, normed_BD)   # N: the draft's vocabulary (the target's V, or reduced)
            if sampling is None or sampling.all_greedy:
                token_B = draft.target_ids(row_argmax(logits_BN))
            else:
                probs_BN = probabilities(logits_BN, sampling)
                probs.append(self._over_target_vocabulary(probs_BN))
                token_B = draft.target_ids(draw(probs_BN, logits_BN, sampling))
            drafts.append(token_B)
            if k == self.tokens - 1:
                break
            view = latents.view(self.draft_layer, tables_BW, computed_B + k)
            feature_B1D, normed_B1D = draft(feature_B1D, model.embed(token_B[:, None]), view)
            normed_BD = normed_B1D[:, 0]
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if probs else None

    def _over_target_vocabulary(self, probs_BN: torch.Tensor) -> torch.Tensor:
        """The draft's distributions [B, N] as the verification compares them, over the target's vocabulary [B, V]
        (zero outside a reduced vocabulary); a copy either way (``draw`` overwrites its input)."""
        ids = self.draft.vocab_ids
        if ids is None:
            return probs_BN.clone()
        return probs_BN.new_zeros(probs_BN.shape[0], self.model.config.vocab_size).index_copy_(1, ids, probs_BN)

    def _verify_sampled(self, seqs: list[Sequence], drafts_BK: torch.Tensor, draft_probs_BKV: torch.Tensor | None,
                        logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, counts_B: torch.Tensor) -> None:
        """Overwrite the sampled rows of the greedy verdict (``tokens_BT``, ``counts_B``) by the rejection rule
        against the target's distributions under each row's options."""
        K1 = self.tokens + 1
        params = [s.request.params for s in seqs for _ in range(K1)]
        per_token = SamplingBatch.build(params, [None] * len(params), logits_BTV.device)
        target_BTV = probabilities(logits_BTV.flatten(0, 1), per_token).unflatten(0, (len(seqs), K1))
        # Unseeded rows share the default generator, each seeded row draws from its own.
        groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
        for b, seq in enumerate(seqs):
            if seq.request.params.temperature >= GREEDY_BELOW:
                key = id(seq.generator) if seq.generator is not None else 0
                groups.setdefault(key, (seq.generator, []))[1].append(b)
        for generator, members in groups.values():
            index = torch.tensor(members, dtype=torch.long, device=drafts_BK.device)
            sampled_T, sampled_n = verify_sampled(drafts_BK[index], draft_probs_BKV[index], target_BTV[index],
                                                  generator)
            tokens_BT[index], counts_B[index] = sampled_T, sampled_n


def _hold_back(logits_BTV: torch.Tensor, seqs: list[Sequence], held: list[list[int]]) -> torch.Tensor:
    """The verification's logits with each row's held end tokens at -inf at the positions that emit a token before
    its ``min_tokens`` (position j emits the row's token number ``generated + j``), as the sampler masks them in
    plain decoding; a copy."""
    logits_BTV = logits_BTV.clone()
    for b, (seq, ids) in enumerate(zip(seqs, held)):
        if ids:
            logits_BTV[b, :seq.request.params.min_tokens - seq.generated, ids] = float("-inf")
    return logits_BTV
