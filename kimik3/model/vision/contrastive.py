"""CLIP-style contrastive pre-training of the MoonViT-V2 tower: the model, its loss, and the tower's file.

The seed trains MoonViT-V2 from scratch by next-token prediction, because attaching a contrastively
pre-trained encoder (SigLIP) gave frequent gradient spikes in joint training. This module builds the other
arm of that comparison at any tower size: the very ``MoonViT`` that ``K3VLForCausalLM`` holds as
``vision_tower``, pre-trained against captions, then written to a safetensors file that
``kimik3 train --vision --vision-init FILE`` loads (``load_tower``).

Legend: T = packed patches, N = images (= captions in a batch), D = tower width, L = caption tokens,
C = caption encoder width, E = the shared embedding width.

- Image embedding: tower output [T, D] -> mean over each image's patches [N, D] -> Linear(D -> E) -> L2 norm.
- Caption embedding: words (``CaptionVocab``: lower-cased words and punctuation, ids 0 = pad, 1 = unknown)
  -> token + learned position embeddings [N, L, C] -> ``text_layers`` pre-norm transformer layers (no
  dropout) -> LayerNorm -> mean over the non-pad tokens -> Linear(C -> E) -> L2 norm. Order-aware, since
  a caption binds colours to shapes ("a red circle, a blue square.").
- Loss (``contrastive_loss``): CLIP's symmetric InfoNCE with a learned temperature, logits
  ``exp(log_scale) · img @ txtᵀ`` (scale initialised to 1/0.07, capped at 100). Captions repeat in a batch
  of generated scenes ("the digit 7."), so every pair with the same caption is a positive: each row's target
  is uniform over its positives (with distinct captions, exactly CLIP's cross-entropy on the diagonal).

The tower file holds the tower's tensors under the multimodal model's names (``vision_tower.*``) and the
tower config as metadata; no pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.vision.config import VisionConfig
from kimik3.model.vision.encoder import MoonViT
from kimik3.model.vision.model import init_vision_weights

TOWER_PREFIX = "vision_tower."
TOWER_FORMAT = "kimik3-vision-tower-v1"
# The config fields that decide the tower's tensors and what they mean; a file must agree on all of them.
SHAPING_FIELDS = ("dim", "num_layers", "num_heads", "qkv_dim", "mlp_hidden", "patch_size", "merge_size",
                  "pos_emb_height", "pos_emb_width")
_WORD = re.compile(r"\w+|[^\w\s]")


class CaptionVocab:
    """Word-level ids for captions: id 0 pads, id 1 stands for any word not in the vocabulary."""

    PAD, UNK = 0, 1

    def __init__(self, words: list[str]):
        if len(set(words)) != len(words):
            raise ValueError("CaptionVocab words must be distinct")
        self.words = list(words)
        self.ids = {w: i + 2 for i, w in enumerate(self.words)}

    @staticmethod
    def split(text: str) -> list[str]:
        return _WORD.findall(text.lower())

    @classmethod
    def from_texts(cls, texts: list[str]) -> "CaptionVocab":
        """Every word of ``texts``, in order of first appearance."""
        return cls(list(dict.fromkeys(w for t in texts for w in cls.split(t))))

    def __len__(self) -> int:
        return len(self.words) + 2

    def encode(self, texts: list[str], max_len: int) -> torch.Tensor:
        """[N, L] int64 ids, right-padded with 0 to the longest caption (L <= ``max_len``; longer ones raise)."""
        rows = [[self.ids.get(w, self.UNK) for w in self.split(t)] for t in texts]
        width = max(1, max(len(r) for r in rows))
        if width > max_len:
            raise ValueError(f"a caption has {width} tokens, more than the caption encoder's {max_len}")
        return torch.tensor([r + [self.PAD] * (width - len(r)) for r in rows], dtype=torch.int64)


class CaptionEncoder(nn.Module):
    """``forward(ids [N, L]) -> [N, E]`` (not normalised); pad id 0."""

    def __init__(self, vocab_size: int, dim: int, num_layers: int, num_heads: int, embed_dim: int,
                 max_len: int = 64):
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, num_heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, embed_dim, bias=False)

    def forward(self, ids_NL: torch.Tensor) -> torch.Tensor:
        if ids_NL.ndim != 2 or ids_NL.shape[1] > self.max_len:
            raise ValueError(f"caption ids must be [captions, <= {self.max_len}], got {tuple(ids_NL.shape)}")
        pad_NL = ids_NL == CaptionVocab.PAD
        x = self.tok(ids_NL) + self.pos[:ids_NL.shape[1]]
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad_NL)
        keep = (~pad_NL).unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.proj(pooled)


def pool_images(x_TD: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
    """[T, D] packed patch features -> [N, D], the mean over each image's rows·cols patches."""
    counts = grid_hw.prod(-1).to(x_TD.device)
    segment = torch.repeat_interleave(torch.arange(len(counts), device=x_TD.device), counts)
    if segment.numel() != x_TD.shape[0]:
        raise ValueError(f"image_grid_hw describes {segment.numel()} patches, the features hold {x_TD.shape[0]}")
    sums = torch.zeros(len(counts), x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device).index_add_(0, segment, x_TD)
    return sums / counts[:, None].to(x_TD.dtype)


