"""CPU check of benchmarks/gluon_wy_probe.py (a Gluon probe of the forward's phase C, run on the H200): Gluon does
not run under the Triton interpreter, so each variant is compiled for sm_90 here, as the GPU would compile it, and
run through the Gluon emulator (tests/gluon_emulator.py) against phase C in torch."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "gluon_wy_probe.py")
SM90_SHARED_PER_SM, SM90_REGS_PER_SM = 233472, 65536


def test_every_variant_compiles_for_sm90_and_fits_its_grid(tmp_path):
    """Compiled in a process of its own, without the interpreter the test session switches on and with an empty
    Triton cache (as in CI): no spill, and the CTAs per SM that each variant's grid asks for fit an H200 SM in
    shared memory and registers (a persistent grid that does not fit would run in two waves)."""
    from tests.gluon_emulator import run_without_interpreter

    run_without_interpreter([SCRIPT, "--compile", "--out", str(tmp_path)], tmp_path)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gluon_wy_probe as probe  # the variant table (importing compiles nothing)

    rows = {r["variant"]: r for r in json.loads((tmp_path / "gluon_wy_probe.json").read_text())["rows"]}
    assert sorted(rows) == sorted(probe.VARIANTS)
    for variant, cfg in probe.VARIANTS.items():
        r = rows[variant]
        warps = cfg.warps + (probe.LOADER_WARPS.value if cfg.ws else 0)
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        assert cfg.ctas * (r["shared_bytes"] + 1024) <= SM90_SHARED_PER_SM, r
        assert cfg.ctas * r["registers"] * 32 * warps <= SM90_REGS_PER_SM, r


def test_every_variant_emulated_equals_phase_c_in_torch():
    """Each variant (persistent, staged TMA stores, warp-specialised with a loader partition) on the CPU, three
    programs over eight items, so every ring wraps and the programs take unequal counts: W, qg, kg within one bf16
    rounding of the torch reference, U and exp(Gamma_C) to fp32 rounding."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gluon_wy_probe as probe

    for variant, errs in probe.emulate_variants(T=128, H=2, K=128, programs=3).items():
        assert all(errs[n] <= 1 for n in ("w", "qg", "kg")), (variant, errs)
        assert errs["u"] < 1e-5 and errs["eg"] < 1e-6, (variant, errs)
