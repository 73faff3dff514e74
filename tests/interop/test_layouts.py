"""State-dict adapters to the released Hugging Face layout and torchtitan's port (kimik3/interop).

Round trips are checked bit for bit on the tiny preset with every parameter non-zero where it
matters (AttnRes queries, router biases); names and shapes against the table of
/work/shared/reference/k3-released-layout.md on the debug preset (torchtitan's debugmodel),
built on the meta device.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from kimik3.config.schema import K3Config, MTPConfig
from kimik3.interop import config_from_hf, from_hf, from_torchtitan, hf_config, to_hf, to_torchtitan
from kimik3.model.k3 import K3ForCausalLM

HF_LAYER = "language_model.model.layers.{}."
LAYOUTS = {"hf": (to_hf, from_hf), "torchtitan": (to_torchtitan, from_torchtitan)}


def _tiny_model(config: K3Config | None = None, dtype: torch.dtype | None = None) -> K3ForCausalLM:
    """A tiny model whose AttnRes queries and router biases are random (they initialise to zero)."""
    config = config or K3Config.preset("tiny")
    model = K3ForCausalLM(config, seed=0, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("query", "expert_bias")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    return model


@pytest.fixture(scope="module")
def tiny():
    model = _tiny_model()
    return model, {k: t.clone() for k, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def debug_meta():
    config = K3Config.preset("debug")
    return config, K3ForCausalLM(config, device="meta").state_dict()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bit_exact(tiny, layout):
    model, state = tiny
    export, load = LAYOUTS[layout]
    assert any(t.abs().sum() > 0 for k, t in state.items() if k.endswith("expert_bias"))
    assert any(t.abs().sum() > 0 for k, t in state.items() if k.endswith("query"))
    _assert_same(load(export(state, model.config), model.config), state)


def test_round_trip_bf16_keeps_dtypes():
    model = _tiny_model(dtype=torch.bfloat16)
    state = model.state_dict()
    hf = to_hf(state, model.config)
    assert hf["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert hf["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    assert hf["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    tt = to_torchtitan(state, model.config)
    assert tt["layers.1.moe.expert_bias_E"].dtype == torch.float32
    for export, load in LAYOUTS.values():
        _assert_same(load(export(state, model.config), model.config), state)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_model_gives_identical_logits(tiny, layout):
    model, state = tiny
    export, load = LAYOUTS[layout]
    other = K3ForCausalLM(model.config, seed=5)
    other.load_state_dict(load(export(state, model.config), model.config), strict=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(ids).logits
        got = other.eval()(ids).logits
    assert torch.equal(got, want)


def test_experts_and_reshaped_tensors_map_as_documented(tiny):
    model, state = tiny
    hf, tt = to_hf(state, model.config), to_torchtitan(state, model.config)
    gate_ELF = state["layers.1.ffn.experts.w_gate_ELF"]
    down_EFL = state["layers.1.ffn.experts.w_down_EFL"]
    # HF: one nn.Linear weight [out, in] per expert; torchtitan: stacked [E, out, in].
    assert torch.equal(hf[HF_LAYER.format(1) + "block_sparse_moe.experts.3.w1.weight"], gate_ELF[3].T)
    assert torch.equal(hf[HF_LAYER.format(1) + "block_sparse_moe.experts.3.w2.weight"], down_EFL[3].T)
    assert torch.equal(tt["layers.1.moe.routed_experts.inner_experts.w1_EFD"], gate_ELF.transpose(1, 2))
    assert torch.equal(tt["layers.1.moe.routed_experts.inner_experts.w2_EDF"], down_EFL.transpose(1, 2))
    conv = state["layers.1.mixer.q_conv"]
    assert torch.equal(hf[HF_LAYER.format(1) + "self_attn.q_conv1d.weight"][:, 0], conv)
    assert torch.equal(tt["layers.1.delta_attention.q_conv.weight"][:, 0], conv)
    assert torch.equal(hf[HF_LAYER.format(1) + "self_attn.dt_bias"], state["layers.1.mixer.dt_bias"].flatten())
    assert torch.equal(tt["layers.1.delta_attention.dt_bias"], state["layers.1.mixer.dt_bias"])
    assert torch.equal(tt["layers.2.attention_res_proj.weight"][0], state["layers.2.mixer_mix.query"])
    assert torch.equal(tt["layers.2.attention_res_norm.weight"], state["layers.2.mixer_mix.key_norm_weight"])
    assert torch.equal(hf["language_model.model.output_attn_res_proj.weight"][0], state["final_mix.query"])


# ------------------------------------------------------------------------------------------ names and shapes
def _torchtitan_debug_names(config: K3Config) -> set[str]:
    """torchtitan's text keys for the debug model, written from the reference table (not from the rules)."""
    names = {"tok_embeddings.weight", "norm.weight", "lm_head.weight", "output_res_norm.weight",
             "output_res_proj.weight"}
    for i in range(config.num_layers):
        per = ["attention_norm.weight", "ffn_norm.weight", "ffn_res_norm.weight", "ffn_res_proj.weight"]
        if i > 0:
            per += ["attention_res_norm.weight", "attention_res_proj.weight"]
        if i in config.mla_layer_indices:
            per += [f"attention.{n}.weight" for n in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b",
                                                      "gate", "wo")]
        else:
            per += [f"delta_attention.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv",
                                                            "v_conv", "forget_a", "forget_b", "beta", "output_gate",
                                                            "output_norm", "output_proj")]
            per += ["delta_attention.A_log", "delta_attention.dt_bias"]
        if i == 0:
            per += [f"feed_forward.{n}.weight" for n in ("w1", "w2", "w3")]
        else:
            per += ["moe.router.gate.weight", "moe.expert_bias_E", "moe.routed_down.weight", "moe.routed_norm.weight",
                    "moe.routed_up.weight", "moe.routed_experts.inner_experts.w1_EFD",
                    "moe.routed_experts.inner_experts.w3_EFD", "moe.routed_experts.inner_experts.w2_EDF",
                    "moe.shared_experts.w1.weight", "moe.shared_experts.w3.weight", "moe.shared_experts.w2.weight"]
        names |= {f"layers.{i}.{n}" for n in per}
    return names