def contrastive_loss(image_NE: torch.Tensor, text_NE: torch.Tensor, log_scale: torch.Tensor,
                     groups: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE over a batch of N (image, caption) pairs; embeddings L2-normalised [N, E].

    ``logits = exp(log_scale) · image @ textᵀ`` (the scale capped at 100); ``groups`` [N] int (e.g. a caption
    id): pairs of the same group are positives, each row's target uniform over them (None: the diagonal
    alone). Returns the mean of the image->text and text->image cross-entropies (a scalar)."""
    if image_NE.shape != text_NE.shape or image_NE.ndim != 2:
        raise ValueError(f"image and text embeddings must both be [N, E], got {tuple(image_NE.shape)} and "
                         f"{tuple(text_NE.shape)}")
    n = image_NE.shape[0]
    logits = log_scale.exp().clamp(max=100.0) * image_NE @ text_NE.T
    if groups is None:
        positive = torch.eye(n, dtype=torch.bool, device=logits.device)
    else:
        if groups.shape != (n,):
            raise ValueError(f"groups must be [N={n}], got {tuple(groups.shape)}")
        positive = groups[:, None] == groups[None, :]
    target = positive.to(logits.dtype) / positive.sum(1, keepdim=True)   # symmetric: rows are columns
    image_to_text = -(target * logits.log_softmax(1)).sum(1).mean()
    text_to_image = -(target * logits.T.log_softmax(1)).sum(1).mean()
    return (image_to_text + text_to_image) / 2


class ContrastiveTower(nn.Module):
    """The tower with an image head and a caption encoder, trained by ``contrastive_loss``."""

    def __init__(self, vision: VisionConfig, vocab_size: int, embed_dim: int = 64, text_dim: int = 64,
                 text_layers: int = 2, text_heads: int = 4, max_caption_len: int = 64, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.tower = MoonViT(vision)
        init_vision_weights(self.tower, nn.Module(), generator)   # the tower alone, as the multimodal model inits it
        self.image_proj = nn.Linear(vision.dim, embed_dim, bias=False)
        self.text = CaptionEncoder(vocab_size, text_dim, text_layers, text_heads, embed_dim, max_caption_len)
        with torch.no_grad():
            for p in (self.image_proj.weight, self.text.proj.weight):
                nn.init.normal_(p, std=p.shape[1] ** -0.5, generator=generator)
            nn.init.normal_(self.text.tok.weight, std=0.02, generator=generator)
            nn.init.normal_(self.text.pos, std=0.02, generator=generator)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_images(self, pixel_values: torch.Tensor, grid_hw: torch.Tensor) -> torch.Tensor:
        """Packed images -> [N, E], L2-normalised."""
        return F.normalize(self.image_proj(pool_images(self.tower(pixel_values, grid_hw), grid_hw)), dim=-1)

    def encode_texts(self, ids_NL: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text(ids_NL), dim=-1)

    def forward(self, pixel_values: torch.Tensor, grid_hw: torch.Tensor, ids_NL: torch.Tensor,
                groups: torch.Tensor | None = None) -> torch.Tensor:
        return contrastive_loss(self.encode_images(pixel_values, grid_hw), self.encode_texts(ids_NL),
                                self.log_scale, groups)


# ---------------------------------------------------------------------------------------------- the tower file
def _shaping(config: VisionConfig) -> dict[str, int]:
    return {name: getattr(config, name) for name in SHAPING_FIELDS}


def save_tower(path: str | Path, tower: MoonViT) -> Path:
    """Write the tower's tensors (``vision_tower.*``, fp32) and its config (metadata) as safetensors."""
    from safetensors.torch import save_file

    from kimik3.files import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {TOWER_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in tower.state_dict().items()}
    metadata = {"format": TOWER_FORMAT, "vision_config": json.dumps(dataclasses.asdict(tower.config))}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))   # never a half-written file
    return path


def load_tower(path: str | Path, tower: MoonViT) -> None:
    """Copy the weights of a ``save_tower`` file into ``tower`` (in place, cast to its dtype and device).

    Raises FileNotFoundError for a missing file and ValueError (naming what differs) for a file that is not
    safetensors, holds other names or shapes than the tower's ``vision_tower.*``, or describes another tower."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--vision-init {path}: no such file (a tower written by save_tower, e.g. "
                                "python -m kimik3.train.vision_contrastive --out FILE.safetensors)")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"--vision-init {path}: not a readable safetensors file ({err})") from None
    saved_config = metadata.get("vision_config")
    if saved_config is not None:
        try:
            saved = {k: json.loads(saved_config).get(k) for k in SHAPING_FIELDS}
        except (ValueError, AttributeError):
            raise ValueError(f"--vision-init {path}: unreadable vision_config metadata") from None
        differ = {k: (saved[k], v) for k, v in _shaping(tower.config).items() if saved[k] != v}
        if differ:
            raise ValueError(f"--vision-init {path}: the file's tower differs from the model's (field: file, model): "
                             + ", ".join(f"{k}: {a}, {b}" for k, (a, b) in differ.items()))
    expected = {TOWER_PREFIX + k: v for k, v in tower.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"--vision-init {path}: its names do not match the model's vision tower: missing "
                         f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    shapes = [f"{k}: file {tuple(tensors[k].shape)}, model {tuple(v.shape)}" for k, v in expected.items()
              if tuple(tensors[k].shape) != tuple(v.shape)]
    if shapes:
        raise ValueError(f"--vision-init {path}: shapes differ from the model's vision tower: " + "; ".join(shapes[:5]))
    with torch.no_grad():
        for k, v in expected.items():
            if not tensors[k].is_floating_point():
                raise ValueError(f"--vision-init {path}: {k} is {tensors[k].dtype}, not a float tensor")
            v.copy_(tensors[k].to(device=v.device, dtype=v.dtype))


__all__ = ["CaptionEncoder", "CaptionVocab", "ContrastiveTower", "contrastive_loss", "load_tower", "pool_images",
           "save_tower"]
