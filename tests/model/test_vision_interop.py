"""The vision tower and projector under the released (HF) names and torchtitan's port's names."""

import pytest
import torch

from kimik3.config.schema import K3Config
from kimik3.interop.hf import from_hf, to_hf
from kimik3.interop.torchtitan import from_torchtitan, to_torchtitan
from kimik3.model.vision import K3VLForCausalLM
from kimik3.optim.muon import classify_parameters

from tests.model.test_vision import _small_vl_config


def test_released_vision_names_and_round_trip():
    config = _small_vl_config()
    model = K3VLForCausalLM(config, seed=0)
    ours = model.state_dict()
    hf = to_hf(ours, config)
    v = config.vision
    assert hf["vision_tower.patch_embed.proj.weight"].shape == (v.dim, 3, 14, 14)   # a conv, as released
    assert hf["vision_tower.encoder.blocks.1.wqkv.weight"].shape == (3 * v.qkv_dim, v.dim)
    for name in ("vision_tower.patch_embed.pos_emb.weight", "vision_tower.encoder.blocks.0.norm0.weight",
                 "vision_tower.encoder.blocks.0.norm1.weight", "vision_tower.encoder.blocks.0.wo.weight",
                 "vision_tower.encoder.blocks.0.mlp.fc0.weight", "vision_tower.encoder.blocks.0.mlp.fc1.weight",
                 "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                 "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"):
        assert name in hf, name
    assert torch.equal(hf["mm_projector.proj.2.weight"], ours["mm_projector.fc2.weight"])
    back = from_hf(hf, config)
    assert list(back) == list(ours) and all(torch.equal(back[k], ours[k]) for k in ours)

    tt = to_torchtitan(ours, config)
    q, k, vv = (tt[f"vision_encoder.layers.0.attn.w{x}.weight"] for x in "qkv")
    assert torch.equal(torch.cat([q, k, vv]), ours["vision_tower.blocks.0.attn.wqkv.weight"])
    assert "vision_encoder.projector.linear_1.weight" in tt and "vision_encoder.pos_embed" in tt
    back = from_torchtitan(tt, config)
    assert all(torch.equal(back[k], ours[k]) for k in ours)

    # A text-only config reads the multimodal checkpoint only when told to drop its vision keys.
    text_spec = config.to_dict()
    del text_spec["vision"]
    text_config = K3Config.from_dict(text_spec)
    with pytest.raises(ValueError, match="drop_vision"):
        from_hf(hf, text_config)
    assert set(from_hf(hf, text_config, drop_vision=True)) == {k for k in ours if not k.startswith(("vision_", "mm_"))}
    with pytest.raises(ValueError, match="vision tower"):
        from_hf(hf, config, drop_vision=True)


def test_vision_parameters_have_optimizer_rules():
    rules = classify_parameters(K3VLForCausalLM(_small_vl_config(), device="meta"))
    assert rules["vision_tower.pos_embed"].optimizer == "adamw"
    assert rules["vision_tower.blocks.0.attn.wqkv.weight"].split == ("rows", 3 * 2)
    assert rules["mm_projector.fc1.weight"].optimizer == "muon"


@pytest.mark.parametrize("layout", ["kimik3", "hf"])
def test_save_and_load_multimodal_model(tmp_path, layout):
    model = K3VLForCausalLM(_small_vl_config(), seed=0)
    model.save_pretrained(tmp_path, layout=layout)
    loaded = K3VLForCausalLM.from_pretrained(tmp_path)
    assert loaded.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
