"""The released Kimi K3 Hugging Face layout: state dicts and ``config.json``.

Text keys sit under ``language_model.model.`` and the head is ``language_model.lm_head.weight``
(the released model wraps the text model with a vision tower). The per-tensor rules are in
``layout.py``; this module adds what is particular to Hugging Face:

- Layer 0 of the released checkpoint holds an AttnRes pair that its forward never uses
  (``self_attention_res_norm`` / ``_proj``; ours and torchtitan's have none): export writes it as
  ones / zeros, import drops it (its shape is still checked when present).
- Our MTP module goes under ``language_model.kimik3_mtp.`` (the released layout has no MTP keys).
- ``hf_config`` writes an HF-style config dict: the usual HF names, the text-config field names the
  released config uses (as torchtitan's parity script sets them: ``linear_attn_config`` with
  one-based layer indices, ``routed_expert_hidden_size`` for the latent width, ...), and our whole
  ``K3Config`` under ``kimik3_config`` so that ``config_from_hf(hf_config(c)) == c``.
- ``config_from_hf`` reads that embedded config when present (after checking the HF fields agree
  with it); otherwise it builds a config from the HF fields, refusing any it cannot represent.
"""

from __future__ import annotations

from typing import Any

import torch

from kimik3.config.schema import K3Config
from kimik3.interop.layout import ImportPlan, Layout, Tensor, export, import_, import_plan

MODEL_TYPE = "kimi_k3"
ARCHITECTURE = "KimiK3ForCausalLM"
EMBEDDED_KEY = "kimik3_config"
SITU_BETA_GATE, SITU_BETA_UP = 4.0, 25.0  # SiTU-GLU bounds, fixed in kimik3 (model/ffn.py)


