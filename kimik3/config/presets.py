"""Named configurations as data: ``k3`` (the released 2.78T model), ``debug`` and ``tiny``; each also with its
MoonViT-V2 vision tower (``k3-vl``, ``debug-vl``, ``tiny-vl``).

``k3`` follows the released topology (notes §2-4, DESIGN.md): 93 layers, MLA at 3, 7, ..., 91
plus the trailing 92, dense layer 0, 896 experts top-16 in a 3584 latent.
``debug`` matches torchtitan's kimi_k3 debug model (the full code path at ~1B parameters).
``tiny`` keeps every mechanism (trailing MLA, a partial AttnRes block, MoE with shared experts,
MTP) at a few million parameters so it trains on two CPU cores.

Each preset is the ``K3Config.to_dict()`` form (nested dicts, as in a config JSON file), so this
module imports nothing and ``K3Config.preset(name)`` builds it through ``K3Config.from_dict``.
"""

from __future__ import annotations

from typing import Any


K3: dict[str, Any] = dict(
    name="k3",
    vocab_size=163_840,
    dim=7168,
    num_layers=93,
    max_seq_len=1_048_576,
    dense_hidden=33_792,
    kda=dict(num_heads=96, head_dim=128, conv_kernel=4, gate_rank=128, g_min=-5.0),
    mla=dict(num_heads=96, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    moe=dict(num_experts=896, top_k=16, latent_dim=3584, expert_hidden=3072,
             num_shared_experts=2, shared_hidden=3072),
    attn_res=dict(enabled=True, block_size=12),
    mtp=dict(num_modules=1, loss_weight=0.3),
    mla_period=4,
    trailing_mla=True,
    dense_layers=1,
)


DEBUG: dict[str, Any] = dict(
    name="debug",
    vocab_size=163_840,
    dim=1024,
    num_layers=24,
    max_seq_len=16_384,
    dense_hidden=4096,
    kda=dict(num_heads=16, head_dim=64, conv_kernel=4, gate_rank=64, g_min=-5.0),
    mla=dict(num_heads=16, q_lora_rank=512, kv_lora_rank=256,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
    moe=dict(num_experts=32, top_k=4, latent_dim=512, expert_hidden=384,
             num_shared_experts=2, shared_hidden=384),
    attn_res=dict(enabled=True, block_size=12),
    mtp=dict(num_modules=1, loss_weight=0.3),
    mla_period=4,
    trailing_mla=False,
    dense_layers=1,
)


TINY: dict[str, Any] = dict(
    name="tiny",
    vocab_size=4096,
    dim=128,
    num_layers=9,
    max_seq_len=8192,
    dense_hidden=384,
    kda=dict(num_heads=4, head_dim=None, conv_kernel=4, g_min=-5.0),
    mla=dict(num_heads=4, q_lora_rank=64, kv_lora_rank=32,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    moe=dict(num_experts=16, top_k=2, latent_dim=64, expert_hidden=128,
             num_shared_experts=2, shared_hidden=64),
    attn_res=dict(enabled=True, block_size=4),
    mtp=dict(num_modules=1, loss_weight=0.3),
    mla_period=4,
    trailing_mla=True,
    dense_layers=1,
)


# MoonViT-V2 vision towers (``kimik3.model.vision``; fields of ``VisionConfig``).
# Given by the seed: 401M parameters, 27 layers, patch 14, 2 x 2 pixel shuffle (3584² -> 16,384 tokens).
# Read from torchtitan's K3 port (the released model's shapes, facts, not chosen here): width 1024, attention
# width 1536 = 12 heads x 128, MLP hidden 4096, a 64 x 64 learned position table, RMSNorm, no biases.
# They give 27 x 14,682,112 per block + 602,112 patch embedding + 4,194,304 position table + 1,024 final
# norm = 401,214,464 for the tower (the seed's 401M; the projector into the LM, 46.1M at width 7168, apart).
# The same formulas give the port's debug tower (VISION_DEBUG) 36,486,656 with its projector, the figure in
# ../shared/reference/k3-released-layout.md.
VISION_K3: dict[str, Any] = dict(dim=1024, num_layers=27, num_heads=12, qkv_dim=1536, mlp_hidden=4096,
                                 patch_size=14, merge_size=2, pos_emb_height=64, pos_emb_width=64)
VISION_DEBUG: dict[str, Any] = dict(dim=512, num_layers=8, num_heads=6, qkv_dim=768, mlp_hidden=2048,
                                    patch_size=14, merge_size=2, pos_emb_height=32, pos_emb_width=32)
# Chosen for two CPU cores: every mechanism (patch 14, 2D RoPE, packed images, merge, projector) at ~0.1M.
VISION_TINY: dict[str, Any] = dict(dim=64, num_layers=2, num_heads=4, qkv_dim=64, mlp_hidden=128,
                                   patch_size=14, merge_size=2, pos_emb_height=8, pos_emb_width=8)


def _with_vision(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    return {**text, "name": f"{text['name']}-vl", "vision": dict(vision)}


PRESETS: dict[str, dict[str, Any]] = {
    "k3": K3, "debug": DEBUG, "tiny": TINY,
    # The same language models with native vision (``K3VLForCausalLM``).
    "k3-vl": _with_vision(K3, VISION_K3), "debug-vl": _with_vision(DEBUG, VISION_DEBUG),
    "tiny-vl": _with_vision(TINY, VISION_TINY),
}
