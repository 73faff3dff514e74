"""All weight initialisation in one place (the model is built on the meta device, then filled here).

Rules (following the released recipe as read in torchtitan's K3 port):
- every Linear and every stacked expert matrix: truncated normal, std ``config.init_std`` (0.02);
- KDA short-conv kernels: truncated normal, std 0.02;
- token embedding: normal, std 1.0; output head: truncated normal, std dim^-0.5, cut at 3 std;
- RMSNorm weights (block, latent, MLA, KDA output, AttnRes key norms): ones;
- AttnRes pseudo-queries: zeros (every mix starts as the plain mean of its entries);
- KDA: A_log = log U(1, 16), dt_bias = 0;
- router expert bias (a buffer): zeros.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kimik3.config.schema import K3Config
from kimik3.model.attnres import AttnResMix
from kimik3.model.kda import KDA
from kimik3.model.moe import RoutedExperts, Router
from kimik3.model.norm import RMSNorm


@torch.no_grad()
def init_weights(model: nn.Module, config: K3Config, generator: torch.Generator | None = None) -> None:
    """Initialise every parameter and buffer of a K3 model in place; asserts none is missed."""
    std = config.init_std
    done: set[int] = set()

    def trunc(t: torch.Tensor, s: float) -> None:
        nn.init.trunc_normal_(t, std=s, a=-3 * s, b=3 * s, generator=generator)
        done.add(id(t))

    def fill(t: torch.Tensor, value: float) -> None:
        t.fill_(value)
        done.add(id(t))

    head = getattr(model, "lm_head", None)
    embed = getattr(model, "embed", None)
    for module in model.modules():
        if module is head:
            trunc(module.weight, config.dim ** -0.5)
        elif module is embed:
            nn.init.normal_(module.weight, std=1.0, generator=generator)
            done.add(id(module.weight))
        elif isinstance(module, nn.Linear):
            trunc(module.weight, std)
        elif isinstance(module, RMSNorm):
            fill(module.weight, 1.0)
        elif isinstance(module, AttnResMix):
            fill(module.key_norm_weight, 1.0)
            fill(module.query, 0.0)
        elif isinstance(module, RoutedExperts):
            for w in (module.w_gate_ELF, module.w_up_ELF, module.w_down_EFL):
                trunc(w, std)
        elif isinstance(module, Router):
            fill(module.expert_bias, 0.0)
        elif isinstance(module, KDA):
            for w in (module.q_conv, module.k_conv, module.v_conv):
                trunc(w, std)
            module.A_log.uniform_(1.0, 16.0, generator=generator).log_()
            done.add(id(module.A_log))
            fill(module.dt_bias, 0.0)
            fill(module.output_norm_weight, 1.0)

    missed = [name for name, p in model.named_parameters() if id(p) not in done]
    if missed:
        raise AssertionError(f"init_weights left parameters uninitialised: {missed[:5]}")
    if not math.isfinite(sum(float(p.float().abs().sum()) for p in model.parameters())):
        raise AssertionError("init_weights produced non-finite values")
