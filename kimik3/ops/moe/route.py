"""The MoE router's selection (``kimik3.model.moe.Router``) in one Triton kernel.

Given the fp32 router logits [T, E] (the fp32 GEMM stays outside) and the selection bias [E], per token row:

    s = sigmoid(logits); biased = s + bias
    ids = the K experts of largest biased score, best first (ties: the lower expert index first)
    weights = s[ids] / (sum(s[ids]) + 1e-20) * route_scale         (the unbiased scores, normalised)
    cutoff = the (K+1)-th biased score (-inf when K == E)
    counts[e] = how many rows chose e

One program holds a block of whole rows (the next power of two of E) in registers and takes the top-(K+1) by K+1
rounds of a row max (the lowest index among the maxima wins, and leaves the candidates); the loads are stored
whole when one program holds every row (a decode step's few tokens), else added into zeroed counts by integer
atomics, deterministic either way. Torch's unfused form is ~10 launches (sigmoid, add, topk, gather, sum, div,
mul, the cutoff's slice, a zero-fill and a scatter-add); here it is this kernel, after the counts' zero-fill when
there are several programs. A NaN biased score ranks above every number, as in ``torch.topk``.

On a GPU the sigmoid is ``1 / (1 + exp(-x))`` with libdevice's exp and a correctly rounded division, the formula
torch's CUDA sigmoid evaluates, so that the cutoffs sit on the scores ``torch.sigmoid`` gives. The interpreter
evaluates exp with numpy, whose fp32 exp is not torch's CPU one (they differ by an ulp on ~40% of inputs), so
there the scores agree with ``torch.sigmoid`` to an ulp or two, not bit for bit.

Backward (only the weights are differentiable, w.r.t. the logits), with s_j the chosen scores, S = sum_k s_k,
D = S + 1e-20, c = route_scale and g = dL/dweights:  dL/dlogit_j = s_j (1 - s_j) c (g_j / D - sum_k g_k s_k / D^2)
at a chosen j, 0 elsewhere. Plain torch ops on [T, K] and one scatter into [T, E]; the kernel hands back the chosen
scores for it.

Shapes decide everything at launch (no host sync). The torch reference, and the CPU path, is ``Router._select``;
``route_backend`` makes the choice.

Legend: T tokens (rows), E experts, K experts per token.
"""

from __future__ import annotations

import math

import torch

from kimik3.ops.glue.common import (_jit, blocks, check_triton_device, describe, glue_backend, interpreted,
                                    through_operator, on_device, tl,
                                    triton)

try:
    from triton.language.extra import libdevice
except ImportError:  # no triton: the kernel below is never launched
    libdevice = None

__all__ = ["MAX_EXPERTS", "route_backend", "sigmoid_topk", "sigmoid_topk_backward", "sigmoid_topk_forward"]

# A program keeps whole rows (next power of two of E) in registers, at most 8 values a thread at 16 warps.
# K3 has E = 896 (1024).
MAX_EXPERTS = 4096
_EPS = 1e-20  # Router's: keeps an all-zero row of chosen scores finite


def route_backend(x: torch.Tensor, backend: str = "auto") -> str:
    """"triton" or "torch" for the router's selection on logits ``x`` [T, E]: ``glue_backend``'s choice, with the
    kernel's bound of E <= MAX_EXPERTS (a whole row a program)."""
    return glue_backend(x, backend, max_width=MAX_EXPERTS)