def test_torchtitan_debugmodel_names_and_shapes(debug_meta):
    config, state = debug_meta
    assert config.mla_layer_indices == [3, 7, 11, 15, 19, 23]
    tt = to_torchtitan(state, config, include_mtp=False)
    assert set(tt) == _torchtitan_debug_names(config)
    # The reference's text parameter count (the router bias is a buffer, not a parameter).
    assert sum(t.numel() for k, t in tt.items() if not k.endswith("expert_bias_E")) == 984_166_816
    want = {
        "tok_embeddings.weight": (163_840, 1024),
        "lm_head.weight": (163_840, 1024),
        "output_res_proj.weight": (1, 1024),
        "layers.0.feed_forward.w1.weight": (4096, 1024),
        "layers.0.feed_forward.w2.weight": (1024, 4096),
        "layers.1.delta_attention.q_proj.weight": (1024, 1024),
        "layers.1.delta_attention.q_conv.weight": (1024, 1, 4),
        "layers.1.delta_attention.forget_a.weight": (64, 1024),
        "layers.1.delta_attention.forget_b.weight": (1024, 64),
        "layers.1.delta_attention.beta.weight": (16, 1024),
        "layers.1.delta_attention.output_gate.weight": (1024, 1024),
        "layers.1.delta_attention.output_norm.weight": (64,),
        "layers.1.delta_attention.output_proj.weight": (1024, 1024),
        "layers.1.delta_attention.A_log": (16,),
        "layers.1.delta_attention.dt_bias": (16, 64),
        "layers.1.attention_res_norm.weight": (1024,),
        "layers.1.attention_res_proj.weight": (1, 1024),
        "layers.3.attention.wq_a.weight": (512, 1024),
        "layers.3.attention.q_norm.weight": (512,),
        "layers.3.attention.wq_b.weight": (16 * 96, 512),
        "layers.3.attention.wkv_a.weight": (256 + 32, 1024),
        "layers.3.attention.kv_norm.weight": (256,),
        "layers.3.attention.wkv_b.weight": (16 * (64 + 64), 256),
        "layers.3.attention.gate.weight": (16 * 64, 1024),
        "layers.3.attention.wo.weight": (1024, 16 * 64),
        "layers.3.moe.router.gate.weight": (32, 1024),
        "layers.3.moe.expert_bias_E": (32,),
        "layers.3.moe.routed_down.weight": (512, 1024),
        "layers.3.moe.routed_norm.weight": (512,),
        "layers.3.moe.routed_up.weight": (1024, 512),
        "layers.3.moe.routed_experts.inner_experts.w1_EFD": (32, 384, 512),
        "layers.3.moe.routed_experts.inner_experts.w3_EFD": (32, 384, 512),
        "layers.3.moe.routed_experts.inner_experts.w2_EDF": (32, 512, 384),
        "layers.3.moe.shared_experts.w1.weight": (768, 1024),
        "layers.3.moe.shared_experts.w3.weight": (768, 1024),
        "layers.3.moe.shared_experts.w2.weight": (1024, 768),
    }
    assert {k: tuple(tt[k].shape) for k in want} == want
    assert tt["layers.3.moe.expert_bias_E"].dtype == torch.float32


