"""The MoonViT-V2 vision tower's configuration (``VisionConfig``) and its parameter counts.

The tower's numbers live in the presets (``kimik3/config/presets.py``: ``VISION_K3``, ``VISION_DEBUG``,
``VISION_TINY``); a ``K3Config`` carries one as its ``vision`` field (None: a text-only model).

What each field shapes (Legend: D = tower width, Q = attention width, P = patch side, M = merge side):
- patch embedding Linear(3·P·P -> D) over each P x P patch (the released checkpoint stores it as a conv);
- a learned position table [pos_emb_height, pos_emb_width, D], interpolated bilinearly to each image's
  patch grid, plus 2D rotary positions inside attention (``rope.py``);
- ``num_layers`` pre-norm blocks: RMSNorm -> q, k, v Linear(D -> Q) each, ``num_heads`` heads, 2D RoPE,
  attention within each image -> Linear(Q -> D); RMSNorm -> Linear(D -> mlp_hidden) -> GELU(tanh) -> Linear
  back; no biases anywhere;
- final RMSNorm, then the M x M pixel-shuffle merge (M·M·D features per image token) and the projector
  Linear(M·M·D -> M·M·D) -> GELU -> Linear(-> LM width) -> RMSNorm into the language model's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _positive_int(value: Any, name: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"invalid config field 'vision.{name}': must be a positive integer, got {value!r}")


@dataclass(slots=True)
class VisionConfig:
    """MoonViT-V2 (seed: 401M parameters, 27 layers, patch 14, pixel shuffle 2x2, trained from scratch)."""

    dim: int
    num_layers: int
    num_heads: int
    qkv_dim: int                 # attention width Q = num_heads x head_dim (may differ from dim)
    mlp_hidden: int
    patch_size: int = 14
    merge_size: int = 2          # pixel shuffle M x M: M*M patches -> one LM token
    pos_emb_height: int = 64     # the learned position table's grid, interpolated to each image's
    pos_emb_width: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_image_tokens: int = 16_384   # LM tokens per image at most (3584 x 3584 at patch 14, merge 2)
    init_std: float = 0.02
    # The prompt's image placeholder id (``<|media_pad|>``); None: the vocabulary's last id, where
    # ``kimik3.tokenizer.add_media_tokens`` puts it (media begin, end and pad take the last three ids).
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("dim", "num_layers", "num_heads", "qkv_dim", "mlp_hidden", "patch_size", "merge_size",
                     "pos_emb_height", "pos_emb_width", "max_image_tokens"):
            _positive_int(getattr(self, name), name)
        if self.qkv_dim % self.num_heads:
            raise ValueError(f"invalid config field 'vision.num_heads': {self.num_heads} heads do not divide "
                             f"qkv_dim={self.qkv_dim}")
        if self.head_dim % 4:
            raise ValueError(f"invalid config field 'vision.qkv_dim': the 2D rotary embedding splits each head "
                             f"into x and y pairs, so head_dim must be a multiple of 4, got {self.head_dim}")
        if self.image_token_id is not None and (isinstance(self.image_token_id, bool)
                                                or not isinstance(self.image_token_id, int)
                                                or self.image_token_id < 0):
            raise ValueError(f"invalid config field 'vision.image_token_id': must be a token id >= 0 or null, "
                             f"got {self.image_token_id!r}")
        if not self.rope_theta > 0 or not self.norm_eps > 0 or not self.init_std > 0:
            raise ValueError("invalid config field 'vision.rope_theta/norm_eps/init_std': must be > 0")

    @property
    def head_dim(self) -> int:
        return self.qkv_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: 3 channels x P x P."""
        return 3 * self.patch_size * self.patch_size

    @property
    def merged_dim(self) -> int:
        return self.merge_size * self.merge_size * self.dim

    @property
    def unit(self) -> int:
        """Pixels per LM token side: an image is padded to a multiple of patch x merge."""
        return self.patch_size * self.merge_size


def vision_param_counts(vision: VisionConfig, text_dim: int) -> dict[str, int]:
    """Parameters of the tower (``vision_tower``, the seed's 401M for the full config) and of the projector
    (``mm_projector``) into a language model of width ``text_dim``; mirrors ``encoder.py`` and ``projector.py``."""
    v = vision
    block = (2 * v.dim                    # two RMSNorms
             + 3 * v.dim * v.qkv_dim      # q, k, v
             + v.qkv_dim * v.dim          # output projection
             + 2 * v.dim * v.mlp_hidden)  # MLP up and down
    out = {
        "vision_patch_embed": v.patch_dim * v.dim,
        "vision_pos_embed": v.pos_emb_height * v.pos_emb_width * v.dim,
        "vision_blocks": v.num_layers * block,
        "vision_final_norm": v.dim,
    }
    out["vision_tower"] = sum(out.values())
    out["mm_projector"] = v.merged_dim * v.merged_dim + v.merged_dim * text_dim + text_dim
    out["vision_total"] = out["vision_tower"] + out["mm_projector"]
    return out
