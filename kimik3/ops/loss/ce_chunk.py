"""One chunk of ``linear_cross_entropy`` in a Triton kernel: the logits' logsumexp, the loss terms and, in place, the
logits' gradient.

Input: the chunk's logits z [C, V] as the matmul wrote them (the compute dtype, bf16 in training). One program a
row, two passes over it (fp32 math; fp64 when z is fp64, for gradcheck):
  1. online max and sum of exp over V in blocks -> lse; loss = lse - z[label] (0 on an ignored row);
  2. with GRAD: z <- (exp(z - lse) - onehot(label)) * s in z's dtype, s = scale (1/n_valid or 1), 0 on an
     ignored row.
So the chunk is read twice and written once, and no fp32 copy of it exists; the torch path (``_chunk_torch`` in
``linear_cross_entropy``) makes the fp32 copy and walks it about five times.

Shapes decide the launch (no host sync): the scale is read from a device scalar. Labels must already be checked
(``linear_cross_entropy`` does): every label is ``ignore_index`` or in [0, V).

Legend: C tokens of the chunk, V vocabulary.
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import _jit, check_triton_device, on_device, tl, triton

__all__ = ["BLOCK_V", "ce_chunk"]

# Logits per block of a row's loop: 16 fp32 values a thread at 8 warps; V = 163,840 is 20 blocks a pass.
BLOCK_V = 4096


def ce_chunk(z_CV: torch.Tensor, labels_C: torch.Tensor, ignore_index: int, scale: torch.Tensor, grad: bool,
             *, block_v: int | None = None) -> torch.Tensor:
    """Loss terms [C] fp32 (fp64 for fp64 z) of the chunk's rows; with ``grad`` also overwrites ``z_CV`` with
    dL/dz in its dtype (see the module docstring).

    z_CV: [C, V] float, unit stride along V (rows may be strided). labels_C: [C] int64. scale: a 0-dim float
    tensor on z's device (1/n_valid for a mean, 1 for a sum). ``block_v`` overrides BLOCK_V (a power of two;
    tests use small ones to walk several blocks a row)."""
    check_triton_device(z_CV, "ce_chunk")
    if z_CV.ndim != 2 or z_CV.stride(1) != 1:
        raise ValueError(f"z_CV must be [C, V] with unit stride along V, got shape {tuple(z_CV.shape)} "
                         f"strides {z_CV.stride()}")
    C, V = z_CV.shape
    if labels_C.shape != (C,) or labels_C.dtype != torch.int64:
        raise ValueError(f"labels_C must be int64 [{C}], got {labels_C.dtype} {tuple(labels_C.shape)}")
    if scale.numel() != 1 or not scale.is_floating_point():
        raise ValueError(f"scale must be a one-element float tensor, got {scale.dtype} {tuple(scale.shape)}")
    f64 = z_CV.dtype == torch.float64
    loss_C = torch.empty(C, dtype=torch.float64 if f64 else torch.float32, device=z_CV.device)
    if C == 0:
        return loss_C
    block = block_v or min(BLOCK_V, triton.next_power_of_2(V))
    if block & (block - 1):
        raise ValueError(f"block_v must be a power of two, got {block}")
    with on_device(z_CV.device):
        _ce_chunk_kernel[(C,)](
            z_CV, z_CV.stride(0), labels_C, ignore_index, scale, loss_C, V,
            GRAD=grad, BLOCK_V=block, F64=f64, num_warps=8 if block >= 2048 else 4,
        )
    return loss_C


@_jit
def _ce_chunk_kernel(
    z_ptr, s_z, labels_ptr, ignore_index, scale_ptr, loss_ptr, V,
    GRAD: tl.constexpr, BLOCK_V: tl.constexpr, F64: tl.constexpr,
):
    """Program (row): loss_ptr[row] = lse - z[label] (0 if ignored); with GRAD, z[row] <- dL/dz in z's dtype."""
    ct = tl.float64 if F64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * s_z
    cols = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)

    # Pass 1: running max m and sum of exp(z - m); every block holds at least one real logit, so m is finite
    # after the first one and exp(m_old - m_new) never sees inf - inf.
    m = tl.full([], float("-inf"), ct)
    s = tl.zeros([], ct)
    off = 0
    while off < V:  # (a while loop: Triton 3.6's interpreter cannot take tensor bounds in range(), triton#9171)
        mask = off + cols < V
        z = tl.load(base + off + cols, mask=mask, other=float("-inf")).to(ct)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        off += BLOCK_V
    lse = m + tl.log(s)
    z_target = tl.load(base + target).to(ct)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_target, 0.0).to(loss_ptr.dtype.element_ty))

    if GRAD:
        # Pass 2: (softmax - onehot) * row scale, written over the logits (each block is read before it is written).
        row_scale = tl.where(valid, tl.load(scale_ptr).to(ct), 0.0)
        off = 0
        while off < V:
            idx = off + cols
            mask = idx < V
            z = tl.load(base + idx, mask=mask, other=0.0).to(ct)
            g = tl.exp(z - lse) * row_scale
            g = tl.where(idx == target, g - row_scale, g)
            tl.store(base + idx, g.to(z_ptr.dtype.element_ty), mask=mask)
            off += BLOCK_V
