"""Gated Multi-head Latent Attention with NoPE (notes §2; numerics as released, DESIGN.md).

Legend: B = batch, T = new tokens, S = all attended tokens (cached + new), D = model width,
H = heads, N = qk_nope dim, R = the shared 'rope' slice (never rotated: NoPE), V = v head dim,
C = kv_lora_rank (the latent), Q = q_lora_rank.

q = wq_b(RMSNorm(wq_a(x))); wkv_a(x) = [latent, slice]; k_nope, v = wkv_b(RMSNorm(latent));
k = [k_nope, slice broadcast to every head]; softmax scale (N + R)^-0.5; causal attention;
output x sigmoid(gate(x)) channel-wise; wo. wq_a, wkv_a and the gate run as one matmul (``model/fused_linear.py``).
The cache holds [RMSNorm(latent), slice]: C + R values per token (576 in K3).

Two equivalent paths:
- ``naive``: expand the latents of all S tokens into per-head keys and values (cheap when T ~ S,
  i.e. prefill);
- ``absorbed``: fold wkv_b's key half into the query and its value half into the output, so
  attention runs directly on the C + R latent (cheap when T << S, i.e. decode).

A cache may run single-token decode itself: when it has ``decode_absorbed`` (``AbsorbedDecodeCache`` in
``model/cache.py``; the serving engine's paged latents do), the layer hands it the absorbed query and gets the
attended latents back. A cache may also own the seam of the cached attention (``eager_region``, called with
the function that stores and attends): the serving engine's runs it outside its piecewise CUDA graphs.

Context parallelism (``kimik3.parallel.kcp``) enters through one seam, ``GatedMLA.context_parallel``:
when set, it supplies the latents (and mask) that this rank's queries attend to.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias

from kimik3.config.schema import K3Config
from kimik3.model.cache import LatentCache, causal_mask
from kimik3.model.fused_linear import project
from kimik3.model.norm import RMSNorm
from kimik3.model.packing import sequence_ids
from kimik3.model.param_rules import ParamRule, muon


def packed_causal_mask(total: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Boolean [T, T] mask (True = may attend) for packed sequences; None means plain causal."""
    if cu_seqlens is None:
        return None
    position = torch.arange(total, device=device)
    seq = sequence_ids(cu_seqlens, total)
    return (position[None, :] <= position[:, None]) & (seq[:, None] == seq[None, :])


