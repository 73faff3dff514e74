"""Named configurations as data: ``k3`` (the released 2.78T model), ``debug`` and ``tiny``.

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


PRESETS: dict[str, dict[str, Any]] = {"k3": K3, "debug": DEBUG, "tiny": TINY}
