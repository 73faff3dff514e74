"""``kimik3.ops.mla.paged_store`` (a forward's new latents written into the paged pool): the kernel against the
torch path and against a slot-by-slot copy, with tokens straddling blocks, padding entries in the tables, strided
inputs, a bf16 pool from fp32 latents; the checks. Without CUDA the kernel runs under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.mla import paged_store, paged_store_torch
from tests.kernel_testing import DEV, interpreter_setup, needs_kernels  # noqa: F401 (interpreter_setup: autouse)


def _inputs(B=3, T=4, W=24, N=10, P=4, M=5, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(N, P, W, generator=gen).to(DEV, dtype)
    tables = torch.stack([torch.randperm(N, generator=gen)[:M] for _ in range(B)]).to(DEV)
    lengths = torch.tensor([0, 3, 13][:B], device=DEV)   # from a block's start, across a block's end, near the table's
    kv = torch.randn(B, T, W, generator=gen).to(DEV)
    return pool, kv, tables, lengths


def _by_hand(pool, kv, tables, lengths):
    out = pool.clone()
    P = pool.shape[1]
    for b in range(kv.shape[0]):
        for t in range(kv.shape[1]):
            p = int(lengths[b]) + t
            out[int(tables[b, p // P]), p % P] = kv[b, t].to(pool.dtype)
    return out


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_writes_every_token_where_its_table_says(backend, dtype):
    pool, kv, tables, lengths = _inputs(dtype=dtype)
    want = _by_hand(pool, kv, tables, lengths)
    paged_store(pool, kv, tables, lengths, backend=backend)
    assert torch.equal(pool, want)


@needs_kernels
def test_strided_inputs_and_int32_tables():
    pool, kv, tables, lengths = _inputs(seed=1)
    wide = torch.randn(3, 4, 40, device=DEV)
    kv = wide[..., 5:29]                       # rows of 24 out of 40
    want = _by_hand(pool, kv, tables, lengths)
    paged_store(pool, kv, tables.int(), lengths.int(), backend="triton")
    assert torch.equal(pool, want)
    paged_store(pool, kv[:0], tables[:0], lengths[:0], backend="triton")   # nothing to write


@needs_kernels
def test_bad_inputs_are_named():
    pool, kv, tables, lengths = _inputs()
    with pytest.raises(ValueError, match="kv_BTW must be"):
        paged_store(pool, kv[..., :5], tables, lengths, backend="triton")
    with pytest.raises(ValueError, match="tables_BM must be"):
        paged_store(pool, kv, tables[:2], lengths, backend="triton")
    with pytest.raises(ValueError, match="lengths_B must be"):
        paged_store_torch(pool, kv, tables, lengths.float())