class MLAContextParallel(Protocol):
    """What an MLA layer asks when its sequences are split into contiguous segments over several ranks and
    it holds one segment (``kimik3.parallel.kcp`` implements it)."""

    def attend(self, kv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This segment's latents kv_BTC [B, T, C] -> (every latent its queries may see, [B, S, C] in
        kv's dtype; boolean mask [T, S], True = may attend, or None for plain causal over S = T), as
        ``LatentCache.attend`` returns them."""


class GatedMLA(nn.Module):
    """Gated MLA token mixer: [B, T, D] -> [B, T, D], optionally attending through a latent cache
    (``MLAState`` or the serving engine's paged view).

    ``context_parallel``: None (the default) when the layer sees whole sequences; an
    ``MLAContextParallel`` when it holds one segment of each (then it takes no cache and no ``cu_seqlens``).
    """

    context_parallel: MLAContextParallel | None = None

    def __init__(self, config: K3Config):
        super().__init__()
        m = config.mla
        self.num_heads = m.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        self.scale = m.qk_head_dim ** -0.5
        d = config.dim
        self.wq_a = nn.Linear(d, m.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(m.q_lora_rank, config.norm_eps)
        self.wq_b = nn.Linear(m.q_lora_rank, m.num_heads * m.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(m.kv_lora_rank, config.norm_eps)
        self.wkv_b = nn.Linear(m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.gate = nn.Linear(d, m.num_heads * m.v_head_dim, bias=False)
        self.wo = nn.Linear(m.num_heads * m.v_head_dim, d, bias=False)

    @property
    def _inputs(self) -> list[nn.Linear]:
        """The projections of the layer's input, run as one matmul (``kimik3.model.fused_linear``)."""
        return [self.wq_a, self.wkv_a, self.gate]

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [self._inputs]

    def latents(self, kv_a_BTX: torch.Tensor) -> torch.Tensor:
        """What the cache stores for these tokens, from their wkv_a projection: [RMSNorm(latent), slice],
        [B, T, C + R]."""
        latent, k_slice = kv_a_BTX.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_norm(latent), k_slice], dim=-1)

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        """Per-head Muon on the head-major projections, whole-matrix Muon into the latents."""
        rows, cols = ("rows", self.num_heads), ("cols", self.num_heads)
        return [
            # wkv_b's head block holds that head's k_nope rows and its v rows together.
            *((f"{proj}.weight", muon(rows, f"GatedMLA.{proj}")) for proj in ("wq_b", "wkv_b", "gate")),
            ("wo.weight", muon(cols, "GatedMLA.wo")),
            ("wq_a.weight", muon(("whole",), "GatedMLA.wq_a")),    # into the shared latents
            ("wkv_a.weight", muon(("whole",), "GatedMLA.wkv_a")),
        ]

    def forward(self, x_BTD: torch.Tensor, state: LatentCache | None = None,
                cu_seqlens: torch.Tensor | None = None, absorbed: bool | None = None) -> torch.Tensor:
        """``absorbed=None`` picks the absorbed path for single-token decode, naive otherwise."""
        length = x_BTD.shape[1]
        split = self.context_parallel
        if split is not None and (state is not None or cu_seqlens is not None):
            raise ValueError("MLA: a context-parallel layer runs one segment of unpacked sequences: it takes "
                             "neither a cache nor packed cu_seqlens")
        q_a_BTQ, kv_a_BTX, gate_BTX = project(x_BTD, self._inputs)
        q_BTHK = self.wq_b(self.q_norm(q_a_BTQ)).unflatten(-1, (self.num_heads, -1))
        kv_BTC = self.latents(kv_a_BTX)
        # The fused path takes one token per row, or several where the cache says it can (a speculative
        # verification: each token attends to the row's cache and the tokens before it).
        several = getattr(state, "multi_token", False)
        fused = getattr(state, "decode_absorbed", None) if (length == 1 or several) and absorbed is not False else None
        if fused is not None:
            # The cache runs the absorbed attention itself, in place over its own layout (the serving engine's
            # paged latents: one kernel, no gather and nothing shaped by the host).
            q_latent_BTHC, q_slice_BTHR = self._absorb_query(q_BTHK)
            out_BTHV = self._absorb_output(fused(kv_BTC, q_latent_BTHC, q_slice_BTHR, self.scale))
            return self.wo(out_BTHV.flatten(-2) * torch.sigmoid(gate_BTX))
        if state is not None:
            if cu_seqlens is not None:
                raise ValueError("MLA: packed cu_seqlens cannot be combined with a cache")
            # A cache may run this step through a seam of its own (the serving engine's paged latents: their
            # attention is shaped by the cached length, which piecewise CUDA graphs leave outside the graphs).
            region = getattr(state, "eager_region", None)
            out_BTHV = (region(self._attend_cache, q_BTHK, kv_BTC, state, absorbed) if region is not None
                        else self._attend_cache(q_BTHK, kv_BTC, state, absorbed))
        else:
            if split is not None:
                kv_BSC, mask = split.attend(kv_BTC)   # the latents of this and the earlier segments, mask [T, S]
            else:
                kv_BSC = kv_BTC
                mask = packed_causal_mask(length, cu_seqlens, x_BTD.device)
            out_BTHV = (self._absorbed if absorbed else self._naive)(q_BTHK, kv_BSC, mask)
        out_BTX = out_BTHV.flatten(-2) * torch.sigmoid(gate_BTX)
        return self.wo(out_BTX)

    def _attend_cache(self, q_BTHK: torch.Tensor, kv_BTC: torch.Tensor, state: LatentCache,
                      absorbed: bool | None) -> torch.Tensor:
        """Store the new latents in ``state`` and attend over everything it holds: [B, T, H, V]."""
        kv_BSC, mask = state.attend(kv_BTC)   # mask [T, S], per-row [B, 1, T, S] or offset causal
        if absorbed is None:
            absorbed = q_BTHK.shape[1] == 1
        return (self._absorbed if absorbed else self._naive)(q_BTHK, kv_BSC.to(q_BTHK.dtype), mask)

    def _naive(self, q_BTHK: torch.Tensor, kv_BSC: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        latent_BSC, k_slice_BSR = kv_BSC.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_BSHX = self.wkv_b(latent_BSC).unflatten(-1, (self.num_heads, -1))
        k_nope_BSHN, v_BSHV = kv_BSHX.split([self.nope_dim, self.v_dim], dim=-1)
        k_BSHK = torch.cat([k_nope_BSHN, k_slice_BSR[:, :, None].expand(-1, -1, self.num_heads, -1)], dim=-1)
        pad = k_BSHK.shape[-1] - self.v_dim if not q_BTHK.is_cuda else 0
        if pad > 0:
            # The CPU's flash kernel wants values as wide as the keys (with narrower ones SDPA falls back to its
            # math path, ~3x slower forward + backward): zero columns, dropped from the output.
            v_BSHV = F.pad(v_BSHV, (0, pad))
        out = F.scaled_dot_product_attention(
            q_BTHK.transpose(1, 2), k_BSHK.transpose(1, 2), v_BSHV.transpose(1, 2),
            attn_mask=mask, is_causal=mask is None and q_BTHK.shape[1] > 1, scale=self.scale)
        return out.transpose(1, 2)[..., :self.v_dim]

    def _absorb_query(self, q_BTHK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold wkv_b's key half into the query: (q_latent [B, T, H, C], q_slice [B, T, H, R])."""
        w_uk_HNC = self.wkv_b.weight.unflatten(0, (self.num_heads, -1))[:, :self.nope_dim]
        q_nope_BTHN, q_slice_BTHR = q_BTHK.split([self.nope_dim, self.rope_dim], dim=-1)
        return torch.einsum("bthn,hnc->bthc", q_nope_BTHN, w_uk_HNC), q_slice_BTHR

    def _absorb_output(self, out_latent_BTHC: torch.Tensor) -> torch.Tensor:
        """Apply wkv_b's value half to the attended latents: [B, T, H, C] -> [B, T, H, V]."""
        w_uv_HVC = self.wkv_b.weight.unflatten(0, (self.num_heads, -1))[:, self.nope_dim:]
        return torch.einsum("bthc,hvc->bthv", out_latent_BTHC, w_uv_HVC)

    def _absorbed(self, q_BTHK: torch.Tensor, kv_BSC: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        latent_BSC, k_slice_BSR = kv_BSC.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_latent_BTHC, q_slice_BTHR = self._absorb_query(q_BTHK)
        scores_BHTS = (torch.einsum("bthc,bsc->bhts", q_latent_BTHC, latent_BSC)
                       + torch.einsum("bthr,bsr->bhts", q_slice_BTHR, k_slice_BSR)).float() * self.scale
        if mask is None and q_BTHK.shape[1] > 1:
            length = q_BTHK.shape[1]
            mask = torch.ones(length, length, dtype=torch.bool, device=q_BTHK.device).tril()
        elif isinstance(mask, CausalBias):
            mask = causal_mask(mask, q_BTHK.device)
        if mask is not None:
            scores_BHTS = scores_BHTS.masked_fill(~mask, float("-inf"))
        probs_BHTS = torch.softmax(scores_BHTS, dim=-1).to(q_BTHK.dtype)
        return self._absorb_output(torch.einsum("bhts,bsc->bthc", probs_BHTS, latent_BSC))