def _check(logits_TE, bias_E, top_k, route_scale) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Validates the arguments; returns logits with unit stride along E, bias contiguous, route_scale a float."""
    if not isinstance(logits_TE, torch.Tensor) or logits_TE.ndim != 2:
        raise ValueError(f"logits_TE must be a 2-D tensor [T, E], got {describe(logits_TE)}")
    if logits_TE.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"logits_TE must be fp32 (the router's logits; fp64 is taken for gradcheck), "
                         f"got {logits_TE.dtype}")
    T, E = logits_TE.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"sigmoid_topk: the Triton kernel takes 1..{MAX_EXPERTS} experts (whole rows a program), "
                         f"got E = {E}")
    if not isinstance(bias_E, torch.Tensor) or bias_E.ndim != 1 or bias_E.shape[0] != E:
        raise ValueError(f"bias_E must be a 1-D tensor [E={E}], got {describe(bias_E)}")
    if not bias_E.is_floating_point():
        raise ValueError(f"bias_E must be a floating tensor, got {bias_E.dtype}")
    if bias_E.device != logits_TE.device:
        raise ValueError(f"bias_E is on {bias_E.device} but logits_TE on {logits_TE.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in 1..E={E}, got {top_k!r}")
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or not math.isfinite(route_scale):
        raise ValueError(f"route_scale must be a finite Python number (not a tensor: reading one is a host sync), "
                         f"got {route_scale!r}")
    check_triton_device(logits_TE, "sigmoid_topk")
    if logits_TE.stride(1) != 1 and E > 1:
        logits_TE = logits_TE.contiguous()
    return logits_TE, bias_E.contiguous(), float(route_scale)


def _select(logits_TE, bias_E, top_k, route_scale, want_scores: bool):
    """The launch: (weights_TK, ids_TK, cutoff_T, counts_E, scores_TK or None)."""
    logits_TE, bias_E, route_scale = _check(logits_TE, bias_E, top_k, route_scale)
    T, E = logits_TE.shape
    dev, dt = logits_TE.device, logits_TE.dtype
    weights_TK = torch.empty(T, top_k, dtype=dt, device=dev)
    ids_TK = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    cutoff_T = torch.empty(T, dtype=dt, device=dev)
    scores_TK = torch.empty(T, top_k, dtype=dt, device=dev) if want_scores else None
    if T == 0:
        return weights_TK, ids_TK, cutoff_T, torch.zeros(E, dtype=torch.int64, device=dev), scores_TK
    block_t, block_e, num_warps = blocks(T, E)
    programs = triton.cdiv(T, block_t)
    # One program (a decode step's few tokens) writes the whole counts; several add theirs into zeroed ones.
    counts_E = (torch.empty if programs == 1 else torch.zeros)(E, dtype=torch.int64, device=dev)
    with on_device(dev):
        _sigmoid_topk_kernel[(programs,)](
            logits_TE, bias_E, weights_TK, ids_TK, cutoff_T, counts_E,
            scores_TK if want_scores else weights_TK,
            T, E, logits_TE.stride(0), route_scale,
            K=top_k, CUTOFF=top_k < E, SCORES=want_scores, LIBDEVICE=not interpreted(),
            F64=dt == torch.float64, BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), ONE_PROGRAM=programs == 1, num_warps=num_warps,
        )
    return weights_TK, ids_TK, cutoff_T, counts_E, scores_TK


def sigmoid_topk_forward(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, route_scale: float):
    """The selection, no autograd: (weights_TK, ids_TK int64, cutoff_T, counts_E int64).

    logits_TE [T, E] fp32 (fp64 is taken too, computed in fp64: for gradcheck); bias_E [E] floating, on the same
    device; top_k in 1..E; route_scale a Python number (it enters the kernel as fp32, also for fp64 logits).
    weights and cutoff come in the logits' dtype, ids best first. One kernel launch (and the counts' zero-fill when
    the rows take several programs); no host sync.
    """
    weights_TK, ids_TK, cutoff_T, counts_E, _ = _select(logits_TE, bias_E, top_k, route_scale, want_scores=False)
    return weights_TK, ids_TK, cutoff_T, counts_E


def sigmoid_topk_backward(grad_TK: torch.Tensor, scores_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int,
                          route_scale: float) -> torch.Tensor:
    """dL/dlogits [T, E] from dL/dweights [T, K], the chosen experts' scores s [T, K] and their ids (distinct in
    a row): s (1 - s) c (g / D - sum(g s) / D^2) at the chosen ids, D = sum(s) + 1e-20, zero elsewhere."""
    s = scores_TK
    g = grad_TK.to(s.dtype)
    denom = s.sum(-1, keepdim=True) + _EPS
    dscore_TK = route_scale * (g / denom - (g * s).sum(-1, keepdim=True) / (denom * denom))
    dlogit_TK = dscore_TK * s * (1 - s)
    out = torch.zeros(s.shape[0], num_experts, dtype=s.dtype, device=s.device)
    return out.scatter_(1, ids_TK, dlogit_TK)


@torch.library.custom_op("kimik3::sigmoid_topk", mutates_args=())
def _sigmoid_topk_op(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int,
                     route_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights_TK, ids_TK, cutoff_T, counts_E, the chosen scores_TK the backward reads)."""
    return _select(logits_TE, bias_E, top_k, route_scale, want_scores=True)


@_sigmoid_topk_op.register_fake
def _(logits_TE, bias_E, top_k, route_scale):
    T, E = logits_TE.shape
    rows_k = logits_TE.new_empty((T, top_k))
    return (rows_k, logits_TE.new_empty((T, top_k), dtype=torch.int64), logits_TE.new_empty((T,)),
            logits_TE.new_empty((E,), dtype=torch.int64), torch.empty_like(rows_k))


def _setup_grads(ctx, inputs, output) -> None:
    logits_TE, _, _, route_scale = inputs
    _, ids_TK, cutoff_T, counts_E, scores_TK = output
    ctx.num_experts, ctx.route_scale = logits_TE.shape[1], float(route_scale)
    ctx.save_for_backward(scores_TK, ids_TK)
    ctx.mark_non_differentiable(ids_TK, cutoff_T, counts_E, scores_TK)


