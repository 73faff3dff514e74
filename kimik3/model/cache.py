"""Inference state the model's forward reads and updates: the hybrid cache.

Legend: B = batch, S = cached tokens, C = MLA cache width (kv_lora_rank + rope slice = 576 in K3),
H = heads, K = V = KDA head dim, W = conv width.

- MLA layers keep one latent per token: the RMS-normalised kv latent and the unrotated slice.
  ``MLAState`` is a static [B, max_len, C] buffer (gpt-fast style); the serving engine supplies its
  own paged object (``kimik3.serve.paged_cache``) with the same ``attend`` contract: store the new
  latents, return every latent the new tokens may see plus the boolean mask that says which.
- KDA layers keep a fixed-size state per sequence, whatever the length: the conv inputs
  [B, 3·H·K, W-1] and the recurrent state [B, H, K, V] in fp32.

The model never allocates a cache itself; ``K3Cache.allocate`` (or the engine) does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kimik3.config.schema import K3Config

StepResult = TypeVar("StepResult")


def offset_causal(length: int, total: int) -> CausalBias:
    """Causality for ``length`` queries that follow ``total - length`` cached keys: query t sees keys
    <= total - length + t. SDPA runs it in its fused kernels (no [T, S] mask tensor, which would send it to
    the unfused path); ``causal_mask`` gives the boolean form."""
    return causal_lower_right(length, total)


def causal_mask(mask: CausalBias, device: torch.device) -> torch.Tensor:
    """The boolean [T, S] form of ``offset_causal(T, S)`` (True = may attend)."""
    length, total = mask.seq_len_q, mask.seq_len_kv
    return torch.ones(length, total, dtype=torch.bool, device=device).tril(total - length)


class LatentCache(Protocol):
    """What an MLA layer needs from its cache: store new latents, return what they may attend to."""

    def attend(self, kv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | CausalBias | None]:
        """-> (latents [B, S, C], mask): a boolean mask [T, S] or [B, 1, T, S] (True = may attend); or
        ``offset_causal(T, S)`` when every row's T queries follow S - T cached tokens (query t sees keys
        <= S - T + t: attention kernels take it without a mask tensor); or None for plain causal over S = T."""


class AbsorbedDecodeCache(LatentCache, Protocol):
    """A latent cache that also runs single-token absorbed attention over its own storage (``GatedMLA`` uses it
    when present): the serving engine's paged view, whose kernel reads each row's latents where they lie."""

    def decode_absorbed(self, kv_BTC: torch.Tensor, q_latent_BTHC: torch.Tensor, q_slice_BTHR: torch.Tensor,
                        scale: float) -> torch.Tensor:
        """Store the new latents kv_BTC [B, 1, C + R], then return softmax(q . k * scale) . latent over every
        token each row may see: [B, 1, H, C] in q's dtype."""


@dataclass(slots=True)
class MLAState:
    """A contiguous per-layer latent cache; ``append`` returns every cached latent so far."""

    kv_BSC: torch.Tensor
    length: int = 0

    def append(self, kv_BTC: torch.Tensor) -> torch.Tensor:
        end = self.length + kv_BTC.shape[1]
        if end > self.kv_BSC.shape[1]:
            raise ValueError(f"MLA cache overflow: {end} tokens exceed its capacity {self.kv_BSC.shape[1]}")
        self.kv_BSC[:, self.length:end] = kv_BTC.to(self.kv_BSC.dtype)
        self.length = end
        return self.kv_BSC[:, :end]

    def attend(self, kv_BTC: torch.Tensor) -> tuple[torch.Tensor, CausalBias | None]:
        """Append, then return (all latents [B, S, C], ``offset_causal`` or None for plain causal): every row
        shares one length here, so the mask only shifts causality by the offset."""
        offset = self.length
        kv_BSC = self.append(kv_BTC)
        return kv_BSC, None if offset == 0 else offset_causal(kv_BTC.shape[1], kv_BSC.shape[1])


