"""One K3 layer: a token mixer (KDA or Gated MLA) and an FFN (dense SiTU-GLU or LatentMoE),
joined either by Block AttnRes or, for ablations, by plain PreNorm residuals.

AttnRes bookkeeping per layer (DESIGN.md): ``prefix`` is the running sum of the current block.
  x = mix(entries + [prefix]) unless there are no entries yet (layer 0 mixes nothing)
  if the layer opens a block: entries.append(prefix)   (layer 0 appends the embedding)
  h = mixer(norm(x));  prefix = h if the block just opened else prefix + h
  return prefix + ffn(norm(mix(entries + [prefix])))
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.config.schema import K3Config, LayerSpec
from kimik3.model.attnres import AttnResMix, added_mixed_and_normed, mixed_and_normed
from kimik3.model.cache import KDAState, LatentCache
from kimik3.model.ffn import GLUFeedForward
from kimik3.model.kda import KDA
from kimik3.model.mla import GatedMLA
from kimik3.model.moe import LatentMoE
from kimik3.model.norm import RMSNorm


class K3Block(nn.Module):
    def __init__(self, config: K3Config, spec: LayerSpec, attn_res: bool):
        super().__init__()
        self.spec = spec
        self.attn_res = attn_res
        self.mixer: KDA | GatedMLA = KDA(config) if spec.mixer == "kda" else GatedMLA(config)
        self.ffn: GLUFeedForward | LatentMoE = (
            GLUFeedForward(config.dim, config.dense_hidden) if spec.ffn == "dense" else LatentMoE(config))
        self.mixer_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.mixer_mix = AttnResMix(config.dim, config.norm_eps) if attn_res and spec.index > 0 else None
        self.ffn_mix = AttnResMix(config.dim, config.norm_eps) if attn_res else None

    def forward(self, stream: torch.Tensor, entries: list[torch.Tensor],
                state: KDAState | LatentCache | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """stream [B, T, D] -> (next stream, AttnRes entries); entries stay [] without AttnRes."""
        if not self.attn_res:
            stream = stream + self.mixer(self.mixer_norm(stream), state, cu_seqlens)
            return stream + self.ffn(self.ffn_norm(stream)), entries

        prefix = stream
        if entries:
            x = mixed_and_normed(self.mixer_mix, self.mixer_norm, entries + [prefix])
        else:
            x = self.mixer_norm(prefix)
        if self.spec.opens_block:
            entries = entries + [prefix]
        h = self.mixer(x, state, cu_seqlens)
        if self.spec.opens_block:
            prefix = h
            x = mixed_and_normed(self.ffn_mix, self.ffn_norm, entries + [prefix])
        else:
            x, prefix = added_mixed_and_normed(self.ffn_mix, self.ffn_norm, entries, prefix, h)
        h = self.ffn(x)
        return prefix + h, entries
