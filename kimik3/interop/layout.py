"""The one name-and-shape mapping between kimik3's state dict and external checkpoint layouts.

Legend: E = routed experts, L = expert latent width, F = expert hidden width, H = KDA heads,
K = KDA head dim, C = H·K conv channels, W = conv width, D = model width.

Every external key is derived from one of our keys by a rule: a name (their key, with ``{e}`` for
one tensor per routed expert) and a ``Codec`` (how our tensor becomes their tensor or tensors and
back; all exact: reshapes, transposes and copies, never arithmetic). The rules of all layouts sit
in the tables below, one row per tensor with one column per layout, so a layout is a column plus a
few policies (``Layout``). ``export`` and ``import_`` are the only conversion code: they drive the
rules from our model's state dict built on the meta device, so the expected external keys and
shapes are never written by hand, and every key either maps, is a documented placeholder, or is
reported.

Policies that the external layouts leave open, chosen here:
- MTP: neither the released Hugging Face layout nor torchtitan's port has an MTP module. Ours is
  exported under a prefix no other checkpoint uses (``Layout.mtp_prefix``), its block with the
  same per-layer names as a decoder layer, its own norms and projection with our names; export
  can leave it out (``include_mtp=False``). Import requires it exactly when the config has one.
- Tied embeddings: with ``tie_embeddings`` our state dict has no head. The HF export omits the
  head (as ``tie_word_embeddings`` checkpoints do); torchtitan's port always has a head, so its
  export writes a copy of the embedding. On import a head key is accepted for a tied config only
  when it equals the embedding bit for bit.
- Router bias: written and read as fp32 (our buffer's dtype and the port's).
- Other dtypes are carried unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from kimik3.config.schema import K3Config

Tensor = torch.Tensor
MAX_LISTED = 8  # keys named per kind of problem in an error message


@dataclass(frozen=True)
class Codec:
    """How one of our tensors is stored externally: ``parts`` gives their tensors (one, or one per
    routed expert), ``join`` rebuilds ours from them given our shape (their shapes already checked).
    ``shapes`` gives their shapes from ours without any tensor (None: run ``parts`` on the meta device)."""

    parts: Callable[[Tensor], list[Tensor]]
    join: Callable[[list[Tensor], torch.Size], Tensor]
    shapes: Callable[[torch.Size], list[tuple[int, ...]]] | None = None
    labels: tuple[str, ...] | None = None   # what ``{e}`` becomes in their names (default: 0, 1, ...)

    def their_shapes(self, shape: torch.Size) -> list[tuple[int, ...]]:
        if self.shapes is not None:
            return self.shapes(shape)
        return [tuple(t.shape) for t in self.parts(torch.empty(shape, device="meta"))]


def _reshaped(their_shape: Callable[[torch.Size], tuple[int, ...]]) -> Codec:
    return Codec(lambda t: [t.reshape(their_shape(t.shape))], lambda parts, shape: parts[0].reshape(shape))


SAME = Codec(lambda t: [t], lambda parts, shape: parts[0])
FP32 = Codec(lambda t: [t.float()], lambda parts, shape: parts[0].float())
CONV = _reshaped(lambda s: (s[0], 1, s[1]))       # ours [C, W] -> depthwise Conv1d weight [C, 1, W]
FLAT = _reshaped(lambda s: (s.numel(),))          # ours [H, K] -> [H·K]
ROW = _reshaped(lambda s: (1, s[0]))              # ours AttnRes query [D] -> Linear(D, 1) weight [1, D]
SWAP = Codec(lambda t: [t.transpose(1, 2).contiguous()],           # ours [E, a, b] <-> [E, b, a]
             lambda parts, shape: parts[0].transpose(1, 2).contiguous())
PER_EXPERT = Codec(lambda t: [w.T.contiguous() for w in t.unbind(0)],  # ours [E, a, b] <-> E x [b, a]
                   lambda parts, shape: torch.stack([w.T for w in parts]),
                   lambda s: [(s[2], s[1])] * s[0])  # the 2.78T model has 250k expert tensors: no meta ops

PATCH = _reshaped(lambda s: (s[0], 3, round((s[1] // 3) ** 0.5), round((s[1] // 3) ** 0.5)))  # [D, 3·P·P] -> conv
QKV = Codec(lambda t: list(t.chunk(3, dim=0)), lambda parts, shape: torch.cat(parts, dim=0),
            labels=("q", "k", "v"))                  # ours fused [3·Q, D] <-> three [Q, D]

# Per-layer rules: our suffix under ``layers.{i}.``, then (their suffix, codec) for Hugging Face and for
# torchtitan. The suffixes of KDA and MLA parameters differ in our names, so one table serves both mixers.
LAYER_RULES: list[tuple[str, tuple[str, Codec], tuple[str, Codec]]] = [
    ("mixer_norm.weight", ("input_layernorm.weight", SAME), ("attention_norm.weight", SAME)),
    ("ffn_norm.weight", ("post_attention_layernorm.weight", SAME), ("ffn_norm.weight", SAME)),
    # Block AttnRes: our key norm weight is their norm's weight, our query their proj's [1, D] weight.
    ("mixer_mix.key_norm_weight", ("self_attention_res_norm.weight", SAME), ("attention_res_norm.weight", SAME)),
    ("mixer_mix.query", ("self_attention_res_proj.weight", ROW), ("attention_res_proj.weight", ROW)),
    ("ffn_mix.key_norm_weight", ("mlp_res_norm.weight", SAME), ("ffn_res_norm.weight", SAME)),
    ("ffn_mix.query", ("mlp_res_proj.weight", ROW), ("ffn_res_proj.weight", ROW)),
    # KDA.
    ("mixer.q_proj.weight", ("self_attn.q_proj.weight", SAME), ("delta_attention.q_proj.weight", SAME)),
    ("mixer.k_proj.weight", ("self_attn.k_proj.weight", SAME), ("delta_attention.k_proj.weight", SAME)),
    ("mixer.v_proj.weight", ("self_attn.v_proj.weight", SAME), ("delta_attention.v_proj.weight", SAME)),
    ("mixer.q_conv", ("self_attn.q_conv1d.weight", CONV), ("delta_attention.q_conv.weight", CONV)),
    ("mixer.k_conv", ("self_attn.k_conv1d.weight", CONV), ("delta_attention.k_conv.weight", CONV)),
    ("mixer.v_conv", ("self_attn.v_conv1d.weight", CONV), ("delta_attention.v_conv.weight", CONV)),
    ("mixer.forget_a.weight", ("self_attn.f_a_proj.weight", SAME), ("delta_attention.forget_a.weight", SAME)),
    ("mixer.forget_b.weight", ("self_attn.f_b_proj.weight", SAME), ("delta_attention.forget_b.weight", SAME)),
    ("mixer.beta_proj.weight", ("self_attn.b_proj.weight", SAME), ("delta_attention.beta.weight", SAME)),
    ("mixer.output_gate.weight", ("self_attn.g_proj.weight", SAME), ("delta_attention.output_gate.weight", SAME)),
    ("mixer.output_norm_weight", ("self_attn.o_norm.weight", SAME), ("delta_attention.output_norm.weight", SAME)),
    ("mixer.o_proj.weight", ("self_attn.o_proj.weight", SAME), ("delta_attention.output_proj.weight", SAME)),
    ("mixer.A_log", ("self_attn.A_log", SAME), ("delta_attention.A_log", SAME)),
    ("mixer.dt_bias", ("self_attn.dt_bias", FLAT), ("delta_attention.dt_bias", SAME)),
    # Gated MLA.
    ("mixer.wq_a.weight", ("self_attn.q_a_proj.weight", SAME), ("attention.wq_a.weight", SAME)),
    ("mixer.q_norm.weight", ("self_attn.q_a_layernorm.weight", SAME), ("attention.q_norm.weight", SAME)),
    ("mixer.wq_b.weight", ("self_attn.q_b_proj.weight", SAME), ("attention.wq_b.weight", SAME)),
    ("mixer.wkv_a.weight", ("self_attn.kv_a_proj_with_mqa.weight", SAME), ("attention.wkv_a.weight", SAME)),
    ("mixer.kv_norm.weight", ("self_attn.kv_a_layernorm.weight", SAME), ("attention.kv_norm.weight", SAME)),
    ("mixer.wkv_b.weight", ("self_attn.kv_b_proj.weight", SAME), ("attention.wkv_b.weight", SAME)),
    ("mixer.gate.weight", ("self_attn.g_proj.weight", SAME), ("attention.gate.weight", SAME)),
    ("mixer.wo.weight", ("self_attn.o_proj.weight", SAME), ("attention.wo.weight", SAME)),
    # Dense SiTU-GLU FFN (the first ``dense_layers`` layers).
    ("ffn.w_gate.weight", ("mlp.gate_proj.weight", SAME), ("feed_forward.w1.weight", SAME)),
    ("ffn.w_up.weight", ("mlp.up_proj.weight", SAME), ("feed_forward.w3.weight", SAME)),
    ("ffn.w_down.weight", ("mlp.down_proj.weight", SAME), ("feed_forward.w2.weight", SAME)),
    # Stable LatentMoE. Ours stores experts as x @ W ([E, in, out]); HF one nn.Linear weight per expert
    # ([out, in]); torchtitan stacked [E, out, in].
    ("ffn.router.gate.weight", ("block_sparse_moe.gate.weight", SAME), ("moe.router.gate.weight", SAME)),
    ("ffn.router.expert_bias", ("block_sparse_moe.gate.e_score_correction_bias", FP32), ("moe.expert_bias_E", FP32)),
    ("ffn.routed_down.weight", ("block_sparse_moe.routed_expert_down_proj.weight", SAME),
     ("moe.routed_down.weight", SAME)),
    ("ffn.routed_norm.weight", ("block_sparse_moe.routed_expert_norm.weight", SAME),
     ("moe.routed_norm.weight", SAME)),
    ("ffn.routed_up.weight", ("block_sparse_moe.routed_expert_up_proj.weight", SAME),
     ("moe.routed_up.weight", SAME)),
    ("ffn.experts.w_gate_ELF", ("block_sparse_moe.experts.{e}.w1.weight", PER_EXPERT),
     ("moe.routed_experts.inner_experts.w1_EFD", SWAP)),
    ("ffn.experts.w_up_ELF", ("block_sparse_moe.experts.{e}.w3.weight", PER_EXPERT),
     ("moe.routed_experts.inner_experts.w3_EFD", SWAP)),
    ("ffn.experts.w_down_EFL", ("block_sparse_moe.experts.{e}.w2.weight", PER_EXPERT),
     ("moe.routed_experts.inner_experts.w2_EDF", SWAP)),
    ("ffn.shared.w_gate.weight", ("block_sparse_moe.shared_experts.gate_proj.weight", SAME),
     ("moe.shared_experts.w1.weight", SAME)),
    ("ffn.shared.w_up.weight", ("block_sparse_moe.shared_experts.up_proj.weight", SAME),
     ("moe.shared_experts.w3.weight", SAME)),
    ("ffn.shared.w_down.weight", ("block_sparse_moe.shared_experts.down_proj.weight", SAME),
     ("moe.shared_experts.w2.weight", SAME)),
]

# Top-level rules: our key, then their full key and codec for Hugging Face and for torchtitan.
TOP_RULES: list[tuple[str, tuple[str, Codec], tuple[str, Codec]]] = [
    ("embed.weight", ("language_model.model.embed_tokens.weight", SAME), ("tok_embeddings.weight", SAME)),
    ("final_mix.key_norm_weight", ("language_model.model.output_attn_res_norm.weight", SAME),
     ("output_res_norm.weight", SAME)),
    ("final_mix.query", ("language_model.model.output_attn_res_proj.weight", ROW), ("output_res_proj.weight", ROW)),
    ("norm.weight", ("language_model.model.norm.weight", SAME), ("norm.weight", SAME)),
    ("lm_head.weight", ("language_model.lm_head.weight", SAME), ("lm_head.weight", SAME)),
]

# The vision tower and projector (``kimik3.model.vision``): our key (``{i}``: the block), then their key for
# Hugging Face (the released checkpoint's names) and for torchtitan's port, as the port's state-dict adapter maps
# them. The released checkpoint fuses q, k, v into ``wqkv`` (ours too) and stores the patch embedding as a conv.
VISION_RULES: list[tuple[str, tuple[str, Codec], tuple[str, Codec]]] = [
    ("vision_tower.patch_embed.weight", ("vision_tower.patch_embed.proj.weight", PATCH),
     ("vision_encoder.patch_embed.weight", SAME)),
    ("vision_tower.pos_embed", ("vision_tower.patch_embed.pos_emb.weight", SAME), ("vision_encoder.pos_embed", SAME)),
    ("vision_tower.blocks.{i}.attn_norm.weight", ("vision_tower.encoder.blocks.{i}.norm0.weight", SAME),
     ("vision_encoder.layers.{i}.norm1.weight", SAME)),
    ("vision_tower.blocks.{i}.attn.wqkv.weight", ("vision_tower.encoder.blocks.{i}.wqkv.weight", SAME),
     ("vision_encoder.layers.{i}.attn.w{e}.weight", QKV)),
    ("vision_tower.blocks.{i}.attn.wo.weight", ("vision_tower.encoder.blocks.{i}.wo.weight", SAME),
     ("vision_encoder.layers.{i}.attn.proj.weight", SAME)),
    ("vision_tower.blocks.{i}.mlp_norm.weight", ("vision_tower.encoder.blocks.{i}.norm1.weight", SAME),
     ("vision_encoder.layers.{i}.norm2.weight", SAME)),
    ("vision_tower.blocks.{i}.mlp.fc1.weight", ("vision_tower.encoder.blocks.{i}.mlp.fc0.weight", SAME),
     ("vision_encoder.layers.{i}.mlp.linear_fc1.weight", SAME)),
    ("vision_tower.blocks.{i}.mlp.fc2.weight", ("vision_tower.encoder.blocks.{i}.mlp.fc1.weight", SAME),
     ("vision_encoder.layers.{i}.mlp.linear_fc2.weight", SAME)),
    ("vision_tower.final_norm.weight", ("vision_tower.encoder.final_layernorm.weight", SAME),
     ("vision_encoder.final_norm.weight", SAME)),
    ("mm_projector.fc1.weight", ("mm_projector.proj.0.weight", SAME),
     ("vision_encoder.projector.linear_1.weight", SAME)),
    ("mm_projector.fc2.weight", ("mm_projector.proj.2.weight", SAME),
     ("vision_encoder.projector.linear_2.weight", SAME)),
    ("mm_projector.post_norm.weight", ("mm_projector.post_norm.weight", SAME),
     ("vision_encoder.projector.post_norm.weight", SAME)),
]
_VISION_BLOCK_KEY = re.compile(r"vision_tower\.blocks\.(\d+)\.(.+)")

# The MTP module's own parameters (its block uses LAYER_RULES): same suffix in every layout, under its prefix.
MTP_OWN = ("hidden_norm.weight", "embed_norm.weight", "proj.weight", "out_norm.weight")


@dataclass(frozen=True)
class Layout:
    """One external layout: a column of the tables plus its policies."""

    name: str                    # as in messages: "hf", "torchtitan"
    column: int                  # 0 = Hugging Face, 1 = torchtitan in the rule tables
    layer_prefix: str            # their prefix of layer i, with ``{i}``
    mtp_prefix: str              # where our MTP module goes (no external layout has one)
    write_tied_head: bool        # whether export writes a head equal to the embedding for a tied config
    # Keys their layout has and ours does not, written on export and dropped on import (shape checked),
    # derived from our (possibly meta) state dict: name -> tensor.
    placeholders: Callable[[dict[str, Tensor], K3Config], dict[str, Tensor]]
    vision_prefixes: tuple[str, ...]  # keys of their vision encoder, dropped on import only when asked

    @property
    def head_key(self) -> str:
        return self.top_rules["lm_head.weight"][0]

    @property
    def embed_key(self) -> str:
        return self.top_rules["embed.weight"][0]

    @cached_property
    def top_rules(self) -> dict[str, tuple[str, Codec]]:
        return {ours: cols[self.column] for ours, *cols in TOP_RULES}

    @cached_property
    def layer_rules(self) -> dict[str, tuple[str, Codec]]:
        return {ours: cols[self.column] for ours, *cols in LAYER_RULES}

    @cached_property
    def vision_rules(self) -> dict[str, tuple[str, Codec]]:
        return {ours: cols[self.column] for ours, *cols in VISION_RULES}


_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")


def rule_for(layout: Layout, key: str) -> tuple[str, Codec]:
    """Their key (``{e}`` for per-expert parts) and codec for our state-dict key ``key``."""
    found = None
    match = _LAYER_KEY.fullmatch(key)
    if match is not None:
        rule = layout.layer_rules.get(match.group(2))
        if rule is not None:
            found = (layout.layer_prefix.format(i=match.group(1)) + rule[0], rule[1])
    elif key.startswith("mtp.block."):
        rule = layout.layer_rules.get(key.removeprefix("mtp.block."))
        if rule is not None:
            found = (layout.mtp_prefix + "block." + rule[0], rule[1])
    elif key.startswith("mtp.") and key.removeprefix("mtp.") in MTP_OWN:
        found = (layout.mtp_prefix + key.removeprefix("mtp."), SAME)
    elif key.startswith(("vision_tower.", "mm_projector.")):
        block = _VISION_BLOCK_KEY.fullmatch(key)
        rule = layout.vision_rules.get(f"vision_tower.blocks.{{i}}.{block.group(2)}" if block else key)
        if rule is not None:
            found = (rule[0].replace("{i}", block.group(1)) if block else rule[0], rule[1])
    else:
        found = layout.top_rules.get(key)
    if found is None:
        raise ValueError(f"{layout.name}: no mapping for kimik3 key {key!r} (the rule tables in "
                         "kimik3/interop/layout.py do not cover it)")
    return found


def _part_names(template: str, count: int, codec: Codec | None = None) -> list[str]:
    if "{e}" not in template:
        return [template]
    labels = codec.labels if codec is not None and codec.labels is not None else range(count)
    return [template.format(e=e) for e in labels]


def our_meta_state(config: K3Config) -> dict[str, Tensor]:
    """Our model's state dict for ``config`` on the meta device: every key, shape and default dtype."""
    from kimik3.model.vision import causal_lm_class  # the model imports much; the tables above do not need it

    return causal_lm_class(config)(config, device="meta").state_dict()


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_keys(found: Mapping[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str,
               optional: dict[str, tuple[int, ...]] | None = None, hint: str = "") -> None:
    """Raise one ValueError naming every missing key, unexpected key and shape mismatch (up to MAX_LISTED
    of each). ``found`` maps each key to its shape (a file's header gives them without reading the data);
    ``optional`` keys may be absent; when present their shape is checked."""
    shapes = {**(optional or {}), **expected}
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in shapes]
    wrong = [f"{k}: got {tuple(shape)}, expected {shapes[k]}" for k, shape in found.items()
             if k in shapes and tuple(shape) != shapes[k]]
    if not (missing or unexpected or wrong):
        return
    problems = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong)):
        if items:
            more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
            problems.append(f"{label} ({len(items)}): {items[:MAX_LISTED]}{more}")
    raise ValueError(f"{where}: the state dict does not match the config: " + "; ".join(problems) + hint)


