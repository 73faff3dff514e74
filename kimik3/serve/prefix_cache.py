"""KDA-aware prefix cache policy: which token boundaries get a KDA checkpoint, and which survive.

K3 is 3 KDA : 1 MLA. MLA latents are paged per token, but KDA keeps one fixed-size recurrent state
per sequence, so resuming a prompt at token ``b`` needs a *checkpoint*: every KDA layer's state
after exactly ``b`` tokens (~434 MB at full scale, so checkpoints are budgeted by count). Prefixes
are named by hashes chained over fine hash blocks (512 tokens at full scale), decoupled from the
physical MLA block (6144), so a hit may land mid physical block. This module is the policy only:
the engine owns the payloads (KDA snapshot slot + MLA block refs) and frees one whenever a call
hands it back (``insert`` returned None or another checkpoint) or ``on_evict`` names it.

Engine protocol per request: ``lookup`` -> (``acquire``/copy/``release``) -> ``plan`` -> prefill,
``insert`` at each planned boundary -> decode, at each hash-block multiple ask
``want_decode_checkpoint`` and ``insert`` -> ``finish``. Time is a logical clock (one tick per
call) and a request counter (one per ``lookup``), so simulations are deterministic.

Hashing: ``h_i = sha256(h_{i-1} || int64-LE tokens of block i)``, ``h_{-1}`` derived from
``hash_block``. A :class:`BlockHasher` memoises hash lists by the *identity* of the token list
(holding a reference, so an id is never recycled while remembered) and extends them when the list
grew: token lists are treated as append-only -- pass a new list if earlier tokens change (the last
hashed block is re-checked as a guard). Several caches may share one hasher. A token list with a
``block_key(i, hash_block)`` method (``serve/multimodal.MediaTokens``: a prompt with images) has those bytes
appended to block i's before hashing, so that identical placeholder ids over different images hash apart.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("none", "coarse", "vllm", "ours", "oracle")


class BlockHasher:
    """Chained block hashes with an identity-keyed memo of the last ``memo_size`` token lists."""

    def __init__(self, hash_block: int, memo_size: int = 256) -> None:
        if not isinstance(hash_block, int) or hash_block < 1:
            raise ValueError(f"hash_block must be an integer >= 1, got {hash_block!r}")
        self.hash_block = hash_block
        self._root = hashlib.sha256(b"kimik3-prefix-v1:%d" % hash_block).digest()
        self._memo: OrderedDict[int, tuple[Sequence[int], list[bytes]]] = OrderedDict()
        self._memo_size = memo_size

    def __call__(self, token_ids: Sequence[int]) -> list[bytes]:
        """The memo's hash list for ``token_ids`` (one hash per complete block). Do not mutate."""
        B, n_full = self.hash_block, len(token_ids) // self.hash_block
        extra = getattr(token_ids, "block_key", None)   # images' content (``serve/multimodal.MediaTokens``)
        entry = self._memo.get(id(token_ids))
        hashes: list[bytes] = []
        if entry is not None and entry[0] is token_ids:
            old = entry[1]
            k = len(old)
            if k <= n_full and (k == 0 or self._hash(old[k - 2] if k > 1 else self._root,
                                                     token_ids[(k - 1) * B:k * B],
                                                     extra(k - 1, B) if extra else b"") == old[k - 1]):
                hashes = old
            self._memo.move_to_end(id(token_ids))
        if len(hashes) < n_full:
            start = len(hashes)
            raw = memoryview(array("q", token_ids[start * B:n_full * B]).tobytes())
            prev = hashes[-1] if hashes else self._root
            step = 8 * B
            for i, off in enumerate(range(0, len(raw), step), start):
                prev = hashlib.sha256(prev + raw[off:off + step] + (extra(i, B) if extra else b"")).digest()
                hashes.append(prev)
        self._memo[id(token_ids)] = (token_ids, hashes)
        if len(self._memo) > self._memo_size:
            self._memo.popitem(last=False)
        return hashes

    def _hash(self, prev: bytes, block: Sequence[int], extra: bytes = b"") -> bytes:
        return hashlib.sha256(prev + array("q", block).tobytes() + extra).digest()

    def forget(self, token_ids: Sequence[int]) -> None:
        self._memo.pop(id(token_ids), None)


