"""Linear + cross-entropy over token chunks: ``F.cross_entropy(F.linear(hidden, W).float(), labels)`` without the
[N, V] fp32 logits (issue 39; the debug preset's 4 x 4,096 tokens x 163,840 vocab made 10.7 GB of them, and as
much again for their gradient).

Per chunk of C tokens, in one pass:
  z = hidden_c @ W^T in the compute dtype (the inputs', or autocast's), then fp32 (as ``F.linear(...).float()``);
  lse = logsumexp(z); loss terms lse - z[label] (0 on ignored rows);
  as the loss is a scalar, its gradient is known here: dL/dz = (softmax(z) - onehot(label)) * s, with s = 1/n_valid
  (mean) or 1 (sum) and 0 on ignored rows, written over z in place and cast to the compute dtype; then
  d hidden_c = dz @ W and dW += dz^T @ hidden_c (an fp32 buffer).
The backward only scales the saved grads by grad_output. Peak memory besides them (d hidden [N, D] in the compute
dtype, dW [V, D] fp32): one chunk's logits. On CUDA the per-chunk elementwise work is one Triton kernel
(``ce_chunk``: two passes over the compute-dtype logits, no fp32 copy); elsewhere torch ops.

Mean over no counted token is nan, as ``F.cross_entropy`` gives (its gradient is zero). Not twice differentiable.

Legend: N tokens (leading dims flattened), D width, V vocabulary, C tokens per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimik3.ops.glue.common import glue_backend
from kimik3.ops.loss.ce_chunk import ce_chunk
from kimik3.ops.precision import no_autocast

__all__ = ["default_chunk_tokens", "linear_cross_entropy", "linear_cross_entropy_reference"]

# The fp32 logits of one chunk stay within this: on a GPU 1 to 2 GiB (C is a power of two, so the usual power-of-two
# token counts split evenly; V = 163,840 gives C = 2,048: 1.34 GB fp32, 11 matmul passes fewer than C = 128 would
# need for dW), large enough for full-speed matmuls; on the CPU about a core's L2 cache, so that the softmax's
# several passes over a chunk stay in cache instead of each going to memory, but at least CPU_MIN_CHUNK_TOKENS rows,
# as each chunk reads the whole head.
GPU_CHUNK_BYTES = 2 << 30
CPU_CHUNK_BYTES = 4 << 20
CPU_MIN_CHUNK_TOKENS = 64
_REDUCTIONS = ("mean", "sum")


def default_chunk_tokens(vocab: int, device: torch.device | str) -> int:
    """Tokens a chunk: the largest power of two whose fp32 logits [C, vocab] fit GPU_CHUNK_BYTES (CUDA, at least 1)
    or CPU_CHUNK_BYTES (elsewhere, at least CPU_MIN_CHUNK_TOKENS)."""
    cuda = torch.device(device).type == "cuda"
    fit = max(1, (GPU_CHUNK_BYTES if cuda else CPU_CHUNK_BYTES) // (4 * max(1, vocab)))
    chunk = 1 << (fit.bit_length() - 1)
    return chunk if cuda else max(chunk, CPU_MIN_CHUNK_TOKENS)


def linear_cross_entropy_reference(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor, *,
                                   ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """The plain formula (for tests): ``F.cross_entropy(F.linear(hidden, W).float(), labels)``, the [N, V] logits
    materialised; hidden [..., D], labels [...]."""
    logits = F.linear(hidden_ND, weight_VD).flatten(0, -2).float()
    return F.cross_entropy(logits, labels_N.flatten(), ignore_index=ignore_index, reduction=reduction)


@torch.compiler.disable  # a Python loop over chunks with a host read (the label check): opaque to torch.compile
def linear_cross_entropy(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean", chunk_tokens: int | None = None,
                         backend: str = "auto", check_labels: bool = True) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight^T`` against ``labels``, chunked over tokens -> fp32 scalar
    (fp64 for fp64 inputs). Differentiable w.r.t. hidden and weight.

    hidden_ND: [..., D] float. weight_VD: [V, D] float (the head; a tied embedding too: grads accumulate).
    labels_N: [...] (hidden's leading dims) integer, each in [0, V) or ``ignore_index``. The matmuls run in the
    inputs' dtype (they must agree), or autocast's when it is on; the softmax in fp32. ``reduction``: "mean" over
    the labels != ignore_index (nan when there are none, as torch), or "sum". ``chunk_tokens``: tokens a chunk
    (default ``default_chunk_tokens``). ``backend``: "auto" (the Triton chunk kernel on CUDA when triton is
    installed, else torch), "torch" or "triton". The label check reads one bool back to the host;
    ``check_labels=False`` leaves it to the caller (the model checks ids and labels together, one read a batch).
    """
    h, w, labels, cdt, chunk, use_triton = _check(hidden_ND, weight_VD, labels_N, ignore_index, reduction,
                                                  chunk_tokens, backend, check_labels)
    if not (torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad)):
        return _forward(h, w, labels, ignore_index, reduction, chunk, cdt, use_triton, False, False)[0]
    return _LinearCrossEntropyFn.apply(h, w, labels, ignore_index, reduction, chunk, cdt, use_triton)