def export(state_dict: dict[str, Tensor], config: K3Config, layout: Layout, include_mtp: bool) -> dict[str, Tensor]:
    """Our state dict -> ``layout``'s (see the module notes for the policies)."""
    meta = our_meta_state(config)
    check_keys({k: _shape(t) for k, t in state_dict.items()}, {k: _shape(t) for k, t in meta.items()},
               f"to_{layout.name}")
    out: dict[str, Tensor] = {}
    for key in meta:
        if key.startswith("mtp.") and not include_mtp:
            continue
        template, codec = rule_for(layout, key)
        parts = codec.parts(state_dict[key])
        out.update(zip(_part_names(template, len(parts), codec), parts))
    if config.tie_embeddings and layout.write_tied_head:
        out[layout.head_key] = out[layout.embed_key].clone()
    out.update(layout.placeholders(state_dict, config))
    return out


@dataclass(frozen=True)
class ImportPlan:
    """How to build each of our tensors from an external checkpoint: ``parts[key]`` their tensors' names,
    ``codecs[key]`` the join, ``shapes[key]`` our shape; ``tied_head`` a head key to check against the embedding
    (present in a tied config's checkpoint), else None."""

    parts: dict[str, list[str]]
    codecs: dict[str, Codec]
    shapes: dict[str, torch.Size]
    tied_head: str | None
    embed: str

    def build(self, key: str, read: Callable[[str], Tensor]) -> Tensor:
        """Our tensor ``key``, its parts read one by one with ``read`` (a dict's ``__getitem__`` or a file's)."""
        return self.codecs[key].join([read(name) for name in self.parts[key]], self.shapes[key])

    def check_tied_head(self, read: Callable[[str], Tensor], where: str) -> None:
        if self.tied_head is not None and not torch.equal(read(self.tied_head), read(self.embed)):
            raise ValueError(f"{where}: the config ties the embeddings but {self.tied_head!r} differs from "
                             f"{self.embed!r}")