def _grads(ctx, grad_TK, _grad_ids, _grad_cutoff, _grad_counts, _grad_scores):
    scores_TK, ids_TK = ctx.saved_tensors
    return sigmoid_topk_backward(grad_TK, scores_TK, ids_TK, ctx.num_experts, ctx.route_scale), None, None, None


_sigmoid_topk_op.register_autograd(_grads, setup_context=_setup_grads)


def sigmoid_topk(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, route_scale: float):
    """``sigmoid_topk_forward`` with autograd: the weights are differentiable w.r.t. the logits (the bias only
    selects; ids, cutoff and counts carry no gradient). Returns (weights_TK, ids_TK, cutoff_T, counts_E). A custom
    operator (``kimik3::sigmoid_topk``): torch.compile traces around it."""
    if not through_operator(logits_TE):
        return sigmoid_topk_forward(logits_TE, bias_E, top_k, route_scale)
    _, _, route_scale = _check(logits_TE, bias_E, top_k, route_scale)   # the errors named here
    return _sigmoid_topk_op(logits_TE, bias_E, top_k, route_scale)[:4]


@_jit
def _div(a, b, F64: tl.constexpr):
    """a / b correctly rounded (Triton's fp32 ``/`` is an approximate division on NVIDIA GPUs)."""
    if F64:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@_jit
def _take_max(key, avail, cols, BLOCK_E: tl.constexpr):
    """Per row: the lowest available column holding the row's largest available key, and its one-hot mask."""
    best = tl.max(tl.where(avail, key, float("-inf")), axis=1)
    idx = tl.min(tl.where(avail & (key == best[:, None]), cols[None, :], BLOCK_E), axis=1)
    return idx, cols[None, :] == idx[:, None]


@_jit
def _sigmoid_topk_kernel(
    logits_ptr, bias_ptr, w_ptr, ids_ptr, cut_ptr, counts_ptr, s_ptr,
    T, E, stride_t, route_scale,
    K: tl.constexpr, CUTOFF: tl.constexpr, SCORES: tl.constexpr, LIBDEVICE: tl.constexpr, F64: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PROGRAM: tl.constexpr,
):
    """Program (block of BLOCK_T rows): scores, the top-K (and the (K+1)-th) by rounds of a row max, the normalised
    weights [T, K], ids [T, K] (int64), cutoff [T], the chosen scores [T, K] (with SCORES) and the counts [E]:
    stored whole by a lone program (ONE_PROGRAM), else atomic adds into zeroed counts."""
    ct = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :],
                mask=rmask[:, None] & cmask[None, :], other=0.0).to(ct)
    b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(ct)
    if LIBDEVICE:  # the exp torch's CUDA sigmoid calls
        e = libdevice.exp(-x)
    else:  # the interpreter has no libdevice
        e = tl.exp(-x)
    s = _div(tl.full([BLOCK_T, BLOCK_E], 1.0, ct), 1.0 + e, F64)
    biased = s + b[None, :]
    key = tl.where(biased != biased, float("inf"), biased)  # NaN above every number, as torch.topk ranks it
    avail = tl.broadcast_to(cmask[None, :], [BLOCK_T, BLOCK_E])  # not yet taken, and a real expert

    kcols = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=ct)
    taken = tl.zeros([BLOCK_E], dtype=tl.int64)   # rows of this block that chose each expert
    for r in range(K):
        idx, hit = _take_max(key, avail, cols, BLOCK_E)
        slot = kcols[None, :] == r
        ids = tl.where(slot, idx[:, None], ids)
        chosen = tl.where(slot, tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], chosen)
        avail = avail & (cols[None, :] != idx[:, None])
        if ONE_PROGRAM:
            taken += tl.sum((hit & rmask[:, None]).to(tl.int64), axis=0)
    if CUTOFF:  # K < E: one more round for the (K+1)-th biased score
        _, hit = _take_max(key, avail, cols, BLOCK_E)
        cut = tl.sum(tl.where(hit, biased, 0.0), axis=1)
    else:
        cut = tl.full([BLOCK_T], float("-inf"), ct)

    total = tl.sum(chosen, axis=1)
    w = _div(chosen, (total + 1e-20)[:, None], F64) * route_scale
    omask = rmask[:, None] & (kcols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=omask)
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=omask)
    if SCORES:
        tl.store(s_ptr + offs, chosen.to(s_ptr.dtype.element_ty), mask=omask)
    tl.store(cut_ptr + rows, cut.to(cut_ptr.dtype.element_ty), mask=rmask)
    if ONE_PROGRAM:
        tl.store(counts_ptr + cols, taken, mask=cmask)
    else:
        tl.atomic_add(counts_ptr + ids, tl.full([BLOCK_T, BLOCK_K], 1, tl.int64), mask=omask, sem="relaxed")
