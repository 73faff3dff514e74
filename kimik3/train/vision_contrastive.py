"""Contrastive (CLIP-style) pre-training of the vision tower on the generated scenes and their captions.

The scenes are ``kimik3.train.vision_corpus``'s, from the same seed as ``kimik3 train --vision``: the
captioned samples of its train split (a quarter of them), indices 0, 1, 2, ... until ``scenes`` are found,
cycled in a fresh seeded order each epoch. Held-out scenes for the retrieval check are the captioned samples
from index ``HELD_OUT_START`` = 2^31 on, which no training stream draws (``VisionSource`` draws indices below
2^31, this pre-training the first few thousand).

Optimiser: AdamW (betas 0.9, 0.98, weight decay on matrices only), linear warmup then cosine to 10% of
``lr``, gradients clipped at ``grad_clip``. Only the tower is kept (``save_tower``): its image head, the
caption encoder and the temperature exist for the loss alone.

    python -m kimik3.train.vision_contrastive --out runs/tower.safetensors --steps 600
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kimik3.model.vision.config import VisionConfig
from kimik3.model.vision.contrastive import CaptionVocab, ContrastiveTower, save_tower
from kimik3.model.vision.tokens import pack_images
from kimik3.optim.schedule import cosine_lr
from kimik3.train.vision_corpus import make_sample

HELD_OUT_START = 2**31


@dataclass(slots=True)
class ContrastiveArgs:
    steps: int = 600
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 30
    grad_clip: float = 1.0
    seed: int = 0              # the corpus seed (give the multimodal run's --seed) and the weights'
    scenes: int = 8192         # captioned training scenes, cycled
    eval_scenes: int = 1024    # held-out captioned scenes for the retrieval accuracy
    eval_batch: int = 64       # retrieval among this many captions (the training batch's size by default)
    log_every: int = 50

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "scenes", "eval_scenes", "eval_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"contrastive pre-training: {name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 2 or self.eval_batch < 2:
            raise ValueError("contrastive pre-training needs at least 2 pairs per batch (batch_size, eval_batch)")
        if self.lr <= 0 or self.grad_clip <= 0 or self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("contrastive pre-training: lr and grad_clip must be > 0, warmup_steps and "
                             "weight_decay >= 0")


@dataclass(slots=True)
class Scene:
    image: torch.Tensor            # uint8 [H, W, 3] (patched per batch: a pool of float patches would be 6x larger)
    caption: str


def caption_scenes(seed: int, start: int, count: int) -> list[Scene]:
    """The first ``count`` captioned samples of the train split of corpus ``seed``, from index ``start`` on."""
    out: list[Scene] = []
    index = start
    while len(out) < count:
        sample = make_sample(seed, "train", index)
        index += 1
        if sample.kind == "caption":
            out.append(Scene(torch.from_numpy(np.ascontiguousarray(sample.image)), sample.text))
    return out


def collate(scenes: list[Scene], vocab: CaptionVocab, max_len: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixel_values [P, 3·P·P], image_grid_hw [N, 2], caption ids [N, L], caption groups [N])."""
    pixels, grid = pack_images([s.image for s in scenes])
    captions = [s.caption for s in scenes]
    first = {c: i for i, c in reversed(list(enumerate(captions)))}
    groups = torch.tensor([first[c] for c in captions], dtype=torch.int64)
    return pixels, grid, vocab.encode(captions, max_len), groups


@torch.no_grad()
def retrieval_accuracy(model: ContrastiveTower, scenes: list[Scene], vocab: CaptionVocab,
                       batch: int) -> dict[str, float]:
    """Top-1 retrieval within consecutive batches of ``batch`` held-out scenes: image->caption (the likeliest
    caption is the image's own, or a copy of it) and caption->image; ``chance``: the same for a random pick."""
    was_training = model.training
    model.eval()
    hits_i2t = hits_t2i = chance = total = 0.0
    try:
        for start in range(0, len(scenes) - batch + 1, batch):
            pixels, grid, ids, groups = collate(scenes[start:start + batch], vocab, model.text.max_len)
            sim = model.encode_images(pixels, grid) @ model.encode_texts(ids).T
            same = groups[:, None] == groups[None, :]
            hits_i2t += float(same[torch.arange(batch), sim.argmax(1)].sum())
            hits_t2i += float(same[torch.arange(batch), sim.argmax(0)].sum())
            chance += float(same.float().mean(1).sum())
            total += batch
    finally:
        model.train(was_training)
    if total == 0:
        raise ValueError(f"retrieval needs at least one batch of {batch} held-out scenes, got {len(scenes)}")
    return {"image_to_caption": hits_i2t / total, "caption_to_image": hits_t2i / total, "chance": chance / total,
            "n": int(total), "batch": batch}


