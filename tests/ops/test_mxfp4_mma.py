"""Tests of the MXFP4 grouped matmul's mma.sync kernel (kimik3/ops/moe/mxfp4_mma.py, a Gluon kernel: the mma route
on GPUs without wgmma) against ``dequantize`` + a per-expert fp32 matmul.

Gluon does not run under the Triton interpreter: on the CPU the kernel runs through tests/gluon_emulator.py (every
load and store bounds-checked, the inline PTX and ``mma_v2`` emulated with the GPU's rounding), and a compile for
sm_90 in its own process checks what the emulator cannot: that the kernel's layout conversions are trivial (they
are asserted in the kernel: a compile error otherwise), that it uses no shared memory and spills nothing. On a GPU
the same cases run on the device.

Cases: experts empty first, in the middle and last; more rows an expert than a pass of 8 (several passes); partial
column tiles (O not a multiple of the tile) and partial K steps (I a multiple of 32, not of 128); several K steps;
every tile width (warps) and K step; rows past offsets[-1] (zeros); every E2M1 code under many scale codes (the
decode bit for bit); scale code 255 (NaN); strided inputs; offsets out of range (in bounds).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from kimik3.ops.moe import mxfp4_mma as mma  # noqa: E402
from tests.kernel_testing import ON_GPU  # noqa: E402
from tests.ops.test_mxfp4_grouped_mm import (assert_close_to_reference,  # noqa: E402
                                             check_every_code_decodes_exactly,
                                             check_nan_scale_poisons_its_column_of_its_expert,
                                             check_offsets_out_of_range_stay_in_bounds, check_strided_inputs,
                                             offsets_of, rows, weights)

DEV = "cuda" if ON_GPU else "cpu"


def run(x, mx_or_codes, scales=None, offsets=None):
    """The kernel on this machine: the GPU, or the emulator on the CPU."""
    codes = mx_or_codes.codes if scales is None else mx_or_codes
    scales = mx_or_codes.scales if scales is None else scales
    if ON_GPU:
        return mma.mxfp4_mma(x, codes, scales, offsets)
    from tests.gluon_emulator import emulate

    return mma.mxfp4_mma(x, codes, scales, offsets, launcher=emulate)


@pytest.fixture(params=[(4, 1), (1, 2)], ids=["4warps", "1warp-2steps"])
def tiles(request, monkeypatch):
    """The mma.sync form's tile (warps: 16 weight columns each; 128-element K steps a loop iteration)."""
    warps, steps = request.param
    monkeypatch.setattr(mma, "MMA_WARPS", warps)
    monkeypatch.setattr(mma, "MMA_STEPS", steps)
    return warps, steps


# (E, I, O, rows an expert)
CASES = [
    (4, 96, 40, [3, 0, 17, 1]),       # empty middle expert; 17 rows: 3 passes of 8; partial K step and tile
    (3, 416, 16, [0, 5, 0]),          # empty first and last; 3 full K steps and a partial one
    (2, 160, 24, [12, 20]),           # two and three passes; partial K step
]


@pytest.mark.parametrize("E, I, O, counts", CASES)
def test_mma_matches_the_reference(E, I, O, counts, tiles):
    mx = weights(E, I, O)
    offsets = offsets_of(counts)
    x = rows(sum(counts) + 3, I, torch.bfloat16)          # 3 rows past the last offset: zeros
    y = run(x, mx, offsets=offsets)
    assert_close_to_reference(y, x, mx, offsets)
    assert torch.equal(y[sum(counts):], torch.zeros_like(y[sum(counts):]))


@pytest.mark.parametrize("warps, steps", [(4, 1), (1, 2)])
def test_every_code_decodes_exactly(warps, steps, monkeypatch):
    """One-hot rows, 128 an expert (16 passes of 8), in two tiles: y is W's rows bit for bit."""
    monkeypatch.setattr(mma, "MMA_WARPS", warps)
    monkeypatch.setattr(mma, "MMA_STEPS", steps)
    check_every_code_decodes_exactly(run)


def test_nan_scale_poisons_its_column_of_its_expert():
    check_nan_scale_poisons_its_column_of_its_expert(lambda x, mx, offsets: run(x, mx, offsets=offsets))


def test_strided_inputs():
    check_strided_inputs(run)


def test_offsets_out_of_range_stay_in_bounds():
    check_offsets_out_of_range_stay_in_bounds(lambda x, mx, offsets: run(x, mx, offsets=offsets))


def test_no_rows():
    mx = weights(3, 32, 16)
    y = run(rows(0, 32, torch.bfloat16), mx, offsets=offsets_of([0, 0, 0]))
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


# (K steps, warps) the kernel is compiled in: the default tile and the tests' others
COMPILE_CONFIGS = [(mma.MMA_STEPS, mma.MMA_WARPS), (2, 1), (1, 1)]


def test_mma_kernel_compiles_for_sm90(tmp_path):
    """In a process of its own, without the interpreter and with an empty Triton cache: the kernel compiles for
    sm_90 in each configuration (so its layout conversions are trivial: asserted at compile time), with no spills
    and no shared memory."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    rows_ = last_json_line(run_without_interpreter(["-m", "tests.ops.test_mxfp4_mma"], tmp_path))
    assert len(rows_) == len(COMPILE_CONFIGS)
    for row in rows_:
        assert row["shared_bytes"] == 0, row
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, row
        assert row["registers"] <= 255, row


if __name__ == "__main__":  # the compile step of the test above
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    E, I, O = 8, 3584, 3072
    codes = torch.zeros(E, O, I // 2, dtype=torch.uint8)
    scales = torch.zeros(E, O, I // 32, dtype=torch.uint8)
    for steps, warps in COMPILE_CONFIGS:
        mma.MMA_WARPS, mma.MMA_STEPS = warps, steps
        mma.mxfp4_mma(torch.zeros(E * 8, I, dtype=torch.bfloat16), codes, scales,
                      torch.full((E,), 8, dtype=torch.int32).cumsum(0).int(),
                      launcher=lambda kernel, grid, *a, **kw: compiler(kernel, list(a), kw, grid))
    print(json.dumps([{k: row[k] for k in ("kernel", "registers", "num_warps", "shared_bytes", "spill_store_bytes",
                                           "spill_load_bytes")} for row in compiler.rows]))
