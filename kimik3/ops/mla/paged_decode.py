"""Single-token absorbed-MLA attention over the serving engine's paged latent pool (decode).

Each of B rows attends, with all H heads, to its own ``lengths[b]`` cached tokens. The cache holds per token the
MLA latent and the shared unrotated slice, [latent (C) | slice (R)], in physical blocks of P tokens: token p of row
b is ``pool[tables[b, p // P], p % P]`` (``kimik3/serve/paged_cache.py``). In the absorbed form
(``GatedMLA._absorbed``) the queries already live in latent space, so

    scores[b, h, s] = (q_latent[b, h] . latent[s] + q_slice[b, h] . slice[s]) * scale      s < lengths[b]
    out[b, h] = softmax_s(scores[b, h]) @ latent

Every head of a row reads the same latents (multi-query attention with one C + R wide "head"), so the kernel,
like FlashMLA and flash-decoding, gives one program a row and a block of BLOCK_H heads: it fetches each tile of
BLOCK_S tokens through the block table once and serves all its heads with two dots, [BLOCK_H, C] x [C, BLOCK_S]
(+ the slice's [BLOCK_H, R] x [R, BLOCK_S]) for the scores and [BLOCK_H, BLOCK_S] x [BLOCK_S, C] for the output,
with an online fp32 softmax. At small batch a row's tokens are also split over ``num_splits`` programs, each
writing a normalised partial output and its log-sum-exp, which a second small kernel combines.

No host synchronisation anywhere (no ``.item()``, no host reads of ``lengths``): the loop bounds are read from
``lengths`` on the device and every launch parameter comes from the tensors' shapes, so a decode step with this
call can be captured into a CUDA graph. ``paged_mla_decode_torch`` is the reference (it gathers every row's
whole block table: memory B x M x P x W) and the CPU path.

Legend: B rows (sequences in the step), H heads, C latent width (kv_lora_rank), R slice width (qk_rope_head_dim),
W = C + R cache width, N physical blocks, P tokens per block, M block-table width (blocks per row), S tokens.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # the torch path still works; backend "triton" refuses (``paged_mla_backend``)
    triton = tl = None

    def _jit(fn):
        return fn

__all__ = [
    "check_paged_mla_inputs",
    "default_num_splits",
    "launch_paged_mla_decode",
    "paged_mla_backend",
    "paged_mla_decode",
    "paged_mla_decode_torch",
]

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# A split is worth its partial write and the combine only with this many tokens of the tables' capacity behind it.
MIN_SPLIT_TOKENS = 256
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


def check_paged_mla_inputs(q_latent_BHC, q_slice_BHR, pool_NPW, tables_BM, lengths_B, scale,
                           tokens_per_row: int = 1) -> None:
    """Raise ValueError naming the first malformed argument. Shapes, dtypes and devices only: nothing here reads a
    tensor's values (that would be a host sync)."""
    if not isinstance(q_latent_BHC, torch.Tensor) or q_latent_BHC.ndim != 3:
        raise ValueError(f"q_latent_BHC must be a 3-D tensor [B, H, C], got {_describe(q_latent_BHC)}")
    X, H, C = q_latent_BHC.shape
    if isinstance(tokens_per_row, bool) or not isinstance(tokens_per_row, int) or tokens_per_row < 1:
        raise ValueError(f"tokens_per_row must be an int >= 1, got {tokens_per_row!r}")
    if X % tokens_per_row:
        raise ValueError(f"{X} query rows are not a whole number of rows of {tokens_per_row} tokens")
    B = X // tokens_per_row
    if not isinstance(q_slice_BHR, torch.Tensor) or q_slice_BHR.ndim != 3 or tuple(q_slice_BHR.shape[:2]) != (X, H):
        raise ValueError(f"q_slice_BHR must be a 3-D tensor [{X}, H={H}, R], got {_describe(q_slice_BHR)}")
    R = q_slice_BHR.shape[2]
    if q_latent_BHC.dtype not in _FLOATS:
        raise ValueError(f"q_latent_BHC must be float32, bfloat16 or float16, got {q_latent_BHC.dtype}")
    if q_slice_BHR.dtype != q_latent_BHC.dtype:
        raise ValueError(f"q_slice_BHR must have q_latent_BHC's dtype {q_latent_BHC.dtype}, got {q_slice_BHR.dtype}")
    if not isinstance(pool_NPW, torch.Tensor) or pool_NPW.ndim != 3 or pool_NPW.shape[2] != C + R:
        raise ValueError(f"pool_NPW must be a 3-D tensor [N, P, C + R = {C + R}], got {_describe(pool_NPW)}")
    if pool_NPW.dtype not in _FLOATS:
        raise ValueError(f"pool_NPW must be float32, bfloat16 or float16, got {pool_NPW.dtype}")
    if pool_NPW.shape[1] < 1:
        raise ValueError(f"pool_NPW must hold at least one token per block, got {tuple(pool_NPW.shape)}")
    if not isinstance(tables_BM, torch.Tensor) or tables_BM.ndim != 2 or tables_BM.shape[0] != B:
        raise ValueError(f"tables_BM must be a 2-D tensor [B={B}, M], got {_describe(tables_BM)}")
    if tables_BM.dtype not in _INTS:
        raise ValueError(f"tables_BM must be int64 or int32 block ids, got {tables_BM.dtype}")
    if not isinstance(lengths_B, torch.Tensor) or tuple(lengths_B.shape) != (B,):
        raise ValueError(f"lengths_B must be a 1-D tensor [B={B}], got {_describe(lengths_B)}")
    if lengths_B.dtype not in _INTS:
        raise ValueError(f"lengths_B must be int64 or int32 token counts, got {lengths_B.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number (not a tensor: reading one is a host sync), "
                         f"got {scale!r}")
    for name, x in (("q_latent_BHC", q_latent_BHC), ("q_slice_BHR", q_slice_BHR), ("tables_BM", tables_BM),
                    ("lengths_B", lengths_B)):
        if x.device != pool_NPW.device:
            raise ValueError(f"{name} is on {x.device} but pool_NPW on {pool_NPW.device}: every input must be on "
                             "the pool's device")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def _kernel_width_ok(d: int) -> bool:
    """Whether the Triton kernel takes a latent (C) or rope-slice (R) width of ``d``: a power of two >= 16."""
    return d >= 16 and not d & (d - 1)


