"""The projector from the vision tower into the language model: pixel shuffle, then an MLP.

Legend: T = packed patches, M·M·D = merged features, E = language model width, I = image tokens.
[T, D] -> pixel shuffle per image ([I, M·M·D]) -> Linear(M·M·D -> M·M·D) -> GELU -> Linear(-> E) -> RMSNorm
-> [I, E], one row per image placeholder of the prompt (``K3VLForCausalLM``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.norm import RMSNorm
from kimik3.model.vision.config import VisionConfig
from kimik3.model.vision.merge import pixel_shuffle_packed


class VisionProjector(nn.Module):
    def __init__(self, config: VisionConfig, text_dim: int):
        super().__init__()
        self.merge = config.merge_size
        self.fc1 = nn.Linear(config.merged_dim, config.merged_dim, bias=False)
        self.fc2 = nn.Linear(config.merged_dim, text_dim, bias=False)
        self.post_norm = RMSNorm(text_dim, config.norm_eps)

    def forward(self, x_TD: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        merged = pixel_shuffle_packed(x_TD, grid_hw, self.merge)
        return self.post_norm(self.fc2(F.gelu(self.fc1(merged))))
