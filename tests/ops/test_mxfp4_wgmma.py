"""Tests of the MXFP4 grouped matmul's Hopper kernel (kimik3/ops/moe/mxfp4_wgmma.py: a warp-specialised Gluon
kernel) against ``dequantize`` + a per-expert fp32 matmul, on x as given (renumbered by ``renumber_k``) and on x
already in the MMA's k order.

Gluon does not run under the Triton interpreter: on the CPU the kernel runs through tests/gluon_emulator.py (each
partition in a thread of its own, the TMA copies and mbarriers with Hopper's rules, every load and store
bounds-checked, the inline PTX and wgmma emulated with the GPU's rounding; ``renumber_k``, a Triton kernel, runs
under TRITON_INTERPRET=1); a compile for sm_90 in its own process checks what the emulator cannot: that the layout
conversions are trivial (asserted in the kernel), that nothing spills within the register budget that lets two
programs share an SM, and the ring's shared memory. On a Hopper GPU the same cases run on the device, and one more
at K3's sizes: the emulator computes a wgmma when it is issued, so a ring slot handed back while a wgmma still reads
it shows only there, with many programs an SM.

Cases: every rows a pass (8, 16, 32, 64); more rows an expert than a pass (several passes, the wider passes of 2 BR
and of 64 + 16); empty experts first, in the middle and last; partial column tiles (O not a multiple of 128) and
partial K steps (I a multiple of 32, not of 128); rows past offsets[-1] (zeros); every E2M1 code under many scale
codes (the decode bit for bit); scale code 255 (NaN); strided inputs; offsets out of range (in bounds).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from kimik3.ops.moe import mxfp4_wgmma as wg  # noqa: E402
from kimik3.ops.moe.mxfp4_grouped_mm import wgmma_available  # noqa: E402
from tests.kernel_testing import ON_GPU, interpreter_setup, needs_kernels  # noqa: E402,F401
from tests.ops.test_mxfp4_grouped_mm import (assert_close_to_reference,  # noqa: E402
                                             check_every_code_decodes_exactly,
                                             check_nan_scale_poisons_its_column_of_its_expert,
                                             check_offsets_out_of_range_stay_in_bounds, check_strided_inputs,
                                             offsets_of, rows, weights)

DEV = "cuda" if ON_GPU else "cpu"
pytestmark = [needs_kernels, pytest.mark.skipif(ON_GPU and not wgmma_available(torch.device("cuda")),
                                                reason="mxfp4_wgmma runs on Hopper")]


def run(x, mx_or_codes, scales=None, offsets=None, mma_order=False):
    """The kernel on this machine: the GPU, or the emulator on the CPU."""
    codes = mx_or_codes.codes if scales is None else mx_or_codes
    scales = mx_or_codes.scales if scales is None else scales
    if ON_GPU:
        return wg.mxfp4_wgmma(x, codes, scales, offsets, mma_order=mma_order)
    torch.set_flush_denormal(False)   # (the emulator's bf16 products keep subnormals, as the GPU's)
    from tests.gluon_emulator import emulate

    return wg.mxfp4_wgmma(x, codes, scales, offsets, mma_order=mma_order, launcher=emulate)


# (E, I, O, rows an expert): rows a pass BR the mean's next power of two from 8 to 64; an expert of more than BR
# rows takes passes of 2 BR below 64 at a mean over half of BR, and of 64 + 16 at 64 at a mean over 48
CASES = [
    (4, 96, 40, [3, 0, 7, 1]),          # 8 a pass, none over: empty middle expert; one partial K step; partial
                                        # column tile
    (5, 416, 16, [0, 20, 0, 0, 0]),     # 8 a pass (4 on average: no wider passes): 20 in three passes of 8; empty
                                        # first and last; 3 steps + 32
    (3, 128, 24, [11, 0, 4]),           # 8 a pass (5 on average): 11 in one pass of 16, 4 in one of 8
    (3, 160, 24, [0, 20, 5]),           # 16 a pass (9 on average): 20 in one pass of 32, 5 in one of 16; partial K step
    (2, 256, 72, [40, 9]),              # 32 a pass (25 on average): 40 in one pass of 64; partial column tile
    (3, 384, 136, [70, 0, 20]),         # 32 a pass (30 on average): 70 in two passes of 64, 20 in one of 32;
                                        # 3 K steps; two column tiles, the second partial
    (3, 160, 72, [70, 0, 30]),          # 64 a pass (34 on average: no wider passes): 70 in two passes of 64;
                                        # partial K step
    (4, 160, 72, [75, 0, 60, 62]),      # 64 a pass (50 on average): 75 in one pass of 64 + 16 (the tail's
                                        # accumulator), 60 and 62 in one of 64; partial K step
    (2, 160, 72, [130, 70]),            # 64 a pass (the most): 130 in two passes of 64 + 16, 70 in one
]


@pytest.fixture(params=[1, 2], ids=["64-columns", "128-columns"])
def consumers(request, monkeypatch):
    """The consumer warpgroups a program (``wgmma_tile``'s choice, forced through its waves threshold)."""
    monkeypatch.setattr(wg, "WGMMA_WAVES", 10 ** 9 if request.param == 1 else 0)
    return request.param


@pytest.mark.parametrize("E, I, O, counts", CASES)
def test_matches_the_reference(E, I, O, counts, consumers):
    mx = weights(E, I, O)
    offsets = offsets_of(counts)
    x = rows(sum(counts) + 3, I, torch.bfloat16)          # 3 rows past the last offset: zeros
    y = run(x, mx, offsets=offsets)
    assert_close_to_reference(y, x, mx, offsets)
    assert torch.equal(y[sum(counts):], torch.zeros_like(y[sum(counts):]))


@pytest.mark.parametrize("E, I, O, counts", [CASES[0], CASES[5]])
def test_x_in_the_mma_order(E, I, O, counts, consumers):
    """x given as ``mxfp8_rows`` writes it (each step permuted, padded to whole steps): the same products."""
    from kimik3.ops.moe.mxfp8_rows import mma_k_order_reference

    mx = weights(E, I, O)
    offsets = offsets_of(counts)
    x = rows(sum(counts), I, torch.bfloat16)
    y = run(mma_k_order_reference(x).contiguous(), mx, offsets=offsets, mma_order=True)
    assert_close_to_reference(y, x, mx, offsets)


@pytest.mark.skipif(not ON_GPU, reason="K3's sizes run on the GPU (the emulator would take many minutes)")
@pytest.mark.parametrize("routing", ["uniform", "random"])
def test_k3_sizes_with_many_programs_an_sm(routing, consumers):
    """K3's down matmul (3,072 -> 3,584) over 14 local experts at 64 rows an expert, every expert the same rows or
    rows sent at random (50-76 an expert: passes of 64 + 16 for those over 64): each SM runs its full count of
    programs, each 24 K steps around the ring, so a slot handed back while a wgmma still reads it shows here (the
    small cases above leave the loader too little to run ahead)."""
    E, I, O = 14, 3072, 3584
    mx = weights(E, I, O)
    gen = torch.Generator().manual_seed(3)
    counts = [64] * E if routing == "uniform" else \
        torch.bincount(torch.randint(0, E, (64 * E,), generator=gen), minlength=E).tolist()
    offsets = offsets_of(counts)
    x = rows(64 * E, I, torch.bfloat16)
    assert_close_to_reference(run(x, mx, offsets=offsets), x, mx, offsets)


def test_tile_by_rows_an_expert_and_by_the_grid():
    sizes = (0, 8, 4 * 8, 5 * 8, 8 * 8, 8 * 8 + 1, 16 * 8, 16 * 8 + 1, 32 * 8, 32 * 8 + 1, 64 * 8, 4096)
    assert [wg.wgmma_tile(R, 8)[0] for R in sizes] == [8, 8, 8, 8, 8, 16, 16, 32, 32, 64, 64, 64]
    # the wide passes (twice the rows below 64 a pass, 64 + 16 at 64), where some expert can have more rows than a
    # pass and the mean is over half a pass (below 64) or three quarters (at 64)
    assert [wg.wgmma_tile(R, 8)[3] for R in sizes] == [False, False, False, True, True, True, True, True, True,
                                                       False, True, True]
    assert [wg.wgmma_tile(8 * r, 8)[3] for r in (48, 49)] == [False, True]
    assert wg.wgmma_tile(5, 0)[:4:3] == (8, False) and wg.wgmma_tile(9, 1)[:4:3] == (16, False)
    assert wg.wgmma_tile(9, 2)[:4:3] == (8, True)
    assert all(wg.wgmma_tile(R, 1)[1] >= 2 for R in (8, 16, 32, 64))
    # K3's 896 experts over 8 GPUs (112 local) take 128 columns a program, over 64 (14 local) 64 columns
    assert [wg.wgmma_tile(112, E, O, 132)[2] for E, O in ((112, 3072), (112, 3584), (112, 6144), (14, 3072),
                                                          (14, 3584), (14, 6144))] == [2, 2, 2, 1, 1, 1]
    assert [wg.wgmma_tile(112 * r, 112, 3072, 132)[2:] for r in (40, 64)] == [(2, False), (2, True)]


def test_every_code_decodes_exactly():
    """One-hot rows, 128 an expert (two passes of 64): y is W's rows bit for bit, with scale codes up to 163 (the
    decode's two multiplies) and with codes 2..128 only (one, 2^126 folded into the scale; from 2 up every value is
    a normal bf16, which the tensor cores take as it is)."""
    check_every_code_decodes_exactly(run)
    check_every_code_decodes_exactly(run, O=24, scale_codes=torch.arange(2 * 24 * 4) % 127 + 2)


def test_one_large_scale_code_takes_its_warpgroup_to_the_two_multiplies(consumers):
    """A scale code over 128 in one block of one weight column (its factor folded with 2^126 would not be a bf16):
    that column's warpgroup decodes with two multiplies, the others with one; every column close to the
    reference."""
    E, I, O = 2, 256, 136
    mx = weights(E, I, O)
    mx.scales.clamp_(max=128)
    mx.scales[1, 70, 3] = 131
    offsets = offsets_of([9, 40])
    x = rows(49, I, torch.bfloat16)
    assert_close_to_reference(run(x, mx, offsets=offsets), x, mx, offsets)


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


# (rows an expert) the kernel is compiled in: every rows a pass, 8 both without and with the passes of 16, 16 and 32
# with the passes of twice as many, 64 without and with the tail of 16 (40 and 64 on average); by default the
# smallest and the largest ring with the passes of 2 BR, 64 with and without its tail
COMPILE_ROWS_ALL = [4, 8, 16, 32, 40, 64]
COMPILE_ROWS = [8, 32, 40, 64]


def _compiled_tiles(per_expert_rows):
    """``wgmma_tile``'s (BR, S, NC, wide) for 8 experts at each of ``per_expert_rows`` with one consumer and with two
    where it allows two (as the compile step below runs them), each once."""
    tiles = []
    for waves in (10 ** 9, 0):
        saved, wg.WGMMA_WAVES = wg.WGMMA_WAVES, waves
        try:
            tiles += [t for t in (wg.wgmma_tile(8 * r, 8, 3072, 2) for r in per_expert_rows) if t not in tiles]
        finally:
            wg.WGMMA_WAVES = saved
    return tiles


def _check_compiled(rows_, per_expert_rows):
    """Each compiled form's shared memory is the ring, small enough for three programs an SM with one consumer and
    two with two; within ``WGMMA_MAXNREG`` registers, as many as fit those programs, and without spills."""
    tiles = _compiled_tiles(per_expert_rows)
    assert [tuple(row["tile"]) for row in rows_] == tiles
    for (per_pass, slots, consumers, wide), row in zip(tiles, rows_):
        x_rows = per_pass + (wg.WGMMA_TAIL if per_pass == 64 else per_pass) * wide
        ring = slots * (x_rows * 128 * 2 + consumers * wg.WGMMA_COLUMNS * 64)
        assert ring <= row["shared_bytes"] <= ring + 1024, row      # (+ the barriers)
        assert row["shared_bytes"] <= 227 * 1024 // (4 - consumers), row
        # (32 rows a pass with the passes of 64 compiled in, and 64 with the passes of 64 + 16, two consumers: one
        # 4-byte value spills at every split of the registers; the GPU timings include it)
        spill = 4 if (per_pass, wide, consumers) in ((32, True, 2), (64, True, 2)) else 0
        assert row["spill_store_bytes"] <= spill and row["spill_load_bytes"] <= spill, row
        assert row["registers"] <= wg.WGMMA_MAXNREG and row["num_warps"] == 4 * consumers + 4, row
        assert row["num_warps"] * 32 * row["registers"] * (4 - consumers) <= 65536, row


def test_wgmma_kernel_compiles_for_sm90(tmp_path):
    """In a process of its own, without the interpreter and with an empty Triton cache: the kernel compiles for
    sm_90 with one consumer warpgroup and with two (so its layout conversions are trivial: asserted at compile
    time) at ``COMPILE_ROWS`` (``_check_compiled``)."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    _check_compiled(last_json_line(run_without_interpreter(["-m", "tests.ops.test_mxfp4_wgmma"], tmp_path)),
                    COMPILE_ROWS)


@pytest.mark.slow
def test_wgmma_kernel_compiles_for_sm90_at_every_rows_a_pass(tmp_path):
    """``test_wgmma_kernel_compiles_for_sm90`` at every rows a pass, with and without the passes of 2 BR."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    _check_compiled(last_json_line(run_without_interpreter(["-m", "tests.ops.test_mxfp4_wgmma", "--all"], tmp_path)),
                    COMPILE_ROWS_ALL)