def test_hf_debugmodel_names_and_shapes(debug_meta):
    config, state = debug_meta
    hf = to_hf(state, config, include_mtp=False)
    tt = to_torchtitan(state, config, include_mtp=False)
    # One HF key per torchtitan key, except the per-expert split and layer 0's unused AttnRes pair.
    stacked = sum(1 for k in tt if "inner_experts" in k)
    assert len(hf) == len(tt) - stacked + stacked * config.moe.num_experts + 2
    layer = HF_LAYER.format
    want = {
        "language_model.model.embed_tokens.weight": (163_840, 1024),
        "language_model.lm_head.weight": (163_840, 1024),
        "language_model.model.norm.weight": (1024,),
        "language_model.model.output_attn_res_norm.weight": (1024,),
        "language_model.model.output_attn_res_proj.weight": (1, 1024),
        layer(0) + "self_attention_res_norm.weight": (1024,),
        layer(0) + "self_attention_res_proj.weight": (1, 1024),
        layer(0) + "mlp.gate_proj.weight": (4096, 1024),
        layer(0) + "mlp.up_proj.weight": (4096, 1024),
        layer(0) + "mlp.down_proj.weight": (1024, 4096),
        layer(0) + "input_layernorm.weight": (1024,),
        layer(0) + "post_attention_layernorm.weight": (1024,),
        layer(0) + "mlp_res_norm.weight": (1024,),
        layer(0) + "mlp_res_proj.weight": (1, 1024),
        layer(1) + "self_attn.q_conv1d.weight": (1024, 1, 4),
        layer(1) + "self_attn.f_a_proj.weight": (64, 1024),
        layer(1) + "self_attn.f_b_proj.weight": (1024, 64),
        layer(1) + "self_attn.b_proj.weight": (16, 1024),
        layer(1) + "self_attn.g_proj.weight": (1024, 1024),
        layer(1) + "self_attn.o_norm.weight": (64,),
        layer(1) + "self_attn.o_proj.weight": (1024, 1024),
        layer(1) + "self_attn.A_log": (16,),
        layer(1) + "self_attn.dt_bias": (1024,),
        layer(3) + "self_attn.q_a_proj.weight": (512, 1024),
        layer(3) + "self_attn.q_a_layernorm.weight": (512,),
        layer(3) + "self_attn.q_b_proj.weight": (1536, 512),
        layer(3) + "self_attn.kv_a_proj_with_mqa.weight": (288, 1024),
        layer(3) + "self_attn.kv_a_layernorm.weight": (256,),
        layer(3) + "self_attn.kv_b_proj.weight": (2048, 256),
        layer(3) + "self_attn.g_proj.weight": (1024, 1024),
        layer(3) + "self_attn.o_proj.weight": (1024, 1024),
        layer(3) + "block_sparse_moe.gate.weight": (32, 1024),
        layer(3) + "block_sparse_moe.gate.e_score_correction_bias": (32,),
        layer(3) + "block_sparse_moe.routed_expert_down_proj.weight": (512, 1024),
        layer(3) + "block_sparse_moe.routed_expert_norm.weight": (512,),
        layer(3) + "block_sparse_moe.routed_expert_up_proj.weight": (1024, 512),
        layer(3) + "block_sparse_moe.experts.31.w1.weight": (384, 512),
        layer(3) + "block_sparse_moe.experts.31.w3.weight": (384, 512),
        layer(3) + "block_sparse_moe.experts.31.w2.weight": (512, 384),
        layer(3) + "block_sparse_moe.shared_experts.gate_proj.weight": (768, 1024),
        layer(3) + "block_sparse_moe.shared_experts.up_proj.weight": (768, 1024),
        layer(3) + "block_sparse_moe.shared_experts.down_proj.weight": (1024, 768),
        layer(23) + "self_attn.kv_b_proj.weight": (2048, 256),
        layer(1) + "self_attention_res_proj.weight": (1, 1024),
    }
    assert {k: tuple(hf[k].shape) for k in want} == want
    assert not any(k.startswith(layer(0) + "self_attn.q_a") for k in hf)
    assert all(k.startswith("language_model.") for k in hf)


