"""CPU check of benchmarks/gluon_wy_probe.py (a Gluon probe of the forward's phase C, run on the H200): Gluon does
not run under the Triton interpreter, so each variant is compiled for sm_90 here, as the GPU would compile it."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("triton.experimental.gluon")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gluon_wy_probe.py")
SM90_SHARED_PER_SM, SM90_REGS_PER_SM = 233472, 65536


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("gluon_wy_probe_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_variant_compiles_for_sm90_and_fits_its_grid(probe):
    """No spill, and the CTAs per SM that the variant's grid asks for fit an H200 SM in shared memory and
    registers (a persistent grid that does not fit would run in two waves)."""
    for variant, cfg in probe.VARIANTS.items():
        r = probe.compile_sm90(variant)
        warps = cfg.warps + (probe.LOADER_WARPS.value if cfg.ws else 0)
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        assert cfg.ctas * (r["shared_bytes"] + 1024) <= SM90_SHARED_PER_SM, r
        assert cfg.ctas * r["registers"] * 32 * warps <= SM90_REGS_PER_SM, r
