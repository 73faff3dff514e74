"""The K3 configuration: nested dataclasses, validation, JSON round-trip and the layer plan.

Every number that shapes the model lives here; nothing else in the package invents a size.
Presets (``K3Config.preset``) are data in ``presets.py``; parameter counting in ``params.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kimik3.config.presets import PRESETS

if TYPE_CHECKING:
    from kimik3.model.vision.config import VisionConfig

Mixer = Literal["kda", "mla"]
FFNKind = Literal["dense", "moe"]


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"invalid config field '{field_name}': {message}")


def _positive(value: Any, field_name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             field_name, f"must be a positive integer, got {value!r}")


@dataclass(slots=True)
class KDAConfig:
    """Kimi Delta Attention (notes §2).

    ``head_dim=None`` derives it as ``dim // num_heads`` (the tiny presets' one scale dial);
    then ``num_heads`` must divide the model width.
    """

    num_heads: int
    head_dim: int | None = None
    conv_kernel: int = 4          # causal depthwise short conv on q, k, v
    gate_rank: int | None = None  # low-rank forget gate d -> r -> H*K; None means head_dim
    g_min: float = -5.0           # log-decay floor: g = g_min * sigmoid(...)
    norm_eps: float = 1e-5        # per-head output RMSNorm
    chunk_size: int = 64


@dataclass(slots=True)
class MLAConfig:
    """Gated Multi-head Latent Attention, NoPE (the 'rope' slice is never rotated)."""

    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token per MLA layer: the normalised latent plus the shared slice."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(slots=True)
class MoEConfig:
    """Stable LatentMoE: routed experts inside a latent of ``latent_dim``, shared experts at full width."""

    num_experts: int
    top_k: int
    latent_dim: int
    expert_hidden: int
    num_shared_experts: int = 2
    shared_hidden: int | None = None  # per shared expert; None means expert_hidden
    route_scale: float = 1.0
    # The routed experts' quantisation (seed section 8): None, or "mxfp4" (weights MXFP4, their inputs MXFP8 E4M3,
    # 32-element blocks along each matmul's reduction axis; ``kimik3.quant.qat``). Training fake-quantises with a
    # straight-through gradient and every later forward (serving included) quantises the same way.
    expert_quant: str | None = None

    @property
    def shared_total_hidden(self) -> int:
        return self.num_shared_experts * (self.shared_hidden or self.expert_hidden)


@dataclass(slots=True)
class AttnResConfig:
    """Block Attention Residuals; ``enabled=False`` gives plain PreNorm residuals (ablation)."""

    enabled: bool = True
    block_size: int = 12


@dataclass(slots=True)
class MTPConfig:
    """DeepSeek-V3-style multi-token prediction: ``num_modules`` extra depths (0 = off)."""

    num_modules: int = 0
    loss_weight: float = 0.3


@dataclass(slots=True)
class LayerSpec:
    """One row of the derived layer plan."""

    index: int
    mixer: Mixer
    ffn: FFNKind
    attn_res_block: int  # which AttnRes block this layer belongs to
    opens_block: bool    # True for the first layer of an AttnRes block


@dataclass(slots=True)
class K3Config:
    """The whole model. Build one with ``K3Config.preset(name)`` or field by field.

    Layer plan: layer ``i`` is MLA when ``i % mla_period == mla_period - 1`` (3 KDA : 1 MLA),
    plus the last layer when ``trailing_mla`` (K3's 93rd layer), unless ``mla_layers`` lists
    the MLA indices explicitly. The first ``dense_layers`` layers use a dense SiTU-GLU FFN,
    the rest a Stable LatentMoE.
    """

    name: str
    vocab_size: int
    dim: int
    num_layers: int
    max_seq_len: int
    dense_hidden: int
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    attn_res: AttnResConfig = field(default_factory=AttnResConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    mla_period: int = 4
    trailing_mla: bool = False
    mla_layers: list[int] | None = None
    dense_layers: int = 1
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # The MoonViT-V2 vision tower and projector (``kimik3.model.vision``); None: a text-only model. Left out of
    # ``to_dict`` when None, so a text config's JSON is what it was.
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        for name in ("vocab_size", "dim", "num_layers", "max_seq_len", "dense_hidden", "mla_period"):
            _positive(getattr(self, name), name)
        _require(0 <= self.dense_layers <= self.num_layers, "dense_layers",
                 f"must be in [0, num_layers={self.num_layers}], got {self.dense_layers}")
        _require(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        _require(self.init_std > 0, "init_std", f"must be > 0, got {self.init_std}")

        kda = self.kda
        _positive(kda.num_heads, "kda.num_heads")
        if kda.head_dim is None:
            _require(self.dim % kda.num_heads == 0, "kda.num_heads",
                     f"{kda.num_heads} heads do not divide the width dim={self.dim} "
                     "(set kda.head_dim explicitly or pick a divisor)")
        else:
            _positive(kda.head_dim, "kda.head_dim")
        _positive(kda.conv_kernel, "kda.conv_kernel")
        if kda.gate_rank is not None:
            _positive(kda.gate_rank, "kda.gate_rank")
        _require(kda.g_min < 0, "kda.g_min", f"must be negative (a log-decay floor), got {kda.g_min}")
        _require(kda.g_min >= -5.0, "kda.g_min",
                 f"must be >= -5 so a 16-token tile's cumulative decay stays in (-80, 0), got {kda.g_min}")
        _positive(kda.chunk_size, "kda.chunk_size")
        _require(kda.chunk_size % 16 == 0, "kda.chunk_size",
                 f"must be a multiple of the 16-token sub-tile, got {kda.chunk_size}")
        _require(kda.norm_eps > 0, "kda.norm_eps", f"must be > 0, got {kda.norm_eps}")

        mla = self.mla
        for name in ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _positive(getattr(mla, name), f"mla.{name}")
        _require(isinstance(mla.qk_rope_head_dim, int) and mla.qk_rope_head_dim >= 0,
                 "mla.qk_rope_head_dim", f"must be a non-negative integer, got {mla.qk_rope_head_dim!r}")

        moe = self.moe
        for name in ("num_experts", "top_k", "latent_dim", "expert_hidden"):
            _positive(getattr(moe, name), f"moe.{name}")
        _require(moe.top_k <= moe.num_experts, "moe.top_k",
                 f"top_k={moe.top_k} exceeds num_experts={moe.num_experts}")
        _require(isinstance(moe.num_shared_experts, int) and moe.num_shared_experts >= 0,
                 "moe.num_shared_experts", f"must be >= 0, got {moe.num_shared_experts!r}")
        if moe.shared_hidden is not None:
            _positive(moe.shared_hidden, "moe.shared_hidden")
        _require(moe.route_scale > 0, "moe.route_scale", f"must be > 0, got {moe.route_scale}")
        _require(moe.expert_quant in (None, "mxfp4"), "moe.expert_quant",
                 f"must be null or \"mxfp4\", got {moe.expert_quant!r}")
        if moe.expert_quant is not None:
            for name in ("latent_dim", "expert_hidden"):
                _require(getattr(moe, name) % 32 == 0, f"moe.{name}",
                         f"must be a multiple of the 32-element MX block with expert_quant, got {getattr(moe, name)}")

        _positive(self.attn_res.block_size, "attn_res.block_size")
        _require(isinstance(self.mtp.num_modules, int) and 0 <= self.mtp.num_modules <= 1,
                 "mtp.num_modules", f"must be 0 or 1 (one DeepSeek-V3-style module), got {self.mtp.num_modules!r}")
        _require(self.mtp.loss_weight >= 0, "mtp.loss_weight", f"must be >= 0, got {self.mtp.loss_weight}")

        if self.mla_layers is not None:
            layers = list(self.mla_layers)
            _require(all(isinstance(i, int) and 0 <= i < self.num_layers for i in layers), "mla_layers",
                     f"every index must be an int in [0, {self.num_layers}), got {layers}")
            _require(len(set(layers)) == len(layers), "mla_layers", f"has duplicate indices: {layers}")
        elif self.trailing_mla:
            last = self.num_layers - 1
            _require(last % self.mla_period != self.mla_period - 1, "trailing_mla",
                     f"the last layer {last} is already MLA under mla_period={self.mla_period}")
        if self.vision is not None:
            self.vision.validate()
            token = self.vision.image_token_id
            _require(token is None or token < self.vocab_size, "vision.image_token_id",
                     f"must lie below vocab_size={self.vocab_size}, got {token}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def kda_head_dim(self) -> int:
        return self.kda.head_dim if self.kda.head_dim is not None else self.dim // self.kda.num_heads

    @property
    def kda_gate_rank(self) -> int:
        return self.kda.gate_rank if self.kda.gate_rank is not None else self.kda_head_dim

    @property
    def mla_layer_indices(self) -> list[int]:
        if self.mla_layers is not None:
            return sorted(self.mla_layers)
        period = self.mla_period
        indices = [i for i in range(self.num_layers) if i % period == period - 1]
        if self.trailing_mla:
            indices.append(self.num_layers - 1)
        return indices

    def layer_plan(self) -> list[LayerSpec]:
        """The per-layer plan: mixer (KDA or MLA), FFN (dense or MoE) and AttnRes block."""
        mla = set(self.mla_layer_indices)
        size = self.attn_res.block_size
        return [
            LayerSpec(
                index=i,
                mixer="mla" if i in mla else "kda",
                ffn="dense" if i < self.dense_layers else "moe",
                attn_res_block=i // size,
                opens_block=i % size == 0,
            )
            for i in range(self.num_layers)
        ]

    @property
    def num_attn_res_blocks(self) -> int:
        return -(-self.num_layers // self.attn_res.block_size)

    # ------------------------------------------------------------------ presets and JSON
    @classmethod
    def preset(cls, name: str) -> "K3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls.from_dict(copy.deepcopy(PRESETS[name]))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["vision"] is None:
            del data["vision"]
        return data

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to JSON; also write it to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "K3Config":
        if not isinstance(data, dict):
            raise ValueError(f"a K3 config must be a JSON object, got {type(data).__name__}")
        nested = {"kda": KDAConfig, "mla": MLAConfig, "moe": MoEConfig,
                  "attn_res": AttnResConfig, "mtp": MTPConfig}
        kwargs = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"invalid config field '{unknown[0]}': unknown field (known: {sorted(known)})")
        for key, sub_cls in nested.items():
            if key in kwargs:
                value = kwargs[key]
                if not isinstance(value, dict):
                    raise ValueError(f"invalid config field '{key}': must be an object, got {value!r}")
                sub_known = {f.name for f in dataclasses.fields(sub_cls)}
                bad = sorted(set(value) - sub_known)
                if bad:
                    raise ValueError(f"invalid config field '{key}.{bad[0]}': unknown field")
                try:
                    kwargs[key] = sub_cls(**value)
                except TypeError as err:  # a missing required sub-field
                    raise ValueError(f"invalid config field '{key}': {err}") from None
        if kwargs.get("vision") is not None:
            from kimik3.model.vision.config import VisionConfig  # here: kimik3.model imports this module

            value = kwargs["vision"]
            if not isinstance(value, dict):
                raise ValueError(f"invalid config field 'vision': must be an object or null, got {value!r}")
            bad = sorted(set(value) - {f.name for f in dataclasses.fields(VisionConfig)})
            if bad:
                raise ValueError(f"invalid config field 'vision.{bad[0]}': unknown field")
            try:
                kwargs["vision"] = VisionConfig(**value)
            except TypeError as err:
                raise ValueError(f"invalid config field 'vision': {err}") from None
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise ValueError(f"invalid config: {err}") from None

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "K3Config":
        """Parse a JSON string, or read a ``.json`` file when given a path that exists."""
        path = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        if path is not None:
            if not path.is_file():
                raise ValueError(f"config file {str(path)!r} does not exist")
            text = path.read_text()
        else:
            text = str(text_or_path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            where = f" in {str(path)!r}" if path is not None else ""
            raise ValueError(f"config JSON{where} is malformed: {err}") from None
        return cls.from_dict(data)