@dataclass(slots=True, eq=False)
class Checkpoint:
    """A stored KDA snapshot of ``token_ids[:boundary]``; ``payload`` is the engine's, opaque here."""

    boundary: int
    block_hash: bytes
    payload: Any
    pins: int = 0
    last_used: int = 0            # logical clock of the last insert/refresh/hit
    created: int = 0
    hits: int = 0
    last_req: int = 0             # request counter at the last insert/hit (reuse distance)
    parent: Checkpoint | None = None          # deepest stored ancestor ("ours" only)
    children: set[Checkpoint] = field(default_factory=set)
    chain: tuple[bytes, ...] = ()             # block hashes up to boundary ("ours" only)
    clean: bool = False                       # "ours": cached _clean() and the branch-set version
    clean_ver: int = -1
    superseded: bytes = b""                   # "ours": the fork point whose newer branch replaced this one


@dataclass(slots=True)
class _Node:
    """A block of the "ours" request trie (keyed by its chained hash)."""

    next: bytes = b""      # first successor block hash seen (b"" = none yet)
    marks: int = 0         # turn boundaries (prompt tails, turn ends) at or before this block on its path
    mark: bool = False     # a turn boundary ends exactly at this block
    tip: int = 0           # ``marks`` at the end of the latest sequence recorded through this block
    forked: bool = False   # a request has left the path here once (the old continuation was superseded)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    inserts: int = 0          # checkpoints actually stored
    evictions: int = 0
    declined: int = 0         # insert() returned None
    refreshed: int = 0        # insert() of a boundary already stored


