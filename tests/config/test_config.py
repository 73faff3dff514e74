import json

import pytest

from kimik3 import K3Config
from kimik3.config import KDAConfig


@pytest.mark.parametrize("name", ["k3", "debug", "tiny"])
def test_presets_round_trip_through_json(name, tmp_path):
    config = K3Config.preset(name)
    assert K3Config.from_json(config.to_json()) == config
    path = tmp_path / "c.json"
    config.to_json(path)
    assert K3Config.from_json(path) == config


def test_k3_layer_plan():
    config = K3Config.preset("k3")
    plan = config.layer_plan()
    assert len(plan) == 93
    mla = [s.index for s in plan if s.mixer == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]
    assert sum(s.mixer == "kda" for s in plan) == 69
    assert [s.index for s in plan if s.ffn == "dense"] == [0]
    assert sum(s.ffn == "moe" for s in plan) == 92
    # AttnRes partitions differently from the attention pattern: 8 blocks of 12, the last partial.
    assert config.num_attn_res_blocks == 8
    assert [s.index for s in plan if s.opens_block] == list(range(0, 93, 12))
    assert sum(s.attn_res_block == 7 for s in plan) == 9


def test_debug_and_tiny_plans():
    debug = K3Config.preset("debug")
    assert [s.index for s in debug.layer_plan() if s.mixer == "mla"] == [3, 7, 11, 15, 19, 23]
    tiny = K3Config.preset("tiny")
    assert [s.index for s in tiny.layer_plan() if s.mixer == "mla"] == [3, 7, 8]
    assert tiny.max_seq_len >= 8192


def _k3_dict(**changes):
    data = K3Config.preset("tiny").to_dict()
    for dotted, value in changes.items():
        target = data
        *parents, leaf = dotted.split("__")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return data


@pytest.mark.parametrize("changes, field", [
    (dict(kda__num_heads=3), "kda.num_heads"),            # 3 heads do not divide width 128
    (dict(moe__top_k=17), "moe.top_k"),                   # more than 16 experts
    (dict(mla_layers=[3, 9]), "mla_layers"),              # index beyond the 9 layers
    (dict(mla_layers=[3, 3]), "mla_layers"),              # duplicate
    (dict(num_layers=8), "trailing_mla"),                 # last layer 7 already MLA
    (dict(dense_layers=10), "dense_layers"),
    (dict(kda__g_min=-6.0), "kda.g_min"),                 # breaks the 16-token bf16 bound
    (dict(kda__chunk_size=40), "kda.chunk_size"),
    (dict(dim=0), "dim"),
    (dict(mtp__num_modules=2), "mtp.num_modules"),
    (dict(attn_res__block_size=0), "attn_res.block_size"),
])
def test_invalid_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        K3Config.from_dict(_k3_dict(**changes))


def test_unknown_preset_and_fields():
    with pytest.raises(ValueError, match="unknown preset"):
        K3Config.preset("k4")
    with pytest.raises(ValueError, match="'bogus'"):
        K3Config.from_dict({**_k3_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="'moe.bogus'"):
        data = _k3_dict()
        data["moe"]["bogus"] = 1
        K3Config.from_dict(data)


def test_malformed_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="malformed"):
        K3Config.from_json(bad)
    with pytest.raises(ValueError, match="does not exist"):
        K3Config.from_json(tmp_path / "missing.json")
    assert json.loads(K3Config.preset("tiny").to_json())["name"] == "tiny"


def test_derived_head_dim():
    config = K3Config.preset("tiny")
    assert config.kda.head_dim is None and config.kda_head_dim == config.dim // config.kda.num_heads
    assert isinstance(config.kda, KDAConfig)
