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
forward, two backward); elsewhere ``attnres_mix_torch``, torch ops with a hand-written backward (``glue_backend``
chooses). ``attnres_mix_reference``, the formula in plain autograd, is the reference of both (tests). A block reads
every mix through an RMSNorm: ``mixed_and_normed`` runs the pair as one kernel where nothing needs a gradient
(serving, evaluation).
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.norm import RMSNorm
from kimik3.ops.glue import attnres_mix, attnres_mix_norm, glue_backend
from kimik3.ops.glue.common import compute_f64
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
        return attnres_mix_torch(entries, self.key_norm_weight, self.query, self.eps)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, as released; fp64 when any input is fp64 (gradient checks)."""
    return torch.float64 if compute_f64(*tensors) else torch.float32


def attnres_mix_reference(entries: list[torch.Tensor], key_norm_weight: torch.Tensor, query: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """The mix as the formula reads, through autograd: the reference of ``attnres_mix_torch`` and of the Triton
    kernels (tests). Entry by entry, no [B, T, N, D] stack: score_n = rsqrt(mean(v_n²) + eps) · (v_n · w⊙q) is
    keys_n · w⊙q with the norm's scalar taken out of the dot product; the mixture is N scaled adds."""
    ct = _compute_dtype(key_norm_weight, query, *entries)
    with no_autocast(entries[-1].device):
        wq_D = key_norm_weight.to(ct) * query.to(ct)
        values = [entry.to(ct) for entry in entries]
        scores_BTN = torch.stack([(v_BTD @ wq_D) * torch.rsqrt(v_BTD.square().mean(-1) + eps)
                                  for v_BTD in values], dim=-1)
        probs_BTN = torch.softmax(scores_BTN, dim=-1)
        mixed_BTD = values[0] * probs_BTN[..., 0:1]
        for n in range(1, len(values)):
            mixed_BTD = mixed_BTD + values[n] * probs_BTN[..., n:n + 1]
    return mixed_BTD.to(entries[-1].dtype)


def attnres_mix_torch(entries: list[torch.Tensor], key_norm_weight: torch.Tensor, query: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """``attnres_mix_reference``'s values and gradients (fp32, fp64 when an input is fp64; the output in the last
    entry's dtype), differentiable through a hand-written backward: autograd through the formula keeps and walks
    about ten full-size intermediates an entry; this saves the entries and [..., N] statistics, reads each entry
    three times forward (its dot with w⊙q, its norm, its share of the mixture) and writes its grad in three passes:

        dp_n = g · v_n,   ds_n = p_n (dp_n - Σ_m p_m dp_m),   dv_n = p_n g + (ds_n r_n) w - (ds_n a_n r_n³ / D) v_n,
        dw = Σ_rows,n ds_n r_n v_n,   d key_norm_weight = dw ⊙ query,   d query = dw ⊙ key_norm_weight,

    with a_n = v_n · w and r_n = rsqrt(mean(v_n²) + eps) (the kernel's backward, ``kimik3.ops.glue.attnres``)."""
    return _AttnResMixTorch.apply(key_norm_weight, query, float(eps), *entries)


class _AttnResMixTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key_norm_weight, query, eps, *entries):
        with no_autocast(entries[-1].device):   # the whole mix in fp32, as released
            return _AttnResMixTorch._forward(ctx, key_norm_weight, query, eps, entries)

    @staticmethod
    def _forward(ctx, key_norm_weight, query, eps, entries):
        ct = _compute_dtype(key_norm_weight, query, *entries)
        D = entries[-1].shape[-1]
        wq_D = key_norm_weight.to(ct) * query.to(ct)
        values = [entry.to(ct).reshape(-1, D) for entry in entries]
        a_RN = torch.stack([v_RD @ wq_D for v_RD in values], dim=-1)
        r_RN = torch.stack([torch.linalg.vector_norm(v_RD, dim=-1) for v_RD in values], dim=-1)
        r_RN = r_RN.square_().div_(D).add_(eps).rsqrt_()
        p_RN = torch.softmax(a_RN * r_RN, dim=-1)
        mixed_RD = values[0] * p_RN[:, 0:1]
        for n in range(1, len(values)):
            mixed_RD.addcmul_(values[n], p_RN[:, n:n + 1])
        ctx.save_for_backward(key_norm_weight, query, a_RN, r_RN, p_RN, *entries)
        return mixed_RD.reshape(entries[-1].shape).to(entries[-1].dtype)

    @staticmethod
    def backward(ctx, grad_out):
        with no_autocast(grad_out.device):
            return _AttnResMixTorch._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        key_norm_weight, query, a_RN, r_RN, p_RN, *entries = ctx.saved_tensors
        ct, D = a_RN.dtype, grad_out.shape[-1]
        g_RD = grad_out.to(ct).reshape(-1, D)
        values = [entry.to(ct).reshape(-1, D) for entry in entries]
        dp_RN = torch.stack([torch.linalg.vecdot(g_RD, v_RD) for v_RD in values], dim=-1)
        ds_RN = p_RN * (dp_RN - (p_RN * dp_RN).sum(-1, keepdim=True))
        dsr_RN = ds_RN * r_RN                      # dL/d(v_n · w) per row
        grads = []
        wq_D = key_norm_weight.to(ct) * query.to(ct)
        for n, (entry, v_RD) in enumerate(zip(entries, values)):
            if not ctx.needs_input_grad[3 + n]:
                grads.append(None)
                continue
            dv_RD = g_RD * p_RN[:, n:n + 1]
            dv_RD.addr_(dsr_RN[:, n], wq_D)
            dv_RD.addcmul_(v_RD, (dsr_RN[:, n] * a_RN[:, n] * r_RN[:, n].square() / D)[:, None], value=-1)
            grads.append(dv_RD.reshape(entry.shape).to(entry.dtype))
        grad_knw = grad_query = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dw_D = sum(v_RD.t() @ dsr_RN[:, n] for n, v_RD in enumerate(values))
            if ctx.needs_input_grad[0]:
                grad_knw = (dw_D * query.to(ct)).to(key_norm_weight.dtype)
            if ctx.needs_input_grad[1]:
                grad_query = (dw_D * key_norm_weight.to(ct)).to(query.dtype)
        return grad_knw, grad_query, None, *grads


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