def _check_kernel_widths(C: int, R: int) -> None:
    for name, d in (("C (q_latent_BHC's last dim)", C), ("R (q_slice_BHR's last dim)", R)):
        if not _kernel_width_ok(d):
            raise ValueError(f"the Triton kernel needs {name} to be a power of two >= 16, got {d}")


def check_paged_mla_widths(kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    """Refuse, naming the configuration's fields, an MLA the Triton decode kernel cannot take (the serving engine
    checks this on CUDA before it captures anything)."""
    for name, d in (("mla.kv_lora_rank", kv_lora_rank), ("mla.qk_rope_head_dim", qk_rope_head_dim)):
        if not _kernel_width_ok(d):
            raise ValueError(f"the paged MLA decode kernel (CUDA) needs {name} to be a power of two >= 16, got {d}: "
                             f"serve this model on the CPU or change its configuration")


def _interpreted() -> bool:
    """Whether this module's kernels run under Triton's interpreter (decided when they were decorated, i.e. when
    TRITON_INTERPRET=1 was set before this module was imported)."""
    return triton is not None and type(_paged_mla_kernel).__name__ == "InterpretedFunction"


def paged_mla_backend(q_latent_BHC: torch.Tensor, backend: str = "auto") -> str:
    """"triton" or "torch" for these inputs. "auto": Triton for CUDA tensors when triton is installed, else torch
    (CPU tensors take the torch path even under TRITON_INTERPRET=1, as KDA's ``kda_backend`` does). "triton" forces
    the kernel: CUDA tensors, or CPU tensors when the kernels were decorated under TRITON_INTERPRET=1. Errors are
    raised, never answered by a fallback."""
    choice = (backend or "auto").lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if choice == "auto":
        return "triton" if (q_latent_BHC.is_cuda and triton is not None) else "torch"
    if choice == "triton":
        if triton is None:
            raise RuntimeError("paged MLA backend 'triton' requested but triton is not installed")
        if not q_latent_BHC.is_cuda and not _interpreted():
            raise ValueError(f"backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before kimik3.ops.mla "
                             f"is imported for CPU ones; got {q_latent_BHC.device} (TRITON_INTERPRET="
                             f"{os.environ.get('TRITON_INTERPRET')!r})")
    return choice


def paged_mla_decode_torch(
    q_latent_BHC: torch.Tensor, q_slice_BHR: torch.Tensor, pool_NPW: torch.Tensor, tables_BM: torch.Tensor,
    lengths_B: torch.Tensor, scale: float, tokens_per_row: int = 1,
) -> torch.Tensor:
    """``paged_mla_decode`` in plain torch, all in fp32: gathers the M x P slots of every row's table, masks the
    slots at or past the row's length (their table entries are never used: padding may hold any value), softmax.
    Returns [B, H, C] in q_latent's dtype; rows of length 0 give zeros."""
    check_paged_mla_inputs(q_latent_BHC, q_slice_BHR, pool_NPW, tables_BM, lengths_B, scale, tokens_per_row)
    if tokens_per_row > 1:   # each query its own row: its table, and its length counted on from the first's
        T = tokens_per_row
        tables_BM = tables_BM.repeat_interleave(T, dim=0)
        lengths_B = (lengths_B[:, None] + torch.arange(T, device=lengths_B.device)).flatten()
    C = q_latent_BHC.shape[2]
    R = q_slice_BHR.shape[2]
    P = pool_NPW.shape[1]
    device = pool_NPW.device
    pos_S = torch.arange(tables_BM.shape[1] * P, device=device)
    valid_BS = pos_S[None, :] < lengths_B[:, None]
    block_BS = torch.where(valid_BS, tables_BM[:, pos_S // P], 0).long()
    kv_BSW = pool_NPW[block_BS, (pos_S % P)[None, :]].float()
    latent_BSC, slice_BSR = kv_BSW.split([C, R], dim=-1)
    scores_BHS = (torch.einsum("bhc,bsc->bhs", q_latent_BHC.float(), latent_BSC)
                  + torch.einsum("bhr,bsr->bhs", q_slice_BHR.float(), slice_BSR)) * scale
    scores_BHS = scores_BHS.masked_fill(~valid_BS[:, None, :], float("-inf"))
    probs_BHS = torch.softmax(scores_BHS, dim=-1)
    probs_BHS = torch.where(valid_BS[:, None, :], probs_BHS, 0.0)  # (length-0 rows: softmax of all -inf is NaN)
    return torch.einsum("bhs,bsc->bhc", probs_BHS, latent_BSC).to(q_latent_BHC.dtype)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, head_blocks: int, capacity: int, sm_count: int | None) -> int:
    """How many programs share one row's tokens, from static sizes only (so a captured graph stays valid for any
    lengths): 1 when B x head_blocks programs already fill the ``sm_count`` SMs (or there is no GPU), else enough
    to fill them, at most one per MIN_SPLIT_TOKENS of the tables' capacity (M x P tokens) and MAX_SPLITS."""
    programs = batch * head_blocks
    if sm_count is None or programs <= 0 or programs >= sm_count:
        return 1
    by_sms = -(-sm_count // programs)
    by_capacity = -(-capacity // MIN_SPLIT_TOKENS)
    return max(1, min(by_sms, by_capacity, MAX_SPLITS))


def _default_blocks(H: int, C: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_S, num_warps): at most 16 x 512 fp32 accumulators and 32 x 512 latents a program (so K3's
    C = 512 runs 16 heads and 32-token tiles), at least 16 of each for tl.dot; 8 warps from C = 128 up. Not tuned
    on a GPU yet; compiled for sm_90 with contiguous inputs they take 148 registers (K3: C = 512, R = 64, bf16)
    and 100 (the debug preset's C = 256, R = 32, 16 heads), without spills."""
    block_h = max(16, min(64, 8192 // C, triton.next_power_of_2(H)))
    block_s = max(16, min(64, 16384 // C))
    return block_h, block_s, 8 if C >= 128 else 4


def launch_paged_mla_decode(
    q_latent_BHC: torch.Tensor, q_slice_BHR: torch.Tensor, pool_NPW: torch.Tensor, tables_BM: torch.Tensor,
    lengths_B: torch.Tensor, scale: float, *, tokens_per_row: int = 1, num_splits: int | None = None,
    block_h: int | None = None, block_s: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:
    """``paged_mla_decode`` in the Triton kernels (no dispatch: the tensors must be on CUDA, or on the CPU under the
    interpreter). num_splits, block_h, block_s (powers of two >= 16), num_warps override the heuristics
    (``default_num_splits``, ``_default_blocks``); num_splits 1 is the single-pass kernel, more adds the combine."""
    check_paged_mla_inputs(q_latent_BHC, q_slice_BHR, pool_NPW, tables_BM, lengths_B, scale, tokens_per_row)
    if triton is None:
        raise RuntimeError("launch_paged_mla_decode needs triton, which is not installed")
    if not pool_NPW.is_cuda and not _interpreted():
        raise ValueError(f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before kimik3.ops.mla is "
                         f"imported), got pool_NPW on {pool_NPW.device}")
    B, H, C = q_latent_BHC.shape
    R = q_slice_BHR.shape[2]
    _check_kernel_widths(C, R)
    bh, bs, nw = _default_blocks(H, C)
    bh, bs, nw = block_h or bh, block_s or bs, num_warps or nw
    for name, v in (("block_h", bh), ("block_s", bs)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    M, P = tables_BM.shape[1], pool_NPW.shape[1]
    head_blocks = triton.cdiv(H, bh)
    if num_splits is None:
        sms = _sm_count(pool_NPW.device.index or 0) if pool_NPW.is_cuda else None
        num_splits = default_num_splits(B, head_blocks, M * P, sms)
    if not isinstance(num_splits, int) or not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be an int in [1, 1024], got {num_splits!r}")
    out_BHC = torch.empty(B, H, C, dtype=q_latent_BHC.dtype, device=q_latent_BHC.device)
    if B == 0 or H == 0:
        return out_BHC
    # Both operands of each dot in the pool's 16-bit dtype when q has it too (tensor cores, fp32 accumulation);
    # any other mix in exact fp32.
    dot_f32 = not (q_latent_BHC.dtype == pool_NPW.dtype and pool_NPW.dtype != torch.float32)
    if num_splits == 1:
        dest, lse_BHS, dest_strides = out_BHC, out_BHC, (out_BHC.stride(0), out_BHC.stride(1), 0)
    else:
        dest = torch.empty(B, H, num_splits, C, dtype=torch.float32, device=pool_NPW.device)
        lse_BHS = torch.empty(B, H, num_splits, dtype=torch.float32, device=pool_NPW.device)
        dest_strides = dest.stride()[:3]
    ql, qs = q_latent_BHC, q_slice_BHR
    with _on_device(pool_NPW.device):
        _paged_mla_kernel[(B, head_blocks, num_splits)](
            ql, qs, pool_NPW, tables_BM, lengths_B, dest, lse_BHS,
            H, M, P, tokens_per_row, float(scale) * LOG2E,
            *ql.stride(), *qs.stride(), *pool_NPW.stride(), *tables_BM.stride(), lengths_B.stride(0), *dest_strides,
            C=C, R=R, BLOCK_H=bh, BLOCK_S=bs, NUM_SPLITS=num_splits, DOT_F32=dot_f32, INTERPRET=_interpreted(),
            num_warps=nw, num_stages=2,
        )
        if num_splits > 1:
            splits_p2 = triton.next_power_of_2(num_splits)
            block_c = max(16, min(C, 4096 // splits_p2))
            _combine_kernel[(B, H, C // block_c)](
                dest, lse_BHS, out_BHC, H, out_BHC.stride(0), out_BHC.stride(1),
                C=C, NUM_SPLITS=num_splits, SPLITS_P2=splits_p2, BLOCK_C=block_c, num_warps=4,
            )
    return out_BHC


def _on_device(device: torch.device):
    """Launch on the tensors' GPU whatever the current device is (Triton launches on the current one)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@torch.compiler.disable   # an opaque kernel call to torch.compile: traced, its launcher breaks on symbolic sizes
def paged_mla_decode(
    q_latent_BHC: torch.Tensor, q_slice_BHR: torch.Tensor, pool_NPW: torch.Tensor, tables_BM: torch.Tensor,
    lengths_B: torch.Tensor, scale: float, *, tokens_per_row: int = 1, backend: str = "auto",
    num_splits: int | None = None,
) -> torch.Tensor:
    """One decode token's absorbed MLA attention for B rows over the paged latent pool -> out_BHC [B, H, C].

    q_latent_BHC [B, H, C] and q_slice_BHR [B, H, R]: one dtype (fp32, bf16 or fp16), any strides.
    pool_NPW [N, P, C + R] (fp32, bf16 or fp16, any strides; a contiguous last dim, as ``LatentPool``'s, lets the
    kernel load whole rows in vectors): [latent | slice] of each cached token.
    tables_BM [B, M] int64 or int32: row b's token p is pool[tables[b, p // P], p % P]; the entries a row uses must
    be block ids in [0, N) (not checked: that would read them on the host); entries past the row's length are never
    read (any padding value). lengths_B [B] int64 or int32: tokens to attend per row (the new
    token's latent already written); 0 marks a padding row, whose output is zeros; lengths are clamped to [0, M x P]
    (read on the device: never checked against the capacity on the host). scale: a Python float (the softmax scale).
    Output in q_latent's dtype; scores, softmax and accumulation in fp32. 16-bit q and pool of the same dtype feed
    the dots in that dtype (the probabilities too, rounded as in ``GatedMLA._absorbed``); other mixes run fp32 dots.

    tokens_per_row T: several queries of one row (a speculative verification's T tokens): q holds B x T rows, row
    b's token t at b * T + t; tables_BM and lengths_B have B rows, and token t attends to lengths_B[b] + t tokens
    (each token to its row's latents up to its own, with lengths_B[b] counting the first token's).

    backend: see ``paged_mla_backend`` ("auto": the Triton kernel on CUDA, the torch reference elsewhere).
    num_splits: the Triton path's sequence splits (None: ``default_num_splits``). No host syncs on any path.
    """
    if paged_mla_backend(q_latent_BHC, backend) == "torch":
        return paged_mla_decode_torch(q_latent_BHC, q_slice_BHR, pool_NPW, tables_BM, lengths_B, scale,
                                      tokens_per_row)
    return launch_paged_mla_decode(q_latent_BHC, q_slice_BHR, pool_NPW, tables_BM, lengths_B, scale,
                                   tokens_per_row=tokens_per_row, num_splits=num_splits)


@_jit
def _attend_tile(
    s0, end, m_i, l_i, acc, ql, qs, pool_ptr, tab_ptr, b, P, qk_scale, s_pn, s_pp, s_pw, s_tb, s_tm,
    C: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One online-softmax step of ``_paged_mla_kernel`` over row b's tokens [s0, min(s0 + BLOCK_S, end))."""
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    offs_s = s0 + tl.arange(0, BLOCK_S)
    mask_s = offs_s < end
    # Per-token addresses: a tile may straddle blocks, and P need not be a multiple of BLOCK_S.
    block = tl.load(tab_ptr + b * s_tb + (offs_s // P) * s_tm, mask=mask_s, other=0).to(tl.int64)
    row_ptr = pool_ptr + block * s_pn + (offs_s % P).to(tl.int64) * s_pp
    kv = tl.load(row_ptr[:, None] + offs_c[None, :] * s_pw, mask=mask_s[:, None], other=0.0)
    ks = tl.load(row_ptr[:, None] + (C + offs_r)[None, :] * s_pw, mask=mask_s[:, None], other=0.0)
    if DOT_F32:
        kv = kv.to(tl.float32)
        ks = ks.to(tl.float32)
        scores = tl.dot(ql, tl.trans(kv), input_precision="ieee")
        scores = tl.dot(qs, tl.trans(ks), acc=scores, input_precision="ieee")
    else:
        scores = tl.dot(ql, tl.trans(kv))
        scores = tl.dot(qs, tl.trans(ks), acc=scores)
    scores = tl.where(mask_s[None, :], scores * qk_scale, float("-inf"))
    # Every tile holds a valid token, so m_new is finite and the -inf lanes give p = 0.
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    return m_new, l_i, acc


@_jit
def _paged_mla_kernel(
    ql_ptr, qs_ptr, pool_ptr, tab_ptr, len_ptr, out_ptr, lse_ptr,
    H, M, P, T, qk_scale,
    s_qlb, s_qlh, s_qlc, s_qsb, s_qsh, s_qsr,
    s_pn, s_pp, s_pw, s_tb, s_tm, s_len,
    s_ob, s_oh, s_os,
    C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (query b, head block, split): attends heads [hb * BLOCK_H, +BLOCK_H) of query b (token b % T of table
    row b // T) to the split's share of its tokens. NUM_SPLITS == 1: writes out[b, h] (q's dtype). Else writes the
    normalised partial output (fp32) to out_ptr [B, H, NUM_SPLITS, C] and its log2-sum-exp (-inf when the split is
    empty) to lse_ptr."""
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, C)
    offs_r = tl.arange(0, R)
    ql = tl.load(ql_ptr + b * s_qlb + offs_h[:, None] * s_qlh + offs_c[None, :] * s_qlc, mask=mask_h[:, None],
                 other=0.0)
    qs = tl.load(qs_ptr + b * s_qsb + offs_h[:, None] * s_qsh + offs_r[None, :] * s_qsr, mask=mask_h[:, None],
                 other=0.0)
    if DOT_F32:
        ql = ql.to(tl.float32)
        qs = qs.to(tl.float32)
    else:
        ql = ql.to(pool_ptr.dtype.element_ty)
        qs = qs.to(pool_ptr.dtype.element_ty)

    # This split's tokens: an equal share of the row's length, in whole tiles (split from the device-side length,
    # so short rows do not leave most splits idle while one does all the work).
    row = b // T
    length = tl.load(len_ptr + row * s_len).to(tl.int32) + (b - row * T).to(tl.int32)
    length = tl.minimum(tl.maximum(length, 0), M * P)
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_S) * BLOCK_S
    start = sp * chunk
    end = tl.minimum(start + chunk, length)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    if INTERPRET:
        # Triton 3.6's interpreter cannot take tensor bounds in range() under NumPy >= 2.4 (triton#9171); the GPU
        # keeps the for loop, which Triton software-pipelines (a while loop it does not).
        s0 = start
        while s0 < end:
            m_i, l_i, acc = _attend_tile(
                s0, end, m_i, l_i, acc, ql, qs, pool_ptr, tab_ptr, row, P, qk_scale, s_pn, s_pp, s_pw, s_tb, s_tm,
                C, R, BLOCK_S, DOT_F32)
            s0 += BLOCK_S
    else:
        for s0 in range(start, end, BLOCK_S):
            m_i, l_i, acc = _attend_tile(
                s0, end, m_i, l_i, acc, ql, qs, pool_ptr, tab_ptr, row, P, qk_scale, s_pn, s_pp, s_pw, s_tb, s_tm,
                C, R, BLOCK_S, DOT_F32)

    has = l_i > 0.0  # False: the row (or this split) has no token
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + b * s_ob + offs_h[:, None] * s_oh + sp * s_os + offs_c[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        tl.store(o_ptrs, o, mask=mask_h[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * H + offs_h) * NUM_SPLITS + sp, lse, mask=mask_h)


@_jit
def _combine_kernel(
    part_ptr, lse_ptr, out_ptr, H, s_ob, s_oh,
    C: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (row b, head h, C block): out = sum_i w_i o_i / sum_i w_i with w_i = 2^(lse_i - max lse) over the
    splits (contiguous partials [B, H, NUM_SPLITS, C] fp32 and lse [B, H, NUM_SPLITS]); zeros when every split is
    empty (a length-0 row)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_i = tl.arange(0, SPLITS_P2)
    mask_i = offs_i < NUM_SPLITS
    base = (b * H + h) * NUM_SPLITS
    lse = tl.load(lse_ptr + base + offs_i, mask=mask_i, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.sum(w, axis=0)
    part = tl.load(part_ptr + (base + offs_i)[:, None] * C + offs_c[None, :], mask=mask_i[:, None], other=0.0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_c, o.to(out_ptr.dtype.element_ty))