if __name__ == "__main__":  # the compile step of the two tests above
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    E, I, O = 8, 3584, 3072
    codes = torch.zeros(E, O, I // 2, dtype=torch.uint8)
    scales = torch.zeros(E, O, I // 32, dtype=torch.uint8)
    tiles = []
    for per_pass, slots, consumers, wide in _compiled_tiles(COMPILE_ROWS_ALL if "--all" in sys.argv else COMPILE_ROWS):
        # rows an expert that give this tile, its consumers forced through the waves threshold
        wg.WGMMA_WAVES = 10 ** 9 if consumers == 1 else 0
        R = next(8 * r for r in range(1, 65) if wg.wgmma_tile(8 * r, E, O, 2) == (per_pass, slots, consumers, wide))
        wg.mxfp4_wgmma(torch.zeros(R, I, dtype=torch.bfloat16), codes, scales,
                       torch.full((E,), R // E, dtype=torch.int32).cumsum(0).int(), mma_order=True,
                       launcher=lambda kernel, grid, *a, **kw: compiler(kernel, list(a), kw, grid))
        tiles.append([per_pass, slots, consumers, wide])
    print(json.dumps([{"tile": tile, **{k: row[k] for k in ("kernel", "registers", "num_warps", "shared_bytes",
                                                            "spill_store_bytes", "spill_load_bytes")}}
                      for tile, row in zip(tiles, compiler.rows)]))
