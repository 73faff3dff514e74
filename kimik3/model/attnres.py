"""Block Attention Residuals (notes §3; numerics as released, DESIGN.md).

Legend: B = batch, T = tokens, N = residual entries, D = model width.

Instead of one running sum, the stream is kept as AttnRes *entries*: the embedding, one summary per
completed block of ``block_size`` layers, and the running partial sum of the current block. Before
each mixer and each FFN a learned pseudo-query picks a softmax mixture of the entries:

    keys = RMSNorm(values) (fp32, no weight)    score_n = keys_n · (norm_weight ⊙ query)
    p = softmax(score) over n                   output = Σ_n p_n · values_n

The norm weight folds into the query, so the pair costs 2·D parameters. Queries start at zero, so
at initialisation every mix is the plain mean of the entries; since each mix is followed by an
RMSNorm, the model then behaves as the plain PreNorm residual model with the same weights (up to
the norms' eps): ``tests/model/test_attnres.py`` checks this.

On CUDA the mix runs as one fused Triton kernel (``kimik3.ops.glue.attnres``: same fp32 math, no stack, one launch
forward, two backward); the torch code below is its reference and the CPU path (``glue_backend`` chooses). A
block reads every mix through an RMSNorm: ``mixed_and_normed`` runs the pair as one kernel where nothing needs a
gradient (serving, evaluation).
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.norm import RMSNorm
from kimik3.ops.glue import attnres_mix, attnres_mix_norm, glue_backend
from kimik3.ops.precision import no_autocast
from kimik3.model.param_rules import ParamRule, adamw


class AttnResMix(nn.Module):
    """Softmax mixture over residual entries with a zero-initialised pseudo-query."""

    backend = "auto"  # as ``glue_backend``: "auto" (Triton on CUDA), "triton" or "torch"; settable per instance

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.key_norm_weight = nn.Parameter(torch.empty(dim))
        self.query = nn.Parameter(torch.empty(dim))

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        # The pseudo-query starts at zero and encodes a preference, not capacity: no decay.
        return [("key_norm_weight", adamw(False, "AttnResMix.key_norm_weight")),
                ("query", adamw(False, "AttnResMix.query"))]

    def forward(self, entries: list[torch.Tensor]) -> torch.Tensor:
        """entries: N tensors [..., D] -> their mixture [..., D] in the entries' dtype."""
        if glue_backend(entries[-1], self.backend) == "triton":
            return attnres_mix(entries, self.key_norm_weight, self.query, self.eps)
        with no_autocast(entries[-1].device):  # the whole mix in fp32, as released
            # Entry by entry, no [B, T, N, D] stack: score_n = rsqrt(mean(v_n²) + eps) · (v_n · w⊙q) is keys_n · w⊙q
            # with the norm's scalar taken out of the dot product, and the mixture is N scaled adds (a batched
            # [1, N] @ [N, D] product runs as a loop of tiny matmuls on the CPU, several times slower).
            wq_D = self.key_norm_weight.float() * self.query.float()
            values = [entry.float() for entry in entries]
            scores_BTN = torch.stack([(v_BTD @ wq_D) * torch.rsqrt(v_BTD.square().mean(-1) + self.eps)
                                      for v_BTD in values], dim=-1)
            probs_BTN = torch.softmax(scores_BTN, dim=-1)
            mixed_BTD = values[0] * probs_BTN[..., 0:1]
            for n in range(1, len(values)):
                mixed_BTD = mixed_BTD + values[n] * probs_BTN[..., n:n + 1]
        return mixed_BTD.to(entries[-1].dtype)


def _one_kernel(mix: AttnResMix, norm: RMSNorm, tensors: list[torch.Tensor]) -> bool:
    """Whether ``attnres_mix_norm`` takes the mix and its norm: both modules would run their Triton kernels, nothing
    needs a gradient and torch.compile is not tracing (a decode step, an evaluation)."""
    last = tensors[-1]
    return (not torch.compiler.is_compiling()
            and glue_backend(last, mix.backend) == "triton" and glue_backend(last, norm.backend) == "triton"
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *mix.parameters(),
                                                                                 norm.weight))))


def mixed_and_normed(mix: AttnResMix, norm: RMSNorm, entries: list[torch.Tensor]) -> torch.Tensor:
    """``norm(mix(entries))``: in one kernel where ``_one_kernel`` says so (``attnres_mix_norm``: the same math and
    rounding, one launch instead of two); otherwise the two modules in turn."""
    if _one_kernel(mix, norm, entries):
        return attnres_mix_norm(entries, mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps)
    return norm(mix(entries))


def added_mixed_and_normed(mix: AttnResMix, norm: RMSNorm, entries: list[torch.Tensor], prefix: torch.Tensor,
                           h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``norm(mix(entries + [prefix + h]))``, ``prefix + h``): a block's running sum taking a sublayer's output,
    then the mix that reads it. In one kernel where ``_one_kernel`` says so and the two share shape and dtype (the
    add rounded as torch's); otherwise the add and ``mixed_and_normed``."""
    if prefix.shape == h.shape and prefix.dtype == h.dtype and _one_kernel(mix, norm, [*entries, h, prefix]):
        return attnres_mix_norm(entries + [prefix], mix.key_norm_weight, mix.query, mix.eps, norm.weight, norm.eps,
                                addend=h)
    total = prefix + h
    return mixed_and_normed(mix, norm, entries + [total]), total
