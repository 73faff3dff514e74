"""Multi-token prediction (DeepSeek-V3 style; K3 pre-trains with one MTP layer, notes §8).

At position t the module combines the main model's final hidden state h_t with the embedding of
the next token x_{t+1} and predicts x_{t+2}:

    h'_t = Block(proj([RMSNorm(h_t); RMSNorm(emb(x_{t+1}))]))   logits = head(RMSNorm(h'_t))

The embedding and output head are the main model's; the norms, the 2D -> D projection and the
block (Gated MLA + LatentMoE, plain PreNorm residuals) are its own. It stays causal: h_t and
x_{t+1} are both known when predicting x_{t+2}. It seeds the speculative draft (``kimik3.model.draft``), which
feeds its own block output back as the next step's h.
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.config.schema import K3Config, LayerSpec
from kimik3.model.cache import LatentCache
from kimik3.model.block import K3Block
from kimik3.model.norm import RMSNorm


class MTPModule(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)
        self.embed_norm = RMSNorm(config.dim, config.norm_eps)
        self.proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        spec = LayerSpec(index=config.num_layers, mixer="mla", ffn="moe", attn_res_block=0, opens_block=False)
        self.block = K3Block(config, spec, attn_res=False)
        self.out_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, hidden_BTD: torch.Tensor, next_embed_BTD: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the normalised hidden state [B, T, D] to feed the shared head."""
        return self.step(hidden_BTD, next_embed_BTD, cu_seqlens=cu_seqlens)[1]

    def step(self, hidden_BTD: torch.Tensor, next_embed_BTD: torch.Tensor, state: LatentCache | None = None,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output [B, T, D], its normalised form for the head); ``state``: the block's MLA cache."""
        x = self.proj(torch.cat([self.hidden_norm(hidden_BTD), self.embed_norm(next_embed_BTD)], dim=-1))
        x, _ = self.block(x, [], state, cu_seqlens)
        return x, self.out_norm(x)
