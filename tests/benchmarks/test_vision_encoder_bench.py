"""Smoke test of benchmarks/vision_encoder.py (MoonViT-V2 encoder throughput, run on an H200): the whole script with
the tiny tower on small images on the CPU, checking the JSON it writes: batch sizes from the patch budget, token
counts from the image rule, and each image's packed output equal to its own forward."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kimik3.model.vision.tokens import num_image_tokens

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vision_encoder.py"


def test_vision_encoder_bench_runs_and_packs_exactly(tmp_path):
    spec = importlib.util.spec_from_file_location("vision_encoder_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "ve.json"
    assert bench.main(["--preset", "tiny-vl", "--sizes", "100", "224", "--mixed", "--device", "cpu", "--iters", "1",
                       "--warmup", "0", "--max-patches", "1024", "--json", str(out)]) == 0
    results = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"100x100", "224x224", "mixed"}
    # 100 px -> 4 x 4 merged cells = 8 x 8 patches: 16 images fill 1,024 patches; 224 px -> 16 x 16 patches: 4
    assert results["100x100"]["images"] == 16 and results["100x100"]["patches"] == 1024
    assert results["224x224"]["images"] == 4 and results["224x224"]["lm_tokens"] == 4 * num_image_tokens(224, 224)
    mixed = results["mixed"]
    assert mixed["images"] == 5 and mixed["lm_tokens"] == sum(num_image_tokens(h, w) for h, w in mixed["sizes"])
    for r in results.values():
        assert r["max_rel_diff_packed_vs_alone"] < 1e-5     # attention stays inside each image
        assert r["packed_ms"] > 0 and r["images_per_s"] > 0
