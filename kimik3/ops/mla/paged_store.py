"""A forward's new MLA latents written into the serving engine's paged latent pool.

Row b's T new tokens sit at positions lengths[b] .. lengths[b] + T - 1 of its block table: token p of row b is
``pool[tables[b, p // P], p % P]`` (``kimik3/serve/paged_cache.py``). The kernel gives each token one program
that finds its slot from the table and copies its [latent | slice] row there, where the torch path computes every
slot with a few index ops and scatters (``paged_store_torch``, the reference and the CPU path).

No host synchronisation: a decode step with this call can be captured into a CUDA graph.

Legend: B rows, T new tokens a row, W = C + R cache width, N physical blocks, P tokens per block, M table width.
"""

from __future__ import annotations

import torch

from kimik3.ops.mla.paged_decode import _INTS, _describe, _interpreted, _jit, _on_device, paged_mla_backend, tl, triton

__all__ = ["paged_slots", "paged_store", "paged_store_torch"]


def _check(pool_NPW, kv_BTW, tables_BM, lengths_B) -> None:
    if not isinstance(pool_NPW, torch.Tensor) or pool_NPW.ndim != 3:
        raise ValueError(f"pool_NPW must be a 3-D tensor [N, P, W], got {_describe(pool_NPW)}")
    if not isinstance(kv_BTW, torch.Tensor) or kv_BTW.ndim != 3 or kv_BTW.shape[2] != pool_NPW.shape[2]:
        raise ValueError(f"kv_BTW must be a 3-D tensor [B, T, W={pool_NPW.shape[2]}], got {_describe(kv_BTW)}")
    B = kv_BTW.shape[0]
    if not isinstance(tables_BM, torch.Tensor) or tables_BM.ndim != 2 or tables_BM.shape[0] != B \
            or tables_BM.dtype not in _INTS:
        raise ValueError(f"tables_BM must be an integer tensor [B={B}, M], got {_describe(tables_BM)}")
    if not isinstance(lengths_B, torch.Tensor) or tuple(lengths_B.shape) != (B,) or lengths_B.dtype not in _INTS:
        raise ValueError(f"lengths_B must be an integer tensor [B={B}], got {_describe(lengths_B)}")
    for name, x in (("kv_BTW", kv_BTW), ("tables_BM", tables_BM), ("lengths_B", lengths_B)):
        if x.device != pool_NPW.device:
            raise ValueError(f"{name} is on {x.device} but pool_NPW on {pool_NPW.device}")


def paged_slots(tables_BM: torch.Tensor, positions_BX: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool rows (block x P + offset) of positions [B, X] of each row: ``pool.view(-1, W)``'s row index."""
    blocks_BX = torch.gather(tables_BM, 1, positions_BX // block_size)
    return blocks_BX * block_size + positions_BX % block_size


def paged_store_torch(pool_NPW: torch.Tensor, kv_BTW: torch.Tensor, tables_BM: torch.Tensor,
                      lengths_B: torch.Tensor) -> None:
    """``paged_store`` with torch ops: every token's slot, then one scatter."""
    _check(pool_NPW, kv_BTW, tables_BM, lengths_B)
    P = pool_NPW.shape[1]
    positions_BT = lengths_B[:, None] + torch.arange(kv_BTW.shape[1], device=kv_BTW.device)[None, :]
    slots_X = paged_slots(tables_BM, positions_BT, P).flatten()
    pool_NPW[slots_X // P, slots_X % P] = kv_BTW.flatten(0, 1).to(pool_NPW.dtype)


def paged_store(pool_NPW: torch.Tensor, kv_BTW: torch.Tensor, tables_BM: torch.Tensor, lengths_B: torch.Tensor,
                *, backend: str = "auto") -> None:
    """Write row b's T new latents kv_BTW[b] (any float dtype, rounded to the pool's) at positions lengths_B[b] ..
    lengths_B[b] + T - 1 of its table, in place. The positions must lie inside the table and their entries be block
    ids of the pool (not checked: that would read them on the host). ``backend``: ``paged_mla_backend``'s choice."""
    if paged_mla_backend(kv_BTW, backend) == "torch":
        paged_store_torch(pool_NPW, kv_BTW, tables_BM, lengths_B)
        return
    _check(pool_NPW, kv_BTW, tables_BM, lengths_B)
    if not pool_NPW.is_cuda and not _interpreted():
        raise ValueError(f"the Triton kernel needs CUDA tensors, got pool_NPW on {pool_NPW.device}")
    B, T, W = kv_BTW.shape
    if B * T == 0:
        return
    with _on_device(pool_NPW.device):
        _store_kernel[(B * T,)](
            pool_NPW, kv_BTW, tables_BM, lengths_B, T, W, pool_NPW.shape[1],
            *pool_NPW.stride(), *kv_BTW.stride(), *tables_BM.stride(), lengths_B.stride(0),
            BLOCK_W=triton.next_power_of_2(W), num_warps=4,
        )


@_jit
def _store_kernel(pool_ptr, kv_ptr, tab_ptr, len_ptr, T, W, P, s_pn, s_pp, s_pw, s_kb, s_kt, s_kw, s_tb, s_tm, s_len,
                  BLOCK_W: tl.constexpr):
    """Program (token x of row b = x // T): its slot from the table, its row copied there."""
    x = tl.program_id(0).to(tl.int64)
    b = x // T
    t = x - b * T
    position = tl.load(len_ptr + b * s_len).to(tl.int64) + t
    block = tl.load(tab_ptr + b * s_tb + (position // P) * s_tm).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    mask = cols < W
    row = tl.load(kv_ptr + b * s_kb + t * s_kt + cols * s_kw, mask=mask, other=0.0)
    tl.store(pool_ptr + block * s_pn + (position % P) * s_pp + cols * s_pw, row.to(pool_ptr.dtype.element_ty),
             mask=mask)