def test_mtp_goes_under_its_own_prefix(tiny):
    model, state = tiny
    hf, tt = to_hf(state, model.config), to_torchtitan(state, model.config)
    assert torch.equal(hf["language_model.kimik3_mtp.block.self_attn.q_a_proj.weight"],
                       state["mtp.block.mixer.wq_a.weight"])
    assert torch.equal(hf["language_model.kimik3_mtp.proj.weight"], state["mtp.proj.weight"])
    assert torch.equal(tt["kimik3_mtp.block.moe.expert_bias_E"], state["mtp.block.ffn.router.expert_bias"])
    mtp_keys = [k for k in state if k.startswith("mtp.")]
    for layout, (export, load) in LAYOUTS.items():
        without = export(state, model.config, include_mtp=False)
        assert not any("kimik3_mtp" in k for k in without)
        with pytest.raises(ValueError, match="mtp.num_modules"):
            load(without, model.config)
        plain = dataclasses.replace(model.config, mtp=MTPConfig(num_modules=0))
        _assert_same(load(without, plain), {k: t for k, t in state.items() if k not in mtp_keys})


# ------------------------------------------------------------------------------------------ placeholders, tying
def test_hf_layer0_attn_res_written_and_dropped(tiny):
    model, state = tiny
    hf = to_hf(state, model.config)
    norm, proj = (HF_LAYER.format(0) + f"self_attention_res_{n}.weight" for n in ("norm", "proj"))
    assert torch.equal(hf[norm], torch.ones(model.config.dim))
    assert torch.equal(hf[proj], torch.zeros(1, model.config.dim))
    assert not any(k.startswith("layers.0.mixer_mix") for k in state)
    # Whatever they hold, they are dropped; absent is fine too.
    changed = dict(hf, **{norm: torch.randn(model.config.dim), proj: torch.randn(1, model.config.dim)})
    _assert_same(from_hf(changed, model.config), state)
    _assert_same(from_hf({k: t for k, t in hf.items() if k not in (norm, proj)}, model.config), state)
    with pytest.raises(ValueError, match=re.escape(proj)):
        from_hf(dict(hf, **{proj: torch.zeros(model.config.dim)}), model.config)
    assert not any("attention_res" in k and "layers.0." in k for k in to_torchtitan(state, model.config))


def test_tied_embeddings():
    config = dataclasses.replace(K3Config.preset("tiny"), tie_embeddings=True)
    state = _tiny_model(config).state_dict()
    assert "lm_head.weight" not in state
    hf, tt = to_hf(state, config), to_torchtitan(state, config)
    assert "language_model.lm_head.weight" not in hf
    assert torch.equal(tt["lm_head.weight"], tt["tok_embeddings.weight"])
    assert hf_config(config)["tie_word_embeddings"] is True
    _assert_same(from_hf(hf, config), state)
    _assert_same(from_torchtitan(tt, config), state)
    embed = hf["language_model.model.embed_tokens.weight"]
    _assert_same(from_hf(dict(hf, **{"language_model.lm_head.weight": embed.clone()}), config), state)
    with pytest.raises(ValueError, match="lm_head"):
        from_torchtitan(dict(tt, **{"lm_head.weight": tt["lm_head.weight"] + 1}), config)


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_errors_name_the_key(tiny, layout):
    model, state = tiny
    export, load = LAYOUTS[layout]
    theirs = export(state, model.config)
    missing = next(k for k in theirs if k.endswith("dt_bias"))
    with pytest.raises(ValueError, match=re.escape(missing)):
        load({k: t for k, t in theirs.items() if k != missing}, model.config)
    with pytest.raises(ValueError, match=re.escape("layers.2.surprise.weight")):
        load(dict(theirs, **{"layers.2.surprise.weight": torch.zeros(3)}), model.config)
    wrong = next(k for k in theirs if "w2" in k and k.endswith(("w2.weight", "w2_EDF")) and "experts" in k)
    with pytest.raises(ValueError, match=re.escape(wrong) + r": got .*expected"):
        load(dict(theirs, **{wrong: theirs[wrong].transpose(-1, -2)}), model.config)
    vision = "vision_tower.x.weight" if layout == "hf" else "vision_encoder.x.weight"
    with pytest.raises(ValueError, match="drop_vision=True"):
        load(dict(theirs, **{vision: torch.zeros(2)}), model.config)
    _assert_same(load(dict(theirs, **{vision: torch.zeros(2)}), model.config, drop_vision=True), state)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_checks_our_state_dict(tiny, layout):
    model, state = tiny
    export = LAYOUTS[layout][0]
    with pytest.raises(ValueError, match=re.escape("layers.4.mixer.q_conv")):
        export({k: t for k, t in state.items() if k != "layers.4.mixer.q_conv"}, model.config)
    with pytest.raises(ValueError, match=re.escape("layers.4.mixer.bogus")):
        export(dict(state, **{"layers.4.mixer.bogus": torch.zeros(1)}), model.config)
    with pytest.raises(ValueError, match=re.escape("layers.4.mixer.dt_bias")):
        export(dict(state, **{"layers.4.mixer.dt_bias": state["layers.4.mixer.dt_bias"].flatten()}), model.config)
    with pytest.raises(ValueError, match="missing keys"):  # a state dict of another config
        export(state, K3Config.preset("debug"))


