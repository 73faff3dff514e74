"""Parameter counts derived from a config alone (no model, no memory).

The formulas mirror the modules in ``kimik3.model`` one to one; ``tests/config/test_params.py``
checks them against a model built on the meta device. Conventions:

- ``total`` counts the main model (embedding, layers, head). The MTP module is reported apart
  (``mtp``, ``total_with_mtp``), as released totals exclude it.
- ``active`` counts what one token computes with: routed experts at ``top_k / num_experts``,
  everything else in full, and not the input embedding (a lookup, not compute).
"""

from __future__ import annotations

from kimik3.config.schema import K3Config


def kda_mixer_params(c: K3Config) -> int:
    d, h, k, r, w = c.dim, c.kda.num_heads, c.kda_head_dim, c.kda_gate_rank, c.kda.conv_kernel
    proj = h * k
    return (
        3 * d * proj      # q, k, v projections
        + 3 * proj * w    # depthwise short convs
        + d * r + r * proj  # low-rank forget gate
        + d * h           # beta
        + d * proj        # output gate
        + h + proj        # A_log [H], dt_bias [H, K]
        + k               # per-head output RMSNorm weight
        + proj * d        # output projection
    )


def mla_mixer_params(c: K3Config) -> int:
    m, d = c.mla, c.dim
    return (
        d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * m.qk_head_dim
        + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        + d * m.num_heads * m.v_head_dim   # output gate
        + m.num_heads * m.v_head_dim * d   # wo
    )


def glu_params(dim: int, hidden: int) -> int:
    """A SiTU-GLU FFN: gate, up and down projections."""
    return 3 * dim * hidden


def routed_expert_params(c: K3Config) -> int:
    return glu_params(c.moe.latent_dim, c.moe.expert_hidden)


def moe_params(c: K3Config) -> dict[str, int]:
    m, d = c.moe, c.dim
    return {
        "router": d * m.num_experts,
        "latent_projections": d * m.latent_dim + m.latent_dim + m.latent_dim * d,  # W_down, norm, W_up
        "routed_experts": m.num_experts * routed_expert_params(c),
        "shared_experts": glu_params(d, m.shared_total_hidden) if m.num_shared_experts else 0,
    }


def block_norm_params(c: K3Config, layer: int, attn_res: bool) -> int:
    """Pre-mixer and pre-FFN RMSNorms, plus the AttnRes mixes (norm + pseudo-query each)."""
    n = 2 * c.dim
    if attn_res:
        n += 2 * c.dim                 # before the FFN
        if layer > 0:                  # layer 0 has nothing to mix before its mixer
            n += 2 * c.dim
    return n


def param_counts(config: K3Config) -> dict[str, int | float]:
    """Total, active and a per-component breakdown of ``config``'s parameters.

    Returns ints for counts; ``routed_fraction`` is a float in [0, 1].
    """
    c = config
    attn_res = c.attn_res.enabled
    plan = c.layer_plan()
    moe = moe_params(c)
    moe_total = sum(moe.values())

    out: dict[str, int | float] = {
        "embedding": c.vocab_size * c.dim,
        "lm_head": 0 if c.tie_embeddings else c.dim * c.vocab_size,
        "final_norm": c.dim + (2 * c.dim if attn_res else 0),
        "kda_mixers": 0, "mla_mixers": 0, "dense_ffn": 0,
        "moe_router": 0, "moe_latent_projections": 0, "moe_routed_experts": 0, "moe_shared_experts": 0,
        "norms_and_attn_res": 0,
    }
    for spec in plan:
        out[f"{spec.mixer}_mixers"] += kda_mixer_params(c) if spec.mixer == "kda" else mla_mixer_params(c)
        out["norms_and_attn_res"] += block_norm_params(c, spec.index, attn_res)
        if spec.ffn == "dense":
            out["dense_ffn"] += glu_params(c.dim, c.dense_hidden)
        else:
            for key, value in moe.items():
                out[f"moe_{key}"] += value

    total = sum(out.values())
    idle_routed = out["moe_routed_experts"] * (1 - c.moe.top_k / c.moe.num_experts)
    # A tied matrix still does the head's compute, so only an untied embedding drops out.
    active = total - round(idle_routed) - (0 if c.tie_embeddings else out["embedding"])

    mtp = 0
    if c.mtp.num_modules:
        mtp_block = mla_mixer_params(c) + block_norm_params(c, 1, attn_res=False) + moe_total
        mtp = c.mtp.num_modules * (mtp_block + 3 * c.dim + 2 * c.dim * c.dim)  # norms x3, proj 2d->d

    num_moe_layers = sum(1 for s in plan if s.ffn == "moe")
    out.update(
        total=total,
        active=active,
        mtp=mtp,
        total_with_mtp=total + mtp,
        routed_expert=routed_expert_params(c),
        routed_per_layer=moe["routed_experts"],
        num_moe_layers=num_moe_layers,
        routed_fraction=out["moe_routed_experts"] / total if total else 0.0,
    )
    if c.vision is not None:   # reported apart, like MTP: the text totals are the language model's
        from kimik3.model.vision.config import vision_param_counts

        out.update(vision_param_counts(c.vision, c.dim))
        out["total_with_vision"] = total + out["vision_total"]
    return out


