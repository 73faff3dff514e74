"""CPU check of benchmarks/gluon_wy_probe.py (a Gluon probe of the forward's phase C, run on the H200): Gluon does
not run under the Triton interpreter, so each variant is compiled for sm_90 here, as the GPU would compile it."""

from __future__ import annotations

import json
import os
import subprocess
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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, SCRIPT, "--compile", "--out", str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
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