# ------------------------------------------------------------------------------------------ config.json
@pytest.mark.parametrize("preset", ["tiny", "debug", "k3"])
def test_config_round_trip(preset):
    config = K3Config.preset(preset)
    hf = hf_config(config, torch.bfloat16)
    assert json.loads(json.dumps(hf)) == hf
    assert config_from_hf(hf) == config
    assert config_from_hf(json.loads(json.dumps(hf))) == config


def test_hf_config_fields():
    config = K3Config.preset("debug")
    hf = hf_config(config, torch.float32)
    assert hf["model_type"] == "kimi_k3" and hf["architectures"] == ["KimiK3ForCausalLM"]
    assert hf["torch_dtype"] == "float32"
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]) == (1024, 24, 163_840)
    assert (hf["num_attention_heads"], hf["intermediate_size"], hf["max_position_embeddings"]) == (16, 4096, 16_384)
    assert (hf["num_experts"], hf["num_experts_per_token"], hf["moe_intermediate_size"]) == (32, 4, 384)
    assert (hf["routed_expert_hidden_size"], hf["first_k_dense_replace"], hf["attn_res_block_size"]) == (512, 1, 12)
    assert hf["rms_norm_eps"] == 1e-5 and hf["tie_word_embeddings"] is False
    assert hf["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24]  # one-based
    assert len(hf["linear_attn_config"]["kda_layers"]) == 18


@pytest.mark.parametrize("preset", ["debug", "k3"])
def test_config_from_hf_fields_alone(preset):
    config = K3Config.preset(preset)
    hf = hf_config(config)
    del hf["kimik3_config"]
    built = config_from_hf(hf, name=preset)
    # The HF fields carry everything but MTP (the released layout has none).
    assert built == dataclasses.replace(config, mtp=MTPConfig(num_modules=0))
    assert config_from_hf({"text_config": hf, "model_type": "kimi_k3"}, name=preset) == built


def test_config_from_hf_refuses_what_it_cannot_map():
    hf = hf_config(K3Config.preset("debug"))
    fields = {k: v for k, v in hf.items() if k != "kimik3_config"}
    with pytest.raises(ValueError, match="moe_renormalize"):
        config_from_hf(dict(fields, moe_renormalize=False))
    with pytest.raises(ValueError, match="quantization_config"):
        config_from_hf(dict(fields, quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(ValueError, match="'q_lora_rank' is missing"):
        config_from_hf({k: v for k, v in fields.items() if k != "q_lora_rank"})
    with pytest.raises(ValueError, match="kda_layers"):
        config_from_hf(dict(fields, linear_attn_config=dict(fields["linear_attn_config"], kda_layers=[1, 2])))
    with pytest.raises(ValueError, match="hidden_size"):  # a field that contradicts the embedded config
        config_from_hf(dict(hf, hidden_size=2048))