class PrefixCache:
    """Chained-hash prefix cache of KDA checkpoints with a pluggable boundary/eviction policy.

    Policies: ``none`` stores nothing. ``coarse`` checkpoints only multiples of ``physical_block``
    (prefill and decode), LRU. ``vllm`` (vLLM 0.33 as described): per request the prompt tail
    ``floor((len-1)/B)*B`` -- the deepest boundary a resend of the same prompt can hit, and a prefix
    of the next turn -- plus the block below it; no decode checkpoints; LRU. ``ours``: see
    docs/prefix_cache.md and :meth:`_victim`. ``oracle``: unbounded, every boundary.
    """

    def __init__(self, hash_block: int, capacity: int | None, policy: str = "ours",
                 physical_block: int | None = None,
                 on_evict: Callable[[Checkpoint], None] | None = None,
                 hasher: BlockHasher | None = None, grace_factor: float = 2.0,
                 trie_size: int = 1 << 18, fork_depth_cap: int = 64, prior_forks: float = 4.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        if not isinstance(hash_block, int) or hash_block < 1:
            raise ValueError(f"hash_block must be an integer >= 1, got {hash_block!r}")
        if physical_block is not None and (not isinstance(physical_block, int) or physical_block < 1
                                           or physical_block % hash_block):
            raise ValueError(f"physical_block must be a positive multiple of hash_block={hash_block}, "
                             f"got {physical_block!r}")
        if policy == "coarse" and physical_block is None:
            raise ValueError("policy 'coarse' needs physical_block")
        if policy == "oracle" and capacity is not None:
            raise ValueError(f"policy 'oracle' is unbounded by definition; pass capacity=None, got {capacity!r}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be None or an integer >= 1, got {capacity!r}")
        if not fork_depth_cap >= 1 or not prior_forks > 0:
            raise ValueError(f"fork_depth_cap must be >= 1 and prior_forks > 0, got {fork_depth_cap!r}, "
                             f"{prior_forks!r}")
        if not grace_factor > 0 or not trie_size >= 1:
            raise ValueError(f"grace_factor must be > 0 and trie_size >= 1, got {grace_factor!r}, {trie_size!r}")
        if hasher is not None and hasher.hash_block != hash_block:
            raise ValueError(f"hasher.hash_block={hasher.hash_block} != hash_block={hash_block}")
        self.hash_block, self.capacity, self.policy = hash_block, capacity, policy
        self.physical_block, self.on_evict = physical_block, on_evict
        self.hasher = hasher or BlockHasher(hash_block)
        self._own_hasher = hasher is None
        self.stats = PrefixCacheStats()
        self._cps: dict[bytes, Checkpoint] = {}
        self._roots: set[Checkpoint] = set()        # "ours": stored checkpoints without a stored ancestor
        self._clock = 0
        self._req = 0
        # "ours": a bounded trie of recently seen request prefixes, block hash -> _Node (successor,
        # turn-boundary counts). A request that leaves a path where none left before supersedes the
        # old continuation; a point left twice is a real branch point (in _branch).
        self._succ: OrderedDict[bytes, _Node] = OrderedDict()
        self._branch: set[bytes] = set()
        self._branch_ver = 0
        self._trie_size = trie_size
        self._reuse_ema: float | None = None        # mean requests between a checkpoint's uses
        self._grace_factor = grace_factor
        self._plans = self._forks = 0                # "ours": requests planned / that forked a seen path
        # "ours": how many turn boundaries of the forked path lay beyond each new fork point
        self._fork_depths = [0] * (fork_depth_cap + 1)
        self._prior_forks = prior_forks
        self._resumed = 0                            # fork points left a second time (see plan)

    # ---- introspection ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._cps)

    def checkpoints(self) -> Iterator[Checkpoint]:
        return iter(list(self._cps.values()))

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """``h_i`` for every complete hash block of ``token_ids`` (a fresh list; memoised, see module doc)."""
        return list(self.hasher(token_ids))

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup / pins ------------------------------------------------------------------------
    def _find(self, token_ids: Sequence[int]) -> Checkpoint | None:
        hashes = self.hasher(token_ids)
        for i in range(min(len(hashes), (len(token_ids) - 1) // self.hash_block) - 1, -1, -1):
            cp = self._cps.get(hashes[i])
            if cp is not None:
                return cp
        return None

    def match_length(self, token_ids: Sequence[int]) -> int:
        """Tokens ``lookup`` would restore now; a pure query (no stats, recency or clock), for routing."""
        cp = self.peek(token_ids)
        return cp.boundary if cp is not None else 0

    def peek(self, token_ids: Sequence[int]) -> Checkpoint | None:
        """The checkpoint ``lookup`` would return, as a pure query: a request still waiting for
        memory is looked at every step, but counted (and its checkpoint refreshed) only once admitted."""
        return self._find(token_ids)

    def lookup(self, token_ids: Sequence[int]) -> Checkpoint | None:
        """Deepest stored boundary ``b <= len-1`` on this prefix (a token is always left to compute)."""
        now = self._tick()
        self._req += 1
        self.stats.queries += 1
        cp = self._find(token_ids)
        if cp is not None:
            if cp.hits == 0:                     # first reuse: how long checkpoints wait to be used
                d = self._req - cp.last_req
                self._reuse_ema = d if self._reuse_ema is None else 0.9 * self._reuse_ema + 0.1 * d
            cp.last_used, cp.last_req = now, self._req
            cp.hits += 1
            self.stats.hits += 1
            self.stats.hit_tokens += cp.boundary
        return cp

    def acquire(self, cp: Checkpoint) -> None:
        """Pin ``cp`` (the engine is copying from it); pinned checkpoints are never evicted."""
        if self._cps.get(cp.block_hash) is not cp:
            raise ValueError(f"acquire() of a checkpoint not in the cache (boundary {cp.boundary})")
        self._tick()
        cp.pins += 1

    def release(self, cp: Checkpoint) -> None:
        if cp.pins <= 0:
            raise RuntimeError(f"release() without a matching acquire() (boundary {cp.boundary})")
        self._tick()
        cp.pins -= 1

    # ---- policy: where to checkpoint ----------------------------------------------------------
    def plan(self, token_ids: Sequence[int], start: int, hints: Sequence[int] = ()) -> list[int]:
        """Sorted boundaries ``start < b <= len`` (multiples of hash_block) to snapshot in prefill.

        ``ours``: (1) the branch point, where this prompt leaves the deepest prefix the trie has
        seen while that prefix was seen continuing differently (shared system prompts, forks);
        (2) message-end ``hints`` rounded down, on first sight only (beyond the seen prefix);
        (3) the prompt tail ``floor((len-1)/B)*B`` (a regenerate of the same prompt hits it).
        Then records the prompt in the trie, with its tail as a turn boundary.

        A fork where no request left the path before is a *new fork point*: its depth (turn
        boundaries of the old path beyond it) feeds the fork-depth histogram that :meth:`_victim`
        uses, and the old continuation's checkpoints are marked ``superseded`` (the session moved
        on). A request leaving the same point again makes it a real branch point and revives them."""
        self._tick()
        n, B = len(token_ids), self.hash_block
        if not 0 <= start <= n:
            raise ValueError(f"start must be in [0, len(token_ids)={n}], got {start}")
        tail = (n - 1) // B * B if n else 0
        if self.policy == "none":
            out: set[int] = set()
        elif self.policy == "coarse":
            P = self.physical_block or B
            out = set(range(P, n + 1, P))
        elif self.policy == "vllm":
            out = {tail, tail - B}
        elif self.policy == "oracle":
            out = set(range(B, n + 1, B))
        else:
            hashes = self.hasher(token_ids)
            seen = self._seen_depth(hashes)           # blocks [0, seen) were seen before
            out = {tail}
            self._plans += 1
            h = hashes[seen - 1] if seen else b""
            node = self._succ[h] if seen else None
            if node is not None and (seen < len(hashes) and node.next not in (b"", hashes[seen])
                                     or seen == len(hashes) and node.next != b""):
                out.add(seen * B)
                self._forks += 1
                if not node.forked:       # first fork here: learn its depth, supersede the old branch
                    node.forked = True
                    self._fork_depths[min(node.tip - node.marks, len(self._fork_depths) - 1)] += 1
                    node.next = hashes[seen] if seen < len(hashes) else b""
                    for c in self._cps.values():
                        if len(c.chain) > seen and c.chain[seen - 1] == h and not c.superseded:
                            c.superseded = h
                elif h not in self._branch:  # left again: a real branch point, its branches revive
                    self._resumed += 1
                    self._branch.add(h)
                    self._branch_ver += 1
                    for c in self._cps.values():
                        if c.superseded == h:
                            c.superseded = b""
            out.update(h // B * B for h in hints if seen * B < h // B * B <= n)
            self._record(hashes, tail // B)
        return sorted(b for b in out if start < b <= n and b > 0)

    def want_decode_checkpoint(self, token_ids: Sequence[int]) -> bool:
        """At a hash-block multiple during decode: snapshot here? ``ours``/``oracle``: always (each
        new decode tail makes the previous one a dominated ancestor, evicted first)."""
        self._tick()
        if len(token_ids) % self.hash_block or not token_ids:
            return False
        if self.policy == "coarse":
            return len(token_ids) % (self.physical_block or self.hash_block) == 0
        return self.policy in ("ours", "oracle")

    def finish(self, token_ids: Sequence[int]) -> None:
        """Request ended: ``ours`` records prompt + output in the trie (so the next turn reads as an
        extension, not a branch), its last hash boundary as a turn boundary; a private hasher forgets
        the list (a shared one is its owner's)."""
        self._tick()
        if self.policy == "ours":
            self._record(self.hasher(token_ids), (len(token_ids) - 1) // self.hash_block)
        if self._own_hasher:
            self.hasher.forget(token_ids)

    def _seen_depth(self, hashes: list[bytes]) -> int:
        lo, hi = 0, len(hashes)        # chained hashes: seen blocks form a prefix; binary search it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self._succ:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _record(self, hashes: list[bytes], mark: int) -> None:
        """Record a request's blocks in the trie: successors (a second, different one makes a branch
        point), a turn boundary after block ``mark`` (0 = none), and the path's tip mark count."""
        succ, nodes, marks = self._succ, [], 0
        for i, h in enumerate(hashes):
            nxt = hashes[i + 1] if i + 1 < len(hashes) else b""
            node = succ.get(h)
            if node is None:
                node = succ[h] = _Node(nxt, marks)
            else:
                if node.next == b"":
                    node.next = nxt
                elif nxt and node.next != nxt and h not in self._branch:
                    self._branch.add(h)
                    self._branch_ver += 1
                succ.move_to_end(h)
            if i == mark - 1 and not node.mark:
                node.mark, node.marks = True, node.marks + 1
            marks = node.marks
            nodes.append(node)
        for node in nodes:
            node.tip = marks
        while len(succ) > self._trie_size:
            h = succ.popitem(last=False)[0]
            if h in self._branch:
                self._branch.discard(h)
                self._branch_ver += 1

    # ---- storage ------------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], boundary: int, payload: Any) -> Checkpoint | None:
        """Store a checkpoint of ``token_ids[:boundary]`` owning ``payload``; may evict others.

        Returns the new checkpoint (the cache now owns ``payload`` until ``on_evict``), or None
        (declined / no unpinned room: the engine frees ``payload``), or -- if this boundary is
        already stored -- the *existing* checkpoint, refreshed: its ``payload is not`` yours, so the
        engine frees its new payload."""
        now = self._tick()
        B = self.hash_block
        if not isinstance(boundary, int) or boundary < B or boundary % B or boundary > len(token_ids):
            raise ValueError(f"boundary must be a multiple of hash_block={B} in [{B}, {len(token_ids)}], "
                             f"got {boundary!r}")
        if self.policy == "none":
            self.stats.declined += 1
            return None
        hashes = self.hasher(token_ids)
        h = hashes[boundary // B - 1]
        old = self._cps.get(h)
        if old is not None:
            old.last_used, old.last_req = now, self._req
            self.stats.refreshed += 1
            return old
        cp = Checkpoint(boundary, h, payload, last_used=now, created=now, last_req=self._req)
        if self.policy == "ours":
            cp.chain = tuple(hashes[:boundary // B])
            self._link(cp)
        self._cps[h] = cp
        while self.capacity is not None and len(self._cps) > self.capacity:
            victim = self._victim()
            if victim is None or victim is cp:
                self._remove(cp)
                self.stats.declined += 1
                return None
            self._evict(victim)
        self.stats.inserts += 1
        return cp

    def evict_one(self) -> bool:
        """Evict the policy's next victim (``on_evict`` it), e.g. to free MLA blocks under memory
        pressure; False if nothing is evictable (empty, or everything pinned)."""
        self._tick()
        victim = self._victim()
        if victim is None:
            return False
        self._evict(victim)
        return True

    def clear(self) -> None:
        """Evict every unpinned checkpoint (``on_evict`` each); pinned ones stay until released."""
        self._tick()
        for cp in list(self._cps.values()):
            if cp.pins == 0:
                self._evict(cp)

    def _evict(self, cp: Checkpoint) -> None:
        self._remove(cp)
        self.stats.evictions += 1
        if self.on_evict is not None:
            self.on_evict(cp)

    def _remove(self, cp: Checkpoint) -> None:
        del self._cps[cp.block_hash]
        if self.policy == "ours":              # splice out of the ancestor forest
            siblings = cp.parent.children if cp.parent is not None else self._roots
            siblings.discard(cp)
            for c in cp.children:
                c.parent, c.clean_ver = cp.parent, -1
                siblings.add(c)
            cp.children, cp.parent = set(), None

    def _link(self, cp: Checkpoint) -> None:
        """Put ``cp`` under its deepest stored ancestor; adopt that ancestor's children below ``cp``."""
        k = len(cp.chain)
        parent = next((self._cps[h] for h in reversed(cp.chain[:-1]) if h in self._cps), None)
        siblings = parent.children if parent is not None else self._roots
        for c in [c for c in siblings if len(c.chain) > k and c.chain[k - 1] == cp.block_hash]:
            siblings.discard(c)
            c.parent, c.clean_ver = cp, -1
            cp.children.add(c)
        cp.parent = parent
        siblings.add(cp)

    # ---- policy: what to evict ----------------------------------------------------------------
    def _clean(self, c: Checkpoint) -> bool:
        """No branch point the trie has seen lies on the path from ``c.parent`` (its own block
        included) to ``c``; cached per checkpoint until the branch set changes."""
        if c.clean_ver != self._branch_ver:
            k = len(c.parent.chain) - 1 if c.parent is not None else 0
            c.clean = not any(h in self._branch for h in itertools.islice(c.chain, k, len(c.chain) - 1))
            c.clean_ver = self._branch_ver
        return c.clean

    def _victim(self) -> Checkpoint | None:
        """Unpinned checkpoint to evict: LRU for coarse/vllm; for ``ours`` the least expected saving
        on the owning path's next request, from one pass over the ancestor forest:

        * not dominated (a session tail, a shared prefix, a seen branch point): the next request
          through it saves ``gain`` = boundary - nearest non-dominated ancestor (what it would
          recompute from there), weighted by ``1 + hits`` so often-hit shared prefixes stay;
        * dominated (a live stored descendant is reached without crossing a real branch point, so
          it only serves a *future* fork, e.g. a regenerate of an earlier turn): fork rate (share of
          requests that left a seen path, Laplace-smoothed) x the chance that a fork lands in
          [boundary, nearest child), where it is the best fallback, x (boundary - nearest stored
          ancestor) (what it then saves). That chance comes from the online fork-depth histogram:
          the turn boundaries in the interval sit at known depths below the path's latest tip
          (``_Node.marks``/``tip``), and it sums their observed shares; it is blended with the
          uniform-over-tokens prior (interval / path depth) by weight n / (n + prior_forks) after n
          observed fork points.

        Both are scaled by ``alive``: 1 until the last use -- of the subtree, or for a branch point
        of the checkpoint itself -- is ``grace_factor`` x the mean first-reuse distance old, then
        decaying exponentially, so finished sessions drain out; a superseded checkpoint is scaled by
        the observed resume rate (fork points left again / new fork points, Laplace-smoothed).
        Ties keep the incumbent. Ranking by value rather than recency keeps a stable subset when
        live sessions outnumber the budget, where LRU evicts exactly the session that comes next."""
        cands = [c for c in self._cps.values() if c.pins == 0]
        if not cands:
            return None
        if self.policy != "ours":
            return min(cands, key=lambda c: c.last_used)
        grace = float("inf") if self._reuse_ema is None else self._grace_factor * max(self._reuse_ema, 1.0)
        fork_rate = (self._forks + 1) / (self._plans + 2)
        n_points = sum(self._fork_depths)
        resume = (self._resumed + 1) / (n_points + 2)   # chance a superseded branch is used again
        info: dict[Checkpoint, tuple[bool, int, int]] = {}
        order: list[Checkpoint] = []
        stack = [(r, 0, 0) for r in self._roots]   # (node, nearest ancestor, nearest kept ancestor)
        while stack:
            c, anc, kept = stack.pop()
            dom = any(self._clean(d) and (not d.superseded or c.superseded) for d in c.children)
            info[c] = (dom, anc, kept)
            order.append(c)
            stack.extend((d, c.boundary, kept if dom else c.boundary) for d in c.children)
        recent: dict[Checkpoint, int] = {}        # latest use in the subtree
        deep: dict[Checkpoint, int] = {}          # deepest boundary in the subtree
        for c in reversed(order):                 # children before parents
            recent[c] = max([c.last_req] + [recent[d] for d in c.children])
            deep[c] = max([c.boundary] + [deep[d] for d in c.children])

        n_obs = n_points
        learned = n_obs / (n_obs + self._prior_forks)
        cdf = list(itertools.accumulate(k / max(n_obs, 1) for k in self._fork_depths))

        def at_most(j: int) -> float:          # observed share of new forks with depth <= j
            return 0.0 if j < 0 else cdf[min(j, len(cdf) - 1)]

        def fork_share(c: Checkpoint, d: Checkpoint) -> float:
            """Chance that a fork of c's path lands in [c, d), where c is its best fallback."""
            uniform = (d.boundary - c.boundary) / deep[c]
            nc, nd = self._succ.get(c.block_hash), self._succ.get(d.block_hash)
            if not learned or nc is None or nd is None:
                return uniform
            # turn boundaries in [c, d) are the path's (lo+1)-th .. hi-th, so a fork at one of
            # them has tip - hi .. tip - lo - 1 turn boundaries beyond it
            lo, hi = nc.marks - nc.mark, nd.marks - nd.mark
            seen = max(0.0, at_most(nc.tip - lo - 1) - at_most(nc.tip - hi - 1))
            return learned * seen + (1 - learned) * uniform

        def value(c: Checkpoint) -> tuple[float, int]:
            dom, anc, kept = info[c]
            # a branch point is alive while requests stop at it; anything else while its subtree is used
            age = self._req - (c.last_req if not dom and c.children else recent[c])
            alive = 1.0 if age <= grace else math.exp(1.0 - age / grace)
            if c.superseded:
                alive *= resume
            if dom:
                d = min(c.children, key=lambda d: (bool(d.superseded) and not c.superseded, d.boundary))
                return (fork_rate * fork_share(c, d) * (c.boundary - anc) * alive, -c.created)
            return ((c.boundary - kept) * (1 + c.hits) * alive, -c.created)

        return min(cands, key=value)
