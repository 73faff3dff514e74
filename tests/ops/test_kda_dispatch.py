"""The KDA dispatch table (kimik3/ops/kda/dispatch.py): which implementation runs each stage, for which inputs, and
the printer that says so. Pure Python: no kernel runs here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3.ops.kda import dispatch
from kimik3.ops.kda.dispatch import FORWARD_STAGES, BACKWARD_STAGES, Call, explain, select

# K3's training shape on an H200: B1 T8192 H96 K = V = 128 in bf16 (128 chunks)
K3 = Call(capability=(9, 0), dtype=torch.bfloat16, K=128, V=128, H=96, chunks=128, grad=True, scale=128**-0.5,
          gluon=True)


def impls(call: Call) -> dict:
    return {stage: choice.impl for stage, choice in select(call).items()}


def test_every_stage_has_an_implementation_for_any_call():
    """Each stage's last row applies to everything, so no call is left without a kernel (the table cannot run dry)."""
    calls = [K3, dataclasses.replace(K3, capability=None), dataclasses.replace(K3, dtype=torch.float32, K=100, V=16),
             dataclasses.replace(K3, chunks=1, grad=False), dataclasses.replace(K3, gluon=False, capability=(8, 0))]
    for call in calls:
        got = impls(call)
        assert set(got) == {"forward", *FORWARD_STAGES, *BACKWARD_STAGES}, got


def test_k3_training_on_hopper_runs_the_gluon_stages():
    assert impls(K3) == {
        "forward": "64-token chunks", "prologue": "prologue", "intra": "intra", "solve": "solve", "wy": "gluon/wy",
        "scan": "gluon/scan", "bwd_scan": "gluon/bwd_scan", "bwd_wy": "gluon/bwd_wy", "bwd_intra": "gluon/bwd_intra",
        "suffix": "bwd_intra", "preact": "bwd_intra"}


def test_a_forward_alone_on_hopper_runs_on_16_token_tiles():
    assert impls(dataclasses.replace(K3, grad=False))["forward"] == "16-token tiles"
    # too few tiles to leave the host's launch cost behind: the 64-token stages, with the Gluon ones that apply
    small = dataclasses.replace(K3, grad=False, chunks=32, H=8)
    assert impls(small)["forward"] == "64-token chunks" and impls(small)["wy"] == "wy"


@pytest.mark.parametrize("change,stages,why", [
    (dict(capability=(8, 0)), ("wy", "scan", "bwd_scan", "bwd_wy", "bwd_intra"), "Hopper"),
    (dict(capability=(10, 0)), ("wy", "scan", "bwd_scan", "bwd_wy", "bwd_intra"), "Hopper"),
    (dict(gluon=False), ("wy", "scan", "bwd_scan", "bwd_wy", "bwd_intra"), "Gluon"),
    (dict(dtype=torch.float16), ("wy", "scan", "bwd_scan", "bwd_wy", "bwd_intra"), "bf16"),
    (dict(dtype=torch.float32), ("wy", "scan", "bwd_scan", "bwd_wy", "bwd_intra"), "bf16"),
    (dict(K=64, V=64), ("scan", "bwd_scan", "bwd_wy", "bwd_intra"), "128"),
    (dict(V=256), ("wy", "bwd_scan", "bwd_wy"), "K"),
    (dict(scale=0.0), ("bwd_scan",), "non-zero scale"),
    (dict(chunks=4, H=8), ("wy", "scan", "bwd_scan", "bwd_wy", "bwd_intra"), ">="),
])
def test_the_triton_stage_runs_where_a_gluon_one_does_not_apply(change, stages, why):
    """Each condition of a Gluon row sends its stage to the Triton kernel, and the printer names the reason."""
    call = dataclasses.replace(K3, **change)
    got = select(call)
    for stage in stages:
        assert not got[stage].impl.startswith("gluon/"), (stage, got[stage])
        assert any(why in reason for _, reason in got[stage].passed_over), (stage, got[stage].passed_over)