def _optimizer(model: ContrastiveTower, args: ContrastiveArgs) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    assert len(decay) + len(rest) == len(list(model.parameters()))
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))


def pretrain_tower(vision: VisionConfig, args: ContrastiveArgs, out: str | Path,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Pre-train a ``MoonViT(vision)`` contrastively, write it to ``out`` (``save_tower``) and return a summary:
    losses, held-out retrieval accuracy before and after, wall seconds."""
    start = time.time()
    torch.manual_seed(args.seed)
    train = caption_scenes(args.seed, 0, args.scenes)
    held_out = caption_scenes(args.seed, HELD_OUT_START, args.eval_scenes)
    vocab = CaptionVocab.from_texts([s.caption for s in train])
    model = ContrastiveTower(vision, len(vocab), seed=args.seed)
    optimizer = _optimizer(model, args)
    data_s = time.time() - start
    log(f"contrastive: {len(train)} captioned scenes ({data_s:.0f} s to render), vocabulary {len(vocab)} words, "
        f"tower {sum(p.numel() for p in model.tower.parameters()):,} + heads "
        f"{sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.tower.parameters()):,} "
        "parameters")
    before = retrieval_accuracy(model, held_out, vocab, args.eval_batch)
    losses: list[float] = []
    order: list[int] = []
    for step in range(args.steps):
        if len(order) < args.batch_size:   # a fresh seeded order each epoch
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            order += torch.randperm(len(train), generator=generator).tolist()
        chosen, order = order[:args.batch_size], order[args.batch_size:]
        pixels, grid, ids, groups = collate([train[i] for i in chosen], vocab, model.text.max_len)
        lr = cosine_lr(step, args.steps, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(pixels, grid, ids, groups)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % args.log_every == 0 or step == args.steps - 1:
            recent = float(np.mean(losses[-args.log_every:]))
            log(f"contrastive step {step + 1}/{args.steps}: loss {recent:.3f}, temperature "
                f"{1 / float(model.log_scale.detach().exp().clamp(max=100.0)):.4f}, {time.time() - start:.0f} s")
    after = retrieval_accuracy(model, held_out, vocab, args.eval_batch)
    path = save_tower(out, model.tower)
    summary = {"args": asdict(args), "path": str(path), "vocab": len(vocab), "first_loss": losses[0],
               "final_loss": float(np.mean(losses[-args.log_every:])), "losses": losses,
               "retrieval_before": before, "retrieval_after": after, "wall_s": time.time() - start}
    log(f"contrastive: held-out image->caption top-1 in batches of {args.eval_batch}: "
        f"{before['image_to_caption']:.3f} before, {after['image_to_caption']:.3f} after (chance "
        f"{after['chance']:.3f}); caption->image {after['caption_to_image']:.3f}; tower written to {path}")
    return summary


def main(argv: list[str] | None = None) -> None:
    from kimik3.config.schema import K3Config

    parser = argparse.ArgumentParser(description="contrastive pre-training of the vision tower (for --vision-init)")
    parser.add_argument("--out", required=True, help="the tower file to write (.safetensors)")
    parser.add_argument("--preset", default="tiny-vl", help="a *-vl preset whose tower to pre-train")
    parser.add_argument("--config", help="a K3Config JSON with a vision tower (overrides --preset)")
    defaults = ContrastiveArgs()
    for name in ContrastiveArgs.__slots__:
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    ns = parser.parse_args(argv)
    config = K3Config.from_json(ns.config) if ns.config else K3Config.preset(ns.preset)
    if config.vision is None:
        raise SystemExit(f"{config.name!r} has no vision tower (use a *-vl preset)")
    args = ContrastiveArgs(**{name: getattr(ns, name) for name in ContrastiveArgs.__slots__})
    summary = pretrain_tower(config.vision, args, ns.out)
    summary.pop("losses")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