class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, reduction, chunk, cdt, use_triton):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dh, dw = _forward(h, w, labels, ignore_index, reduction, chunk, cdt, use_triton, need_dh, need_dw)
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h.dtype, w.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable  # the grads were computed in the forward: no graph to go twice
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        grad_h = (dh * grad_loss).to(h_dtype) if dh is not None else None
        grad_w = (dw * grad_loss).to(w_dtype) if dw is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def _check(hidden, weight, labels, ignore_index, reduction, chunk_tokens, backend, check_labels):
    """Validates the arguments; returns (hidden [N, D], weight, labels [N] int64, compute dtype, chunk tokens,
    whether the Triton kernel runs)."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {_describe(x)}")
    if hidden.ndim < 1 or weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden must be [..., D] and weight [V, D] with the same D, got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {_describe(labels)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden, weight and labels must share a device, got {hidden.device}, {weight.device}, "
                         f"{labels.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    device, V = hidden.device, weight.shape[0]
    wide = torch.float64 in (hidden.dtype, weight.dtype)
    if torch.is_autocast_enabled(device.type) and not wide:
        cdt = torch.get_autocast_dtype(device.type)   # what F.linear would compute in
    elif hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype outside autocast")
    else:
        cdt = hidden.dtype
    labels = labels.reshape(-1).long()
    capturing = labels.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_labels and labels.numel() and not capturing:
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
        if bool(bad.any()):
            first = int(labels[bad][0])
            raise ValueError(f"labels must lie in [0, {V}) or equal ignore_index={ignore_index}, got {first}")
    # The glue ops' choice, with no width bound: the chunk kernel loops over V whatever D is.
    use_triton = glue_backend(hidden, backend, max_width=hidden.shape[-1]) == "triton"
    chunk = chunk_tokens or default_chunk_tokens(V, device)
    return hidden.reshape(-1, hidden.shape[-1]), weight, labels, cdt, chunk, use_triton


def _forward(h_ND, w_VD, labels_N, ignore_index, reduction, chunk, cdt, use_triton, need_dh, need_dw):
    """(loss, d loss / d hidden [N, D] in cdt or None, d loss / d W [V, D] fp32 or None), chunk by chunk."""
    N, D = h_ND.shape
    V = w_VD.shape[0]
    acc = torch.float64 if cdt == torch.float64 else torch.float32
    grad = need_dh or need_dw
    with torch.no_grad(), no_autocast(h_ND.device):
        h, w = h_ND.to(cdt), w_VD.to(cdt)
        valid_N = labels_N != ignore_index
        n_valid = valid_N.sum()
        scale = n_valid.to(acc).reciprocal() if reduction == "mean" else torch.ones((), dtype=acc, device=h.device)
        target_N = torch.where(valid_N, labels_N, 0)
        loss_N = torch.empty(N, dtype=acc, device=h.device)
        dh = torch.empty(N, D, dtype=cdt, device=h.device) if need_dh else None
        dw = torch.zeros(V, D, dtype=acc, device=h.device) if need_dw else None
        row_scale_N = torch.where(valid_N, scale, 0.0) if grad and not use_triton else None
        for start in range(0, N, chunk):
            rows = slice(start, min(N, start + chunk))
            z_CV = h[rows] @ w.T
            if use_triton:
                loss_N[rows] = ce_chunk(z_CV, labels_N[rows], ignore_index, scale, grad)
                dz_CV = z_CV
            else:
                loss_N[rows], dz_CV = _chunk_torch(z_CV, target_N[rows], valid_N[rows],
                                                   row_scale_N[rows] if grad else None, acc)
            if need_dh:
                torch.mm(dz_CV, w, out=dh[rows])
            if need_dw:
                _accumulate(dw, dz_CV.T, h[rows])
        total = loss_N.sum()
        loss = total / n_valid.to(acc) if reduction == "mean" else total
    return loss, dh, dw


def _chunk_torch(z_CV, target_C, valid_C, row_scale_C, acc):
    """The chunk's loss terms [C] (acc dtype) and, with ``row_scale_C``, dL/dz in z's dtype (torch ops, in place on
    the acc-dtype copy of z). Five passes over the chunk and no temporary of its size: the max, exp(z - max) in
    place, its sum (lse = max + log sum), then softmax * s as exp(z - max) * (s / sum) (s = 0 on ignored rows), and
    -s at the target; ``torch.logsumexp`` alone would make and walk a chunk-sized temporary."""
    logits = z_CV.to(acc)   # the matmul's buffer itself when it is already fp32: ours to overwrite
    max_C1 = logits.amax(1, keepdim=True)
    target_z_C = logits.gather(1, target_C[:, None]).squeeze(1)
    sum_C = logits.sub_(max_C1).exp_().sum(1)
    loss_C = torch.where(valid_C, max_C1.squeeze(1) + sum_C.log() - target_z_C, 0.0)
    if row_scale_C is None:
        return loss_C, None
    logits.mul_((row_scale_C / sum_C)[:, None])
    logits.scatter_add_(1, target_C[:, None], -row_scale_C[:, None])
    return loss_C, logits.to(z_CV.dtype)


def _accumulate(dw_VD: torch.Tensor, a_VC: torch.Tensor, b_CD: torch.Tensor) -> None:
    """dw += a @ b with dw fp32 (fp64) and a, b maybe narrower. On CUDA one GEMM accumulates into dw in its dtype
    (``addmm`` with ``out_dtype``: no product of the weight's size in a's dtype); torch has no such GEMM on the CPU,
    where the product is made in a's dtype and added."""
    if a_VC.dtype == dw_VD.dtype:
        dw_VD.addmm_(a_VC, b_CD)
    elif dw_VD.is_cuda:
        torch.addmm(dw_VD, a_VC, b_CD, out_dtype=dw_VD.dtype, out=dw_VD)
    else:
        dw_VD.add_(a_VC @ b_CD)


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