def test_gluon_thresholds_are_where_the_table_says():
    """The Gluon WY applies from GLUON_MIN_ITEMS (chunks x heads x 64-column blocks), the scans from
    GLUON_SCAN_MIN_ITEMS (chunks x heads x 64-column V blocks): one item below, the Triton kernel."""
    per_chunk = K3.H * 2  # K = V = 128: two 64-column blocks per (chunk, head)
    at = dataclasses.replace(K3, chunks=-(-dispatch.GLUON_SCAN_MIN_ITEMS // per_chunk))
    below = dataclasses.replace(K3, chunks=dispatch.GLUON_SCAN_MIN_ITEMS // per_chunk - 1)
    assert impls(at)["scan"] == "gluon/scan" and impls(below)["scan"] == "fwd_scan"
    at = dataclasses.replace(K3, chunks=-(-dispatch.GLUON_MIN_ITEMS // per_chunk))
    below = dataclasses.replace(K3, chunks=dispatch.GLUON_MIN_ITEMS // per_chunk - 1)
    assert impls(at)["wy"] == "gluon/wy" and impls(below)["wy"] == "wy"


def test_32_bit_offsets_keep_huge_calls_on_the_triton_kernels():
    """Stored states and dA whose row or element counts reach 2^31 do not go to the Gluon kernels (32-bit TMA
    coordinates and store offsets); a forward alone stores no states, so only Aqk's rows count there."""
    huge = dataclasses.replace(K3, chunks=-(-2**31 // (96 * 128)))  # NT H K = 2^31 rows of stored states
    assert impls(huge)["scan"] == "fwd_scan" and impls(huge)["bwd_wy"] == "bwd_wy"
    assert impls(dataclasses.replace(huge, grad=False))["forward"] == "16-token tiles"


def test_the_pre_activation_chain_rules_leave_the_intra_backward_above_k_128():
    assert impls(dataclasses.replace(K3, K=130))["preact"] == "preact_bwd"
    assert impls(dataclasses.replace(K3, K=100))["preact"] == "bwd_intra"


def test_explain_prints_every_stage_and_why(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    text = explain("cuda", (9, 0), torch.bfloat16, 1, 8192, 96, 128, 128, grad=True, gluon=True)
    for stage in (*FORWARD_STAGES, *BACKWARD_STAGES):
        assert f"\n  {stage} " in text, stage
    assert "gluon/bwd_wy" in text and "not 16-token tiles" in text
    text = explain("cuda", (8, 0), torch.bfloat16, 1, 2048, 8, 128, 128, grad=False, gluon=True)
    assert "bwd_scan" not in text and "not gluon/wy: needs a Hopper GPU (sm_90)" in text
    assert "backend    torch" in explain("cpu", None)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert "triton not installed" in explain("cuda", (9, 0))


def test_the_command_line_prints_the_table(capsys):
    assert dispatch.main(["--capability", "8.0", "--T", "1024", "--H", "4", "--grad"]) == 0
    out = capsys.readouterr().out
    assert "B=1 T=1024 H=4" in out and "training" in out
    with pytest.raises(SystemExit):
        dispatch.main(["--capability", "nine"])


def test_backend_choice(monkeypatch):
    """kda_backend: torch on the CPU, Triton on CUDA (chunk 64, triton installed); KIMIK3_KDA_BACKEND overrides;
    bad values and chunk sizes are refused by name."""
    x = torch.zeros(1, 1, 1, 16)
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)
    assert dispatch.kda_backend(x) == "torch"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")
    assert dispatch.kda_backend(x) == "torch"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match="'auto', 'torch' or 'triton'"):
        dispatch.kda_backend(x)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    with pytest.raises(ValueError, match="chunk_size 64"):
        dispatch.kda_backend(x, chunk_size=32, backend="triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="not installed"):
        dispatch.kda_backend(x, backend="triton")


def test_thresholds_let_the_gluon_kernels_take_small_calls_within_the_block():
    small = dataclasses.replace(K3, chunks=2, H=2)
    assert impls(small)["wy"] == "wy" and impls(small)["bwd_intra"] == "bwd_intra"
    with dispatch.thresholds(0, 0):
        got = impls(small)
        assert got["wy"] == "gluon/wy" and got["scan"] == "gluon/scan" and got["bwd_intra"] == "gluon/bwd_intra"
    assert impls(small)["wy"] == "wy"  # restored, the cache too