def _layer0_attn_res(state_dict: dict[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """The released checkpoint's unused layer-0 mixer AttnRes pair: norm weight ones [D], proj zeros [1, D]."""
    if not config.attn_res.enabled:
        return {}
    like = state_dict["layers.0.ffn_mix.key_norm_weight"]
    prefix = "language_model.model.layers.0.self_attention_res_"
    return {prefix + "norm.weight": torch.ones_like(like),
            prefix + "proj.weight": torch.zeros_like(like).reshape(1, -1)}


HF_LAYOUT = Layout(
    name="hf",
    column=0,
    layer_prefix="language_model.model.layers.{i}.",
    mtp_prefix="language_model.kimik3_mtp.",
    write_tied_head=False,
    placeholders=_layer0_attn_res,
    vision_prefixes=("vision_tower.", "mm_projector."),
)


def to_hf(state_dict: dict[str, Tensor], config: K3Config, *, include_mtp: bool = True) -> dict[str, Tensor]:
    """Our state dict (``K3ForCausalLM.state_dict()``) -> the released Hugging Face layout.

    Tensors keep their dtype (the router bias is fp32); reshaped or per-expert tensors are new
    contiguous tensors, the rest are the given ones. ``include_mtp=False`` leaves out our MTP module.
    Raises ValueError when ``state_dict`` does not match ``config``.
    """
    return export(state_dict, config, HF_LAYOUT, include_mtp)


def from_hf(state_dict: dict[str, Tensor], config: K3Config, *, drop_vision: bool = False) -> dict[str, Tensor]:
    """A Hugging Face layout state dict -> ours, with exactly our model's keys (``load_state_dict(strict=True)``).

    Raises ValueError naming every missing key, unexpected key and shape mismatch; the only keys
    dropped are layer 0's unused AttnRes pair, a tied head equal to the embedding, and, with
    ``drop_vision``, the vision tower and projector.
    """
    return import_(state_dict, config, HF_LAYOUT, drop_vision)


def hf_import_plan(shapes: dict[str, tuple[int, ...]], config: K3Config, *, drop_vision: bool = False) -> ImportPlan:
    """``from_hf`` in two steps for a loader that reads one tensor at a time: the checks on names and shapes
    (``shapes``, e.g. from the shards' headers), and the plan that builds each of our tensors from its parts."""
    return import_plan(shapes, config, HF_LAYOUT, drop_vision)


# ---------------------------------------------------------------------------------------------- config.json
def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def hf_config(config: K3Config, dtype: torch.dtype | str = torch.bfloat16) -> dict[str, Any]:
    """An HF-style ``config.json`` dict for ``config`` with weights in ``dtype``."""
    kda, mla, moe = config.kda, config.mla, config.moe
    mla_layers = set(config.mla_layer_indices)
    out: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "torch_dtype": _dtype_name(dtype),
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.num_layers,
        "max_position_embeddings": config.max_seq_len,
        "intermediate_size": config.dense_hidden,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "num_attention_heads": mla.num_heads,
        "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "activation_situ_beta": SITU_BETA_GATE,
        "activation_situ_linear_beta": SITU_BETA_UP,
        "num_experts": moe.num_experts,
        "num_experts_per_token": moe.top_k,
        "num_shared_experts": moe.num_shared_experts,
        # Not a released field: the released shared width is num_shared_experts x moe_intermediate_size,
        # which ours need not be.
        "shared_expert_intermediate_size": moe.shared_total_hidden,
        "moe_renormalize": True,
        "moe_intermediate_size": moe.expert_hidden,
        "routed_expert_hidden_size": moe.latent_dim,
        "routed_scaling_factor": moe.route_scale,
        "first_k_dense_replace": config.dense_layers,
        "linear_attn_config": {
            # One-based layer indices, as the released config counts them.
            "full_attn_layers": [i + 1 for i in range(config.num_layers) if i in mla_layers],
            "kda_layers": [i + 1 for i in range(config.num_layers) if i not in mla_layers],
            "head_dim": config.kda_head_dim,
            "num_heads": kda.num_heads,
            "short_conv_kernel_size": kda.conv_kernel,
            "gate_lower_bound": kda.g_min,
            "use_full_rank_gate": True,
        },
    }
    if config.attn_res.enabled:  # the released model always has AttnRes; without it only kimik3_config says so
        out["attn_res_block_size"] = config.attn_res.block_size
    out[EMBEDDED_KEY] = config.to_dict()
    return out


def config_from_hf(hf: dict[str, Any], *, name: str = "from_hf") -> K3Config:
    """A ``K3Config`` from an HF-style config dict (``hf_config``'s, or the released one, flat or with its
    text fields under ``text_config``). ``name`` names a config built from the HF fields."""
    if not isinstance(hf, dict):
        raise ValueError(f"config_from_hf: expected a dict, got {type(hf).__name__}")
    if EMBEDDED_KEY in hf:
        config = K3Config.from_dict(hf[EMBEDDED_KEY])
        _check_agrees(hf, config)
        return config
    return _from_fields(hf.get("text_config", hf), name)


def _check_agrees(hf: dict[str, Any], config: K3Config) -> None:
    """Every HF field that ``hf_config`` derives from ``config`` must hold the same value in ``hf``."""
    derived = hf_config(config)
    for key, value in derived.items():
        if key in (EMBEDDED_KEY, "torch_dtype") or key not in hf:
            continue
        if hf[key] != value:
            raise ValueError(f"config_from_hf: field {key!r} is {hf[key]!r} but the embedded {EMBEDDED_KEY} "
                             f"implies {value!r}")


def _field(hf: dict[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
    if key in hf:
        return hf[key]
    if required:
        raise ValueError(f"config_from_hf: field {key!r} is missing (and there is no {EMBEDDED_KEY})")
    return default


def _require_value(hf: dict[str, Any], key: str, allowed: Any, why: str) -> None:
    if key in hf and hf[key] != allowed:
        raise ValueError(f"config_from_hf: cannot map {key}={hf[key]!r}: kimik3 supports only {allowed!r} ({why})")


def _from_fields(hf: dict[str, Any], name: str) -> K3Config:
    if hf.get("quantization_config"):
        raise ValueError("config_from_hf: the config describes quantized weights (quantization_config); kimik3 "
                         "reads unquantized weights only: dequantize the checkpoint and drop that field")
    _require_value(hf, "moe_renormalize", True, "the router normalises the chosen experts' weights")
    _require_value(hf, "activation_situ_beta", SITU_BETA_GATE, "the SiTU-GLU gate bound is fixed")
    _require_value(hf, "activation_situ_linear_beta", SITU_BETA_UP, "the SiTU-GLU up bound is fixed")
    heads = _field(hf, "num_attention_heads")
    _require_value(hf, "num_key_value_heads", heads, "MLA has one key/value head per query head")
    linear = _field(hf, "linear_attn_config")
    if not isinstance(linear, dict):
        raise ValueError(f"config_from_hf: linear_attn_config must be an object, got {linear!r}")
    _require_value(linear, "use_full_rank_gate", True, "the forget gate is forget_b(forget_a(x)) per channel")
    if "attn_res_block_size" not in hf:
        raise ValueError("config_from_hf: field 'attn_res_block_size' is missing: kimik3 models without AttnRes "
                         f"are described only by {EMBEDDED_KEY}")

    num_layers = _field(hf, "num_hidden_layers")
    mla_layers = _mla_layers(_field(linear, "full_attn_layers"), linear.get("kda_layers"), num_layers)
    layer_plan = _layer_pattern(mla_layers, num_layers)
    head_dim = _field(linear, "head_dim")
    num_shared = _field(hf, "num_shared_experts")
    shared_total = hf.get("shared_expert_intermediate_size")
    if shared_total is not None and (num_shared == 0 or shared_total % num_shared):
        raise ValueError(f"config_from_hf: cannot map shared_expert_intermediate_size={shared_total} onto "
                         f"{num_shared} shared experts of equal width")
    data = dict(
        name=name,
        vocab_size=_field(hf, "vocab_size"),
        dim=_field(hf, "hidden_size"),
        num_layers=num_layers,
        max_seq_len=_field(hf, "max_position_embeddings"),
        dense_hidden=_field(hf, "intermediate_size"),
        kda=dict(num_heads=_field(linear, "num_heads"), head_dim=head_dim,
                 conv_kernel=_field(linear, "short_conv_kernel_size"), gate_rank=head_dim,
                 g_min=float(_field(linear, "gate_lower_bound"))),
        mla=dict(num_heads=heads, q_lora_rank=_field(hf, "q_lora_rank"), kv_lora_rank=_field(hf, "kv_lora_rank"),
                 qk_nope_head_dim=_field(hf, "qk_nope_head_dim"), qk_rope_head_dim=_field(hf, "qk_rope_head_dim"),
                 v_head_dim=_field(hf, "v_head_dim")),
        moe=dict(num_experts=_field(hf, "num_experts"), top_k=_field(hf, "num_experts_per_token"),
                 latent_dim=_field(hf, "routed_expert_hidden_size"), expert_hidden=_field(hf, "moe_intermediate_size"),
                 num_shared_experts=num_shared,
                 shared_hidden=shared_total // num_shared if shared_total is not None else None,
                 route_scale=float(_field(hf, "routed_scaling_factor", 1.0, required=False))),
        attn_res=dict(enabled=True, block_size=hf["attn_res_block_size"]),
        mtp=dict(num_modules=0),  # the released layout carries no MTP module
        dense_layers=_field(hf, "first_k_dense_replace"),
        norm_eps=float(_field(hf, "rms_norm_eps")),
        tie_embeddings=bool(_field(hf, "tie_word_embeddings", False, required=False)),
        **layer_plan,
    )
    return K3Config.from_dict(data)


def _mla_layers(full: Any, kda: Any, num_layers: int) -> list[int]:
    """Zero-based MLA layer indices from the one-based ``full_attn_layers`` (and ``kda_layers``, if given)."""
    if not isinstance(full, list) or not all(isinstance(i, int) and 1 <= i <= num_layers for i in full):
        raise ValueError(f"config_from_hf: linear_attn_config.full_attn_layers must list one-based layer indices "
                         f"in [1, {num_layers}], got {full!r}")
    every = list(range(1, num_layers + 1))
    if kda is not None and (not isinstance(kda, list) or sorted(kda + full) != every):
        raise ValueError("config_from_hf: linear_attn_config.kda_layers and full_attn_layers must split the "
                         f"{num_layers} layers between them, got kda_layers={kda!r}, full_attn_layers={full!r}")
    return sorted(i - 1 for i in full)


def _layer_pattern(mla_layers: list[int], num_layers: int) -> dict[str, Any]:
    """Our layer-plan fields for these MLA indices: the 3 KDA : 1 MLA pattern (optionally with the trailing
    MLA layer) when they follow it, else the explicit list."""
    period = 4
    pattern = [i for i in range(num_layers) if i % period == period - 1]
    if mla_layers == pattern:
        return dict(mla_period=period, trailing_mla=False)
    last = num_layers - 1
    if last not in pattern and mla_layers == pattern + [last]:
        return dict(mla_period=period, trailing_mla=True)
    return dict(mla_period=period, mla_layers=mla_layers)