@dataclass(slots=True)
class KDAState:
    """Per-layer KDA state of B sequences: the conv inputs [B, 3·H·K, W-1] and the fp32 recurrent state
    [B, H, K, V], each held one of two ways:

    - owned: ``conv_BCW`` / ``recurrent_BHKV``, replaced (not mutated) by each forward;
    - pooled (the serving engine's, ``kimik3.serve.paged_cache.StatePool``): sequence b's state is row
      ``slots_B[b]`` of ``conv_pool_PCW`` [P, C, W-1] / ``pool_PHKV`` [P, H, K, V], which each forward updates in
      place (one-token steps read and write each state once, through ``short_conv_step`` and
      ``kimik3.ops.kda.kda_decode``).

    Outside a verification (below: pooled states only), a KDA layer reads and writes its state only through
    ``conv_inputs``/``set_conv``/``conv_step_in_place`` and ``recurrent``/``set_recurrent``/``advance_in_place``,
    so it never needs to know which way it is held.

    ``valid_B`` (optional, a device tensor [B]): how many of a multi-token forward's tokens are real in each row;
    the rest pad the chunk to a fixed size (the serving engine's prefill graphs), and the layer leaves the state
    as the real tokens leave it.

    ``steps_TBHKV`` / ``steps_conv_TBCW`` (optional, pooled states only): a verification forward of speculative
    decoding. The layer then reads the pools and ``slots_B`` directly, writes each row's state after every token t
    there ([T, B, ...]) and leaves the pool as it was, so that the engine can keep the state after the last
    accepted token and drop the rejected ones (``kimik3.serve.paged_cache.StatePool.commit_steps``).
    """

    conv_BCW: torch.Tensor | None
    recurrent_BHKV: torch.Tensor | None
    pool_PHKV: torch.Tensor | None = None
    slots_B: torch.Tensor | None = None
    conv_pool_PCW: torch.Tensor | None = None
    valid_B: torch.Tensor | None = None
    steps_TBHKV: torch.Tensor | None = None
    steps_conv_TBCW: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.recurrent_BHKV is None) == (self.pool_PHKV is None):
            raise ValueError("a KDAState holds its recurrent state either owned (recurrent_BHKV) or pooled "
                             "(pool_PHKV with slots_B): give exactly one")
        if (self.conv_BCW is None) == (self.conv_pool_PCW is None):
            raise ValueError("a KDAState holds its conv inputs either owned (conv_BCW) or pooled "
                             "(conv_pool_PCW with slots_B): give exactly one")
        pooled = self.pool_PHKV is not None or self.conv_pool_PCW is not None
        if pooled and (self.slots_B is None or self.slots_B.ndim != 1):
            raise ValueError("a pooled KDAState needs slots_B, a 1-D tensor of its sequences' pool rows")
        if (self.steps_TBHKV is None) != (self.steps_conv_TBCW is None):
            raise ValueError("a KDAState records its per-token steps in both steps_TBHKV and steps_conv_TBCW, or in "
                             "neither")
        if self.steps_TBHKV is not None and (self.pool_PHKV is None or self.conv_pool_PCW is None):
            raise ValueError("per-token steps are recorded for pooled states only")

    @property
    def stepwise(self) -> bool:
        """A verification forward: the state after each token is recorded, the pool is not written."""
        return self.steps_TBHKV is not None

    def conv_inputs(self) -> torch.Tensor:
        """The conv inputs [B, C, W-1] before this forward (gathered from the pool when pooled)."""
        return self.conv_BCW if self.conv_pool_PCW is None else self.conv_pool_PCW[self.slots_B]

    def set_conv(self, conv_BCW: torch.Tensor) -> None:
        """Store the conv inputs after this forward (in the held dtype): replace, or write the pool rows."""
        if self.conv_pool_PCW is None:
            self.conv_BCW = conv_BCW.to(self.conv_BCW.dtype)
        else:
            self.conv_pool_PCW[self.slots_B] = conv_BCW.to(self.conv_pool_PCW.dtype)

    def conv_step_in_place(self, step: Callable[[torch.Tensor, torch.Tensor], StepResult]) -> StepResult:
        """``step(pool_PCW, rows_B)`` updates rows ``rows_B`` of a contiguous conv-input pool in place (as
        ``kimik3.model.conv.short_conv_step`` does): the pool itself when pooled, else a copy of the owned
        inputs, which then replaces them."""
        if self.conv_pool_PCW is not None:
            return step(self.conv_pool_PCW, self.slots_B)
        conv_BCW = self.conv_BCW.clone(memory_format=torch.contiguous_format)
        result = step(conv_BCW, torch.arange(conv_BCW.shape[0], device=conv_BCW.device))
        self.conv_BCW = conv_BCW
        return result

    def recurrent(self) -> torch.Tensor:
        """The recurrent states [B, H, K, V] before this forward (gathered from the pool when pooled)."""
        return self.recurrent_BHKV if self.pool_PHKV is None else self.pool_PHKV[self.slots_B]

    def set_recurrent(self, final_BHKV: torch.Tensor) -> None:
        """Store the states after this forward: replace the owned tensor, or write the pool rows."""
        if self.pool_PHKV is None:
            self.recurrent_BHKV = final_BHKV
        else:
            self.pool_PHKV[self.slots_B] = final_BHKV

    def advance_in_place(self, step: Callable[[torch.Tensor, torch.Tensor], StepResult]) -> StepResult:
        """Advance the recurrent states by one in-place update and return what ``step`` returns.

        ``step(states_PHKV, rows_B)`` must update rows ``rows_B`` of the fp32, contiguous ``states_PHKV`` in
        place, as ``kimik3.ops.kda.kda_decode`` does. A pooled state hands over its pool, so its rows move where
        they lie (nothing copied in or out); an owned state hands over a copy of its states, which then replaces
        them (the tensor it held before is never written)."""
        if self.pool_PHKV is not None:
            return step(self.pool_PHKV, self.slots_B)
        states_BHKV = self.recurrent_BHKV.to(torch.float32, copy=True).contiguous()
        result = step(states_BHKV, torch.arange(states_BHKV.shape[0], device=states_BHKV.device))
        self.recurrent_BHKV = states_BHKV
        return result


