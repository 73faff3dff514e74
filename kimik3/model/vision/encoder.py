"""MoonViT-V2: the vision tower, over several native-resolution images packed in one sequence.

Legend: T = packed patches (every image's, contiguous, raster order), N = images, D = width,
H = heads, K = head dim, F = 3·P·P values per patch.

patches [T, F] -> patch embedding Linear(F -> D) + learned position table (bilinearly interpolated to
each image's grid) -> ``num_layers`` pre-norm blocks (attention with 2D RoPE kept inside each image,
``packing.py``; GELU-tanh MLP) -> final RMSNorm -> [T, D]. The merge and projection into the language
model follow in ``projector.py``. Parameter names: ``kimik3/interop/layout.py`` maps them to the released
checkpoint's (``vision_tower.*``) and torchtitan's (``vision_encoder.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.norm import RMSNorm
from kimik3.model.param_rules import ParamRule, adamw, muon
from kimik3.model.vision.config import VisionConfig
from kimik3.model.vision.packing import cu_seqlens_from_grid, packed_attention
from kimik3.model.vision.rope import apply_rope_2d, patch_positions, rope_angles


def check_packed_images(pixel_values: torch.Tensor, grid_hw: torch.Tensor, config: VisionConfig) -> None:
    """Raise ValueError / TypeError unless (pixel_values [T, 3·P·P] float, grid_hw [N, 2] int) agree."""
    if not isinstance(pixel_values, torch.Tensor) or not isinstance(grid_hw, torch.Tensor):
        raise TypeError("pixel_values and image_grid_hw must be tensors")
    if not pixel_values.is_floating_point():
        raise TypeError(f"pixel_values must be a float tensor [patches, {config.patch_dim}], got {pixel_values.dtype}")
    if pixel_values.ndim != 2 or pixel_values.shape[1] != config.patch_dim:
        raise ValueError(f"pixel_values must be [patches, 3·{config.patch_size}·{config.patch_size}="
                         f"{config.patch_dim}], got {tuple(pixel_values.shape)}")
    if grid_hw.dtype not in (torch.int32, torch.int64) or grid_hw.ndim != 2 or grid_hw.shape[1] != 2:
        raise ValueError(f"image_grid_hw must be an int tensor [images, 2] (rows, cols of patches), got "
                         f"{grid_hw.dtype} {tuple(grid_hw.shape)}")
    if grid_hw.shape[0] == 0:
        raise ValueError("image_grid_hw lists no image")
    grids = grid_hw.tolist()
    m = config.merge_size
    for rows, cols in grids:
        if rows < 1 or cols < 1 or rows % m or cols % m:
            raise ValueError(f"an image grid of {rows} x {cols} patches is empty or not a multiple of the "
                             f"{m} x {m} merge (pad images with kimik3.model.vision.tokens.preprocess_image)")
    total = sum(rows * cols for rows, cols in grids)
    if total != pixel_values.shape[0]:
        raise ValueError(f"pixel_values holds {pixel_values.shape[0]} patches but image_grid_hw describes {total}")


class VisionAttention(nn.Module):
    """Multi-head attention with 2D RoPE, within each image of the packed sequence."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim, self.theta = config.num_heads, config.head_dim, config.rope_theta
        # q, k and v in one matrix [3·Q, D] (rows: all of q, then k, then v), as the released checkpoint stores it.
        self.wqkv = nn.Linear(config.dim, 3 * config.qkv_dim, bias=False)
        self.wo = nn.Linear(config.qkv_dim, config.dim, bias=False)

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        # Per-head Muon: each head's block of q, of k and of v rows on its own; wo's input columns are head-major.
        return [("wqkv.weight", muon(("rows", 3 * self.num_heads), "VisionAttention.wqkv")),
                ("wo.weight", muon(("cols", self.num_heads), "VisionAttention.wo"))]

    def forward(self, x_TD: torch.Tensor, angles_TP: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x_TD).view(x_TD.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope_2d(q, angles_TP), apply_rope_2d(k, angles_TP)
        return self.wo(packed_attention(q, k, v, cu_seqlens).flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.mlp_hidden, bias=False)
        self.fc2 = nn.Linear(config.mlp_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = VisionAttention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x_TD: torch.Tensor, angles_TP: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x_TD = x_TD + self.attn(self.attn_norm(x_TD), angles_TP, cu_seqlens)
        return x_TD + self.mlp(self.mlp_norm(x_TD))


class MoonViT(nn.Module):
    """The vision tower: ``forward(pixel_values [T, 3·P·P], grid_hw [N, 2]) -> [T, D]``."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Linear(config.patch_dim, config.dim, bias=False)
        self.pos_embed = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, config.dim))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.dim, config.norm_eps)

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        # A table of positions, read by interpolation: an embedding, not a map between features.
        return [("pos_embed", adamw(False, "MoonViT.pos_embed"))]

    def position_table(self, grid_hw: torch.Tensor) -> torch.Tensor:
        """[T, D]: the learned table resized (bilinear) to each image's grid, in raster order."""
        table = self.pos_embed
        resized: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for rows, cols in grid_hw.tolist():
            if (rows, cols) not in resized:
                if (rows, cols) == tuple(table.shape[:2]):
                    resized[rows, cols] = table.flatten(0, 1)
                else:
                    grid = F.interpolate(table.permute(2, 0, 1)[None].float(), size=(rows, cols), mode="bilinear",
                                         align_corners=False)[0]
                    resized[rows, cols] = grid.permute(1, 2, 0).flatten(0, 1).to(table.dtype)
            out.append(resized[rows, cols])
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        check_packed_images(pixel_values, grid_hw, self.config)
        cu_seqlens = cu_seqlens_from_grid(grid_hw)
        angles = rope_angles(patch_positions(grid_hw), self.config.head_dim, self.config.rope_theta)
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)) + self.position_table(grid_hw)
        for block in self.blocks:
            x = block(x, angles, cu_seqlens)
        return self.final_norm(x)
