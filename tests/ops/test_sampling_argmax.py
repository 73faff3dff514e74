"""``kimik3.ops.sampling.row_argmax`` (the argmax over a vocabulary row, split into chunks) against
``torch.argmax``: exactly the same index, including ties inside a chunk and across chunks, NaN (the first NaN wins),
+inf, all -inf rows, a last chunk cut short, strided and 3-D inputs, bf16 and fp32; the backend's choice and its
errors. Without CUDA the kernels run under the Triton interpreter (tests/conftest.py), at small chunks so that a
row spans many of them."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.sampling import argmax_backend, row_argmax
from kimik3.ops.sampling.argmax import CHUNK, MAX_CHUNKS, MIN_WIDTH
from tests.kernel_testing import DEV, ON_GPU, interpreter_setup, needs_kernels  # noqa: F401 (interpreter_setup: autouse)


def _check(x, chunk):
    got = row_argmax(x, backend="triton", chunk=chunk)
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,V,chunk", [(1, 1, 16), (3, 100, 16), (5, 257, 32), (2, 64, 64)])
def test_random_rows_match_torch(dtype, rows, V, chunk):
    gen = torch.Generator().manual_seed(rows * V + chunk)
    x = (3 * torch.randn(rows, V, generator=gen)).to(device=DEV, dtype=dtype)
    _check(x, chunk)


@needs_kernels
def test_ties_nan_inf_and_empty_looking_rows():
    V, chunk = 100, 16   # seven chunks, the last cut short at 4 entries
    x = torch.randn(8, V, generator=torch.Generator().manual_seed(0))
    x[0, [5, 40, 70]] = 9.0                        # a tie across chunks: the first
    x[1, [33, 34]] = 9.0                           # a tie inside one chunk
    x[2, 97] = 9.0                                 # in the short last chunk
    x[3, [50, 20]] = float("nan")                  # NaN wins, the first of them
    x[3, 10] = float("inf")
    x[4, 60] = float("inf")                        # +inf above every finite value
    x[5] = float("-inf")                           # all -inf: index 0
    x[6, :] = 0.0                                  # all equal: index 0
    x[7, [99, 3]] = float("nan")                   # NaN in the first and the last chunk
    _check(x.to(DEV), chunk)
    _check(x.to(DEV).bfloat16(), chunk)


@needs_kernels
def test_strided_and_three_dimensional_inputs():
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 150, generator=gen).to(DEV)
    _check(wide[:, 7:140], 32)                     # rows strided by 150, each row contiguous
    _check(wide.t()[:100], 16)                     # each row strided: made contiguous first
    x = torch.randn(2, 3, 90, generator=gen).to(DEV)   # [B, K + 1, V], a verification's logits
    _check(x, 16)


@needs_kernels
def test_backend_choice_and_errors():
    x = torch.zeros(2, MIN_WIDTH, device=DEV)
    assert argmax_backend(x) == ("triton" if ON_GPU else "torch")
    assert argmax_backend(x[:, :MIN_WIDTH - 1]) == "torch"          # short rows: torch's reduction
    assert argmax_backend(x.double()) == "torch"
    assert argmax_backend(x, "torch") == "torch"
    with pytest.raises(ValueError, match="backend must be"):
        argmax_backend(x, "cuda")
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        row_argmax(x.double(), backend="triton")
    with pytest.raises(ValueError, match="power of two"):
        row_argmax(x, backend="triton", chunk=48)
    with pytest.raises(ValueError, match="empty"):
        row_argmax(torch.zeros(2, 0, device=DEV), backend="triton")
    with pytest.raises(ValueError, match="chunks of 16"):
        row_argmax(torch.zeros(1, 16 * MAX_CHUNKS + 1, device=DEV), backend="triton", chunk=16)
    assert row_argmax(torch.zeros(0, 40, device=DEV), backend="triton", chunk=16).shape == (0,)
    assert CHUNK * MAX_CHUNKS >= 163_840   # K3's vocabulary in one launch


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_k3_vocabulary_on_the_gpu_in_a_cuda_graph():
    x = torch.randn(4, 163_840, device="cuda", dtype=torch.bfloat16)
    x[2, 100_000] = 50.0
    row_argmax(x)   # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = row_argmax(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, x.argmax(-1))