def import_plan(shapes: Mapping[str, tuple[int, ...]], config: K3Config, layout: Layout,
                drop_vision: bool = False) -> ImportPlan:
    """Check an external checkpoint's keys and shapes (``shapes``: name -> shape, e.g. from file headers, no data
    read) against ``config`` and plan the conversion to ours. Vision keys are ignored with ``drop_vision``."""
    where = f"from_{layout.name}"
    if drop_vision and config.vision is not None:
        raise ValueError(f"{where}: drop_vision with a config that has a vision tower ({config.name!r}): the tower's "
                         "keys are needed")
    if drop_vision:
        shapes = {k: s for k, s in shapes.items() if not k.startswith(layout.vision_prefixes)}
    meta = our_meta_state(config)
    parts: dict[str, list[str]] = {}
    codecs: dict[str, Codec] = {}
    expected: dict[str, tuple[int, ...]] = {}
    for key, t in meta.items():
        template, codec = rule_for(layout, key)
        their = codec.their_shapes(t.shape)
        parts[key], codecs[key] = _part_names(template, len(their), codec), codec
        expected.update(zip(parts[key], their))
    optional = {name: _shape(t) for name, t in layout.placeholders(meta, config).items()}
    if config.tie_embeddings:
        optional[layout.head_key] = expected[layout.embed_key]

    missing_mtp = config.mtp.num_modules and not any(k.startswith(layout.mtp_prefix) for k in shapes)
    hint = (f" (the checkpoint has no MTP module under {layout.mtp_prefix!r}: load it with a config whose "
            "mtp.num_modules is 0)") if missing_mtp else ""
    if not drop_vision and config.vision is None and any(k.startswith(layout.vision_prefixes) for k in shapes):
        hint += (f" (keys under {list(layout.vision_prefixes)} are a vision encoder: pass drop_vision=True, or load "
                 "with a config that has one, e.g. a *-vl preset)")
    check_keys(shapes, expected, where, optional, hint)
    tied_head = layout.head_key if config.tie_embeddings and layout.head_key in shapes else None
    return ImportPlan(parts, codecs, {k: t.shape for k, t in meta.items()}, tied_head, layout.embed_key)


def import_(state_dict: dict[str, Tensor], config: K3Config, layout: Layout,
            drop_vision: bool = False) -> dict[str, Tensor]:
    """``layout``'s state dict -> ours: exactly our model's keys, in its order."""
    plan = import_plan({k: _shape(t) for k, t in state_dict.items()}, config, layout, drop_vision)
    plan.check_tied_head(state_dict.__getitem__, f"from_{layout.name}")
    return {key: plan.build(key, state_dict.__getitem__) for key in plan.parts}
