"""A plain dense GPT (PreNorm, RoPE softmax attention, SwiGLU), the peer for K3's training benchmarks.

It is sized by ``dense_baseline_for(k3_config)`` to the same *active* parameter count as the K3
config (same vocabulary and width; the layer count is chosen to match), so tokens/s and loss
compare architectures at equal compute per token. It shares the K3 model's forward contract:
``model(input_ids, labels=None) -> K3Output``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.config.params import param_counts
from kimik3.config.schema import K3Config
from kimik3.model.k3 import IGNORE_INDEX, K3Output
from kimik3.model.norm import RMSNorm
from kimik3.ops.loss import linear_cross_entropy


@dataclass(slots=True)
class DenseConfig:
    name: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    ffn_hidden: int
    max_seq_len: int
    norm_eps: float = 1e-5
    init_std: float = 0.02
    rope_theta: float = 10000.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    def active_params(self) -> int:
        layer = 4 * self.dim * self.dim + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        return self.num_layers * layer + self.dim + self.dim * self.vocab_size  # + final norm + head


def dense_baseline_for(config: K3Config) -> DenseConfig:
    """The dense GPT whose active parameter count is closest to ``config``'s."""
    target = param_counts(config)["active"]
    base = DenseConfig(name=f"dense-{config.name}", vocab_size=config.vocab_size, dim=config.dim, num_layers=1,
                       num_heads=config.kda.num_heads, ffn_hidden=config.dense_hidden,
                       max_seq_len=config.max_seq_len, norm_eps=config.norm_eps, init_std=config.init_std)
    best = min(range(1, 4 * config.num_layers + 1),
               key=lambda n: abs(dataclasses.replace(base, num_layers=n).active_params() - target))
    return dataclasses.replace(base, num_layers=best)


def rope(x_BHTK: torch.Tensor, theta: float) -> torch.Tensor:
    half = x_BHTK.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x_BHTK.device, dtype=torch.float32) / half)
    angles = torch.arange(x_BHTK.shape[2], device=x_BHTK.device, dtype=torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x_BHTK.dtype), angles.sin().to(x_BHTK.dtype)
    x1, x2 = x_BHTK[..., :half], x_BHTK[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DenseBlock(nn.Module):
    def __init__(self, c: DenseConfig):
        super().__init__()
        self.heads, self.theta = c.num_heads, c.rope_theta
        self.attn_norm, self.ffn_norm = RMSNorm(c.dim, c.norm_eps), RMSNorm(c.dim, c.norm_eps)
        self.wqkv = nn.Linear(c.dim, 3 * c.dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.w_gate = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w_up = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w_down = nn.Linear(c.ffn_hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(rope(q, self.theta), rope(k, self.theta), v, is_causal=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(batch, length, dim))
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class DenseGPT(nn.Module):
    def __init__(self, config: DenseConfig, *, device: torch.device | str = "cpu", seed: int | None = None):
        super().__init__()
        self.config = config
        with torch.device(device):
            self.embed = nn.Embedding(config.vocab_size, config.dim)
            self.layers = nn.ModuleList(DenseBlock(config) for _ in range(config.num_layers))
            self.norm = RMSNorm(config.dim, config.norm_eps)
            self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    std = config.dim ** -0.5 if module is self.lm_head else config.init_std
                    nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std, generator=generator)
                elif isinstance(module, RMSNorm):
                    nn.init.ones_(module.weight)
            nn.init.normal_(self.embed.weight, std=1.0, generator=generator)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> K3Output:
        """input_ids [B, T] -> logits [B, T, V]; with labels [B, T] (shifted, -100 ignored) the loss instead and
        ``logits`` None (the head and the cross-entropy fused over token chunks, as ``K3ForCausalLM``)."""
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}")
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        out = K3Output(hidden=x)
        if labels is None:
            out.logits = self.lm_head(self.norm(x))
        else:
            out.loss = out.main_loss = linear_cross_entropy(self.norm(x), self.lm_head.weight, labels,
                                                            ignore_index=IGNORE_INDEX)
        return out