@dataclass(slots=True)
class K3Cache:
    """One state per layer (``MLAState`` or ``KDAState``), plus one for the MTP block if any."""

    layers: list[LatentCache | KDAState]
    seq_len: int = 0
    extra: dict[str, object] = field(default_factory=dict)

    @classmethod
    def allocate(cls, config: K3Config, batch_size: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> K3Cache:
        """Zeroed states for ``batch_size`` sequences of up to ``max_len`` tokens."""
        if max_len > config.max_seq_len:
            raise ValueError(f"max_len={max_len} exceeds the model's max_seq_len={config.max_seq_len}")
        heads, head_dim = config.kda.num_heads, config.kda_head_dim
        layers: list[MLAState | KDAState] = []
        for spec in config.layer_plan():
            if spec.mixer == "mla":
                layers.append(MLAState(torch.zeros(batch_size, max_len, config.mla.cache_width,
                                                   device=device, dtype=dtype)))
            else:
                layers.append(KDAState(
                    conv_BCW=torch.zeros(batch_size, 3 * heads * head_dim, config.kda.conv_kernel - 1,
                                         device=device, dtype=dtype),
                    recurrent_BHKV=torch.zeros(batch_size, heads, head_dim, head_dim,
                                               device=device, dtype=torch.float32),
                ))
        return cls(layers=layers)

    def nbytes(self) -> int:
        total = 0
        for state in self.layers:
            if isinstance(state, MLAState):
                tensors = (state.kv_BSC,)
            else:   # a pooled state's rows belong to its pool, not to this cache
                tensors = tuple(t for t in (state.conv_BCW, state.recurrent_BHKV) if t is not None)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total
