"""Smoke test of benchmarks/serve_k3_layers.py (the per-layer K3 decode estimate, run on an H200): the whole script
at tiny scale on the CPU (eager timing), checking the JSON it writes, and its arithmetic at K3's scale (memory, the
all-to-all model, the layer counts), which needs no module."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_k3_layers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_k3_layers_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_k3_layers") / "tiny.json"
    rc = bench.main(["--device", "cpu", "--scale", "tiny", "--gpus", "2", "--batches", "1,4", "--context", "40",
                     "--block-size", "16", "--iters", "2", "--warmup", "1", "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_tiny_run_times_every_layer_kind_at_every_batch(tiny_run):
    rc, data = tiny_run
    assert rc == 0
    rows = data["rows"]
    kinds = {(r["layer"], r["batch"], r.get("node_tokens")) for r in rows}
    for kind in ("kda", "mla", "dense", "glue", "head"):
        assert {(kind, 1, None), (kind, 4, None)} <= kinds
    # MoE: the node's G*B tokens' rows at each batch, plus the single stream (one token on the node).
    assert {("moe", 1, 2), ("moe", 4, 8), ("moe", 1, 1)} <= kinds
    assert len(rows) == 13
    for r in rows:
        assert r["us"] > 0 and r["mode"] == "eager" and r["why"]
        assert r["bytes_total"] == sum(r["bytes"].values()) > 0
        assert math.isclose(r["floor_us"], r["bytes_total"] / 4.2e12 * 1e6)
        assert math.isclose(r["ratio"], r["us"] / r["floor_us"])
    moe = {r["node_tokens"]: r for r in rows if r["layer"] == "moe"}
    assert moe[8]["local_experts"] == 8 and moe[8]["rows"] == 8     # tiny: 16 experts top-2 over 2 GPUs
    assert 1 <= moe[1]["experts_hit"] <= moe[8]["experts_hit"] <= 8
    mla = next(r for r in rows if r["layer"] == "mla" and r["batch"] == 4)
    assert mla["context"] == 40 and mla["bytes"]["latents read"] == 4 * 41 * 48 * 2   # 32 + 16 values, bf16
    assert data["run"]["scale"] == "tiny" and data["run"]["batches"] == [1, 4] and data["not_graph_safe"] == []


def test_tiny_run_adds_the_rows_up_into_the_estimate(tiny_run):
    _, data = tiny_run
    est = data["estimate"]
    assert est["layer_counts"] == {"layers": 9, "kda": 6, "mla": 3, "dense": 1, "moe": 8}
    assert est["assumptions"]["status"].startswith("assumed")
    points = est["per_batch"] + [est["single_stream"]]
    assert [(p["batch_per_gpu"], p["sequences_on_node"]) for p in points] == [(1, 2), (4, 8), (1, 1)]
    for p in points:
        assert p["missing"] == []
        assert math.isclose(p["step_ms"], sum(p["parts_us"].values()) / 1e3)
        assert math.isclose(p["tokens_per_s_node"], p["sequences_on_node"] / (p["step_ms"] * 1e-3))
        assert p["floor_step_ms_mxfp4_experts"] <= p["floor_step_ms"] <= p["step_ms"]
        assert math.isclose(p["parts_us"]["all-to-all (modelled)"], 8 * p["a2a_us_per_moe_layer"])
    # The single stream's MoE is the row with one node token; B=1 per GPU uses the row with G = 2.
    rows = {(r["layer"], r.get("node_tokens"), r["batch"]): r for r in data["rows"]}
    assert math.isclose(est["single_stream"]["parts_us"]["moe"], 8 * rows[("moe", 1, 1)]["us"])
    assert math.isclose(est["per_batch"][0]["parts_us"]["moe"], 8 * rows[("moe", 2, 1)]["us"])


def test_memory_arithmetic_says_k3_fits_no_8_gpu_node(bench, tiny_run):
    from kimik3 import K3Config

    mem = tiny_run[1]["memory"]              # always K3's, whatever the timed scale
    assert mem["params_total"] == 2_779_484_379_232 and mem["gpus"] == 8
    schemes = {(s["experts"], s["rest"]): s for s in mem["schemes"]}
    assert not any(s["fits_weights_sharded"] or s["fits_weights_attn_dp"] for s in schemes.values())
    assert schemes[("bf16", "bf16")]["total_gb"] > 5000
    assert schemes[("int4", "int4")]["total_gb"] > 8 * 141                       # even all-MXFP4 needs 2 nodes
    assert schemes[("int4", "fp8")]["min_gpus_weights_sharded"] == 16
    mem = bench.memory_arithmetic(K3Config.preset("k3"), 8, 141.0, 64, 8192)
    bf16 = next(s for s in mem["schemes"] if s["experts"] == "bf16")
    assert bf16["min_gpus_with_cache_attn_dp"] is None                           # 113 GB replicated + 64 caches


def test_k3_shapes_and_the_all_to_all_model(bench):
    from kimik3 import K3Config

    config = K3Config.preset("k3")
    assert bench.layer_counts(config) == {"layers": 93, "kda": 69, "mla": 24, "dense": 1, "moe": 92}
    assert bench.glue_entries(config) == 5
    shard = bench.shard_config(config, 8)
    assert (shard.moe.num_experts, shard.moe.top_k, shard.moe.shared_total_hidden) == (112, 2, 6144)
    assert shard.moe.num_experts * 3 * shard.moe.latent_dim * shard.moe.expert_hidden * 2 == 112 * 3 * 3584 * 3072 * 2
    with pytest.raises(ValueError):
        bench.shard_config(config, 3)
    rows_out = 64 * 16 * 7 / 8
    expected = 2 * 10.0 + rows_out * (3584 * 2 + 4 + 3584 * 2) / 450e9 * 1e6
    assert math.isclose(bench.a2a_us(64, config, 8, 10.0, 450.0), expected)