def format_param_table(config: K3Config) -> str:
    """A human-readable table of ``param_counts`` with the derivation of the routed totals."""
    counts = param_counts(config)

    def human(n: float) -> str:
        for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if abs(n) >= scale:
                return f"{n / scale:,.2f}{unit}"
        return f"{n:,.0f}"

    rows = [(k, counts[k]) for k in (
        "embedding", "lm_head", "final_norm", "kda_mixers", "mla_mixers", "dense_ffn", "moe_router",
        "moe_latent_projections", "moe_routed_experts", "moe_shared_experts", "norms_and_attn_res")]
    m = config.moe
    lines = [f"K3 parameter counts — preset/config '{config.name}'", ""]
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"  {k:<{width}}{v:>20,}  {human(v):>9}" for k, v in rows]
    lines += [
        "  " + "-" * (width + 31),
        f"  {'total':<{width}}{counts['total']:>20,}  {human(counts['total']):>9}",
        f"  {'active':<{width}}{counts['active']:>20,}  {human(counts['active']):>9}",
        f"  {'mtp (apart)':<{width}}{counts['mtp']:>20,}  {human(counts['mtp']):>9}",
        "",
        f"  routed expert   = 3 x {m.latent_dim:,} x {m.expert_hidden:,} = {counts['routed_expert']:,}"
        f" ({human(counts['routed_expert'])})",
        f"  routed / layer  = {m.num_experts} x expert = {counts['routed_per_layer']:,}"
        f" ({human(counts['routed_per_layer'])})",
        f"  routed in all   = {counts['num_moe_layers']} MoE layers x per layer = "
        f"{counts['moe_routed_experts']:,} ({human(counts['moe_routed_experts'])}, "
        f"{100 * counts['routed_fraction']:.1f}% of total)",
        f"  active          = total - embedding - routed x (1 - {m.top_k}/{m.num_experts})",
    ]
    if config.vision is not None:
        v = config.vision
        lines += ["", f"  vision (MoonViT-V2: {v.num_layers} layers, width {v.dim}, {v.num_heads} heads x "
                      f"{v.head_dim}, MLP {v.mlp_hidden}, patch {v.patch_size}, merge {v.merge_size}x{v.merge_size})"]
        lines += [f"  {k:<{width}}{counts[k]:>20,}  {human(counts[k]):>9}" for k in (
            "vision_patch_embed", "vision_pos_embed", "vision_blocks", "vision_final_norm", "vision_tower",
            "mm_projector")]
        lines += [f"  {'total_with_vision':<{width}}{counts['total_with_vision']:>20,}  "
                  f"{human(counts['total_with_vision']):>9}"]
    return "\n".join(lines)
