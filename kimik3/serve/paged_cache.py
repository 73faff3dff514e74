"""The engine's hybrid cache: MLA latents in paged physical blocks, KDA states in a slot pool.

Legend: N = physical blocks, P = tokens per physical block, C = MLA cache width (576 in K3),
B = sequences in a step, T = new tokens per sequence, S = tokens attended, Z = KDA slots.

- ``BlockAllocator`` is bookkeeping only: a free list and reference counts. A block is shared by
  every sequence and prefix checkpoint that references it and returns to the free list when the
  last reference goes.
- ``LatentPool`` holds one [N, P, C] tensor per MLA layer. A sequence owns a *block table*
  (block ids, in order); token position p lives in block ``table[p // P]`` at offset ``p % P``.
- ``PagedLatentView`` is what one MLA layer sees during one forward: it scatters the new latents
  into their slots and gathers, per row, every latent up to that row's length, with a mask that
  hides padding and the future. Rows of a decode batch have different lengths; that is the point.
  The slots themselves (``PagedIndex``) are computed once a forward and shared by its MLA layers.
- Both pools keep one spare row past the rows they hand out (``LatentPool.scratch_block``, and
  the state pool's last row, slot -1): the padding rows of a decode batch replayed as a CUDA graph at a larger
  bucket write there, never into a live sequence's cache.
- With speculative decoding the latent pool holds one more layer, the draft's (``kimik3.model.draft``), under the
  same block tables; a verification records every KDA state after each of its tokens (``StepStates``) and keeps
  the one after the last accepted token (``StatePool.commit_steps``).
- ``StatePool`` holds the fixed-size KDA state (conv inputs + fp32 recurrent state) of every KDA
  layer in Z slots: live sequences and prefix checkpoints each take one slot. A forward sees the
  recurrent states as pooled ``KDAState``s and advances their rows in place; the small conv inputs are
  gathered before it and scattered after. A checkpoint is a slot-to-slot copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kimik3.config.schema import K3Config
from kimik3.model.cache import K3Cache, KDAState, offset_causal
from kimik3.ops.mla import paged_mla_backend, paged_mla_decode, paged_slots, paged_store
from kimik3.serve.piecewise import eager_region


class OutOfBlocks(RuntimeError):
    """The allocator cannot satisfy a request; the scheduler checks before asking, so this is a bug."""


class BlockAllocator:
    """Free list + reference counts over ``num_blocks`` physical block ids."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"asked for {count} blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def incref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._refs[block] < 1:
                raise RuntimeError(f"block {block} is free: cannot share it")
            self._refs[block] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._refs[block] < 1:
                raise RuntimeError(f"block {block} released more often than it was referenced")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class LatentPool:
    """MLA latents of every MLA layer: ``tensors[i]`` is [N + 1, P, C] for the i-th MLA layer (block N is the
    scratch block)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, width: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.tensors = [torch.zeros(num_blocks + 1, block_size, width, dtype=dtype, device=device)
                        for _ in range(num_layers)]

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, width: int, dtype: torch.dtype) -> int:
        return num_layers * block_size * width * torch.empty((), dtype=dtype).element_size()

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        """Copy-on-write of a partly shared block: the first ``tokens`` slots of ``src`` to ``dst``."""
        for pool in self.tensors:
            pool[dst, :tokens] = pool[src, :tokens]

    def view(self, layer: int, tables_BN: torch.Tensor, lengths_B: torch.Tensor,
             max_length: int | None = None, multi_token: bool = False,
             index: "PagedIndex | None" = None) -> "PagedLatentView":
        """Layer ``layer``'s view for one forward; ``index``: the forward's ``PagedIndex``, shared by its layers
        (None: one of its own, from the same tables and lengths)."""
        index = index if index is not None else PagedIndex(tables_BN, lengths_B, self.block_size, max_length)
        return PagedLatentView(self.tensors[layer], index, multi_token)


class PagedIndex:
    """Where one forward's tokens lie in the paged pools: the slots its new tokens are written to (the CPU's decode
    and every prefill; on CUDA a decode step's ``paged_store`` finds them itself), the slots of the keys each row
    attends to, and the tables and first-token lengths of the absorbed attention. Every MLA layer of a forward shares
    the rows' block tables, cached lengths and block size, so the index arithmetic runs once a forward and the layers
    reuse its tensors (each is made on first use, inside a CUDA graph's capture as well: the graph replays it once).

    ``tables_BN``: the rows' block tables padded to a common width with any valid block id (padding is never read
    unmasked); ``lengths_B``: the tokens each row already holds; ``max_length``: their largest value when the
    caller knows it on the host (else ``max_length()`` reads it back: a synchronisation)."""

    def __init__(self, tables_BN: torch.Tensor, lengths_B: torch.Tensor, block_size: int,
                 max_length: int | None = None):
        self.tables_BN = tables_BN
        self.lengths_B = lengths_B
        self.block_size = block_size
        self._max_length = max_length
        self._memo: dict[tuple, object] = {}

    def reset(self, max_length: int | None = None) -> None:
        """Forget the index tensors, for a new forward over the same (updated in place) tables and lengths: a
        piecewise prefill graph's eager regions, which run again at each replay."""
        self._max_length = max_length
        self._memo.clear()

    def max_length(self) -> int:
        if self._max_length is None:
            self._max_length = int(self.lengths_B.max())
        return self._max_length

    def _once(self, key: tuple, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def slots(self, positions_BX: torch.Tensor) -> torch.Tensor:
        """Flat pool rows (block * P + offset) of the positions [B, X] of each row."""
        return paged_slots(self.tables_BN, positions_BX, self.block_size)

    def positions(self, length: int) -> torch.Tensor:
        """[B, T]: the positions of each row's ``length`` new tokens."""
        return self._once(("positions", length), lambda: self.lengths_B[:, None] + torch.arange(
            length, device=self.lengths_B.device)[None, :])

    def new_slots(self, length: int) -> torch.Tensor:
        """[B T]: the flat pool rows the new tokens are written to."""
        return self._once(("new", length), lambda: self.slots(self.positions(length)).flatten())

    def key_slots(self, total: int) -> torch.Tensor:
        """[B total]: the flat pool rows of each row's first ``total`` positions."""
        def make():
            keys = torch.arange(total, device=self.lengths_B.device)
            return self.slots(keys[None, :].expand(len(self.lengths_B), -1)).flatten()
        return self._once(("keys", total), make)

    def attention_rows(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [B, N], the first new token's attended count [B]) for ``paged_mla_decode`` with
        ``tokens_per_row = length`` (each new token attends to its row's latents up to and including its own). On the
        CPU the tables are cut to the longest row (the torch path gathers whole tables; there are no graphs there)."""
        def make():
            tables = self.tables_BN
            if not tables.is_cuda:
                tables = tables[:, :(self.max_length() + length - 1) // self.block_size + 1]
            return tables, self.lengths_B + 1
        return self._once(("rows", length), make)


class PagedLatentView:
    """One MLA layer's cache for one forward of B rows (``PagedIndex``: their block tables and cached lengths).

    ``multi_token``: the forward's T tokens of a row go through ``decode_absorbed`` together (a speculative
    verification or draft step), each attending to the row's cache and the tokens before it."""

    def __init__(self, pool_NPC: torch.Tensor, index: PagedIndex, multi_token: bool = False):
        if index.block_size != pool_NPC.shape[1]:
            raise ValueError(f"the index is for blocks of {index.block_size} tokens, the pool's hold "
                             f"{pool_NPC.shape[1]}")
        self.pool_NPC = pool_NPC
        self.index = index
        self.multi_token = multi_token

    # The MLA layer's cached attention (shaped by ``max_length``) runs outside a prefill's piecewise CUDA graphs.
    eager_region = staticmethod(eager_region)

    def attend(self, kv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, width = kv_BTC.shape
        index = self.index
        flat = self.pool_NPC.view(-1, width)
        flat[index.new_slots(length)] = kv_BTC.reshape(-1, width).to(flat.dtype)

        longest = index.max_length()
        total = longest + length
        capacity = index.tables_BN.shape[1] * self.pool_NPC.shape[1]
        if total > capacity:
            raise ValueError(f"paged MLA cache: {total} tokens exceed the block tables' {capacity}")
        kv_BSC = flat[index.key_slots(total)].view(batch, total, width)
        if batch == 1:   # one row: causal after its cached tokens (a fresh prefill: plain causal)
            return kv_BSC, None if longest == 0 else offset_causal(length, total)
        keys_S = torch.arange(total, device=kv_BTC.device)
        mask_BTS = keys_S[None, None, :] <= index.positions(length)[:, :, None]   # causal, inside the row's length
        return kv_BSC, mask_BTS[:, None]

    def decode_absorbed(self, kv_BTC: torch.Tensor, q_latent_BTHC: torch.Tensor, q_slice_BTHR: torch.Tensor,
                        scale: float) -> torch.Tensor:
        """Store the T new latents of every row (``kimik3.ops.mla.paged_store`` on CUDA), then attend each token to
        its row's latents up to and including its own, where they lie in the pool (``kimik3.ops.mla.paged_mla_decode``
        with the row's T tokens as queries sharing its block table). T is 1 unless the view is ``multi_token``.
        Nothing here reads a value back to the host, so a step through it can be replayed as a CUDA graph. Returns
        [B, T, H, C]."""
        batch, length, width = kv_BTC.shape
        if length != 1 and not self.multi_token:
            raise ValueError(f"decode_absorbed takes one token per row, got {length} (a multi_token view takes more)")
        index = self.index
        if paged_mla_backend(kv_BTC) == "triton":   # one kernel finds each token's slot as it writes the latent
            paged_store(self.pool_NPC, kv_BTC, index.tables_BN, index.lengths_B)
        else:
            self.pool_NPC.view(-1, width)[index.new_slots(length)] = kv_BTC.reshape(-1, width).to(self.pool_NPC.dtype)
        tables_BN, first_B = index.attention_rows(length)
        out_XHC = paged_mla_decode(q_latent_BTHC.flatten(0, 1), q_slice_BTHR.flatten(0, 1), self.pool_NPC, tables_BN,
                                   first_B, scale, tokens_per_row=length)
        return out_XHC.unflatten(0, (batch, length))


class StatePool:
    """KDA states of every KDA layer for ``num_slots`` sequences or checkpoints, plus the scratch slot (the last
    row, which slot -1 also names: a padding row of a decode batch writes its conv inputs there and ``kda_decode``
    skips its recurrent state)."""

    def __init__(self, config: K3Config, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        heads, head_dim = config.kda.num_heads, config.kda_head_dim
        kda_layers = config.num_layers - len(config.mla_layer_indices)
        rows = num_slots + 1
        # Every layer's rows in one tensor per kind, so that a slot's copy, zeroing or commit is one operation over
        # all layers (not two a layer); ``conv`` and ``recurrent`` are the per-layer views the model reads (indexed,
        # not ``unbind``'s views, which refuse in-place writes under autograd).
        self.conv_LPCW = torch.zeros(kda_layers, rows, 3 * heads * head_dim, config.kda.conv_kernel - 1,
                                     dtype=dtype, device=device)
        self.recurrent_LPHKV = torch.zeros(kda_layers, rows, heads, head_dim, head_dim, dtype=torch.float32,
                                           device=device)
        self.conv = [self.conv_LPCW[i] for i in range(kda_layers)]
        self.recurrent = [self.recurrent_LPHKV[i] for i in range(kda_layers)]
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    @staticmethod
    def slot_bytes(config: K3Config, dtype: torch.dtype) -> int:
        """Bytes of one slot: every KDA layer's conv inputs and fp32 recurrent state."""
        heads, head_dim = config.kda.num_heads, config.kda_head_dim
        kda_layers = config.num_layers - len(config.mla_layer_indices)
        conv = 3 * heads * head_dim * (config.kda.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        return kda_layers * (conv + heads * head_dim * head_dim * 4)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KDA state pool exhausted")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"KDA slot {slot} freed twice")
        self._free.append(slot)

    def zero(self, slot: int) -> None:
        self.conv_LPCW[:, slot].zero_()
        self.recurrent_LPHKV[:, slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        self.conv_LPCW[:, dst] = self.conv_LPCW[:, src]
        self.recurrent_LPHKV[:, dst] = self.recurrent_LPHKV[:, src]

    def view(self, slots_B: torch.Tensor, valid_B: torch.Tensor | None = None,
             steps: "StepStates | None" = None) -> list[KDAState]:
        """Per KDA layer, the pooled states of the sequences in ``slots_B``: the layer reads and advances their
        pool rows in place (no copy in or out; a recurrent state is ~6 MB per sequence and layer at K3's
        width). ``valid_B``: the real tokens of a padded chunk (``KDAState.valid_B``). ``steps``: a speculative
        verification, which records each token's state there (``KDAState.stepwise``)."""
        per_layer = steps.layers(len(slots_B)) if steps is not None else [(None, None)] * len(self.conv)
        return [KDAState(None, None, pool_PHKV=rec, slots_B=slots_B, conv_pool_PCW=conv, valid_B=valid_B,
                         steps_TBHKV=steps_rec, steps_conv_TBCW=steps_conv)
                for conv, rec, (steps_rec, steps_conv) in zip(self.conv, self.recurrent, per_layer)]

    def commit_steps(self, slots_B: torch.Tensor, index_B: torch.Tensor, steps: "StepStates") -> None:
        """After a verification: row b's state becomes the one it had after token ``index_B[b]`` (its last accepted
        token), for every KDA layer. Device ops only (no host read): a gather and a scatter per kind."""
        rows_B = torch.arange(len(slots_B), device=slots_B.device)
        steps_rec, steps_conv = steps.stacked(len(slots_B))
        self.recurrent_LPHKV[:, slots_B] = steps_rec[:, index_B, rows_B]
        self.conv_LPCW[:, slots_B] = steps_conv[:, index_B, rows_B]


class StepStates:
    """Per KDA layer, the states of up to ``rows`` sequences after each of ``tokens`` tokens of a speculative
    verification: what lets the engine keep the state after the last accepted token. A batch of B rows sees each
    layer's buffers as contiguous [T, B, H, K, V] (recurrent) and [T, B, C, W-1] (conv inputs) views of the same
    memory (a verification's kernel writes them whole); every layer's lie in one tensor per kind, as the pool's."""

    def __init__(self, pool: StatePool, tokens: int, rows: int):
        self.tokens = tokens
        self.rows = rows
        rec, conv = pool.recurrent_LPHKV, pool.conv_LPCW
        self.recurrent_LXHKV = torch.empty(rec.shape[0], tokens * rows, *rec.shape[2:], dtype=rec.dtype,
                                           device=rec.device)
        self.conv_LXCW = torch.empty(conv.shape[0], tokens * rows, *conv.shape[2:], dtype=conv.dtype,
                                     device=conv.device)

    @staticmethod
    def nbytes(config: K3Config, dtype: torch.dtype, tokens: int, rows: int) -> int:
        return tokens * rows * StatePool.slot_bytes(config, dtype)

    def layers(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (recurrent, conv) buffers for a batch of ``batch`` rows."""
        rec_LTB, conv_LTB = self.stacked(batch)
        return [(rec_LTB[i], conv_LTB[i]) for i in range(rec_LTB.shape[0])]

    def stacked(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's buffers for a batch of ``batch`` rows: [L, T, B, H, K, V] and [L, T, B, C, W-1]."""
        if batch > self.rows:
            raise ValueError(f"a verification of {batch} rows exceeds the {self.rows} step rows")
        used = self.tokens * batch
        rec, conv = self.recurrent_LXHKV, self.conv_LXCW
        return (rec[:, :used].view(rec.shape[0], self.tokens, batch, *rec.shape[2:]),
                conv[:, :used].view(conv.shape[0], self.tokens, batch, *conv.shape[2:]))


def batch_cache(config: K3Config, latents: LatentPool, states: StatePool, slots_B: torch.Tensor,
                tables_BN: torch.Tensor, lengths_B: torch.Tensor, max_length: int | None = None,
                valid_B: torch.Tensor | None = None, steps: StepStates | None = None) -> K3Cache:
    """The model-facing ``K3Cache`` for one forward over B pooled sequences. ``max_length``: the longest row's
    cached length when the host knows it (a prefill), which spares the MLA layers reading it back. ``valid_B``:
    the real tokens of each row of a padded chunk (the rest is padding; ``KDAState.valid_B``). ``steps``: a
    speculative verification (every row's T tokens through the one-token paths, each KDA state recorded)."""
    kda_states = states.view(slots_B, valid_B, steps)
    index = PagedIndex(tables_BN, lengths_B, latents.block_size, max_length)   # shared by the MLA layers
    layers: list = []
    mla_index = kda_index = 0
    for spec in config.layer_plan():
        if spec.mixer == "mla":
            layers.append(latents.view(mla_index, tables_BN, lengths_B, max_length, multi_token=steps is not None,
                                       index=index))
            mla_index += 1
        else:
            layers.append(kda_states[kda_index])
            kda_index += 1
    return K3Cache(layers=layers)
