"""Contrastive pre-training of the vision tower: the loss against a hand computation, learning on a tiny batch,
and the tower file (exact round trip, clear refusals)."""

import math

import pytest
import torch
from safetensors.torch import save_file

from kimik3.model.vision.config import VisionConfig
from kimik3.model.vision.contrastive import (CaptionVocab, ContrastiveTower, contrastive_loss, load_tower,
                                             pool_images, save_tower)
from kimik3.model.vision.encoder import MoonViT
from kimik3.train.vision_contrastive import caption_scenes, collate, retrieval_accuracy

from tests.model.test_vision import TINY_VISION


def test_loss_matches_a_hand_computation():
    s = 1 / math.sqrt(2)
    image = torch.tensor([[1.0, 0.0], [s, s]])
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    log_scale = torch.tensor(math.log(2.0))
    # logits = 2 · image @ textᵀ = [[2, 0], [2s, 2s]]
    a, b = 2.0, 2 * s
    i2t = (-(a - math.log(math.exp(a) + 1)) - (b - math.log(2 * math.exp(b)))) / 2      # rows
    t2i = (-(a - math.log(math.exp(a) + math.exp(b))) - (b - math.log(1 + math.exp(b)))) / 2   # columns
    assert float(contrastive_loss(image, text, log_scale)) == pytest.approx((i2t + t2i) / 2, rel=1e-6)
    # The same caption twice: both pairs are positives of each other (targets 1/2, 1/2). Image rows see two
    # equal logits (p = 1/2 each: log 2); each caption row sees the images at logits a and b.
    same = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    t2i = -(a + b) / 2 + math.log(math.exp(a) + math.exp(b))
    assert float(contrastive_loss(image, same, log_scale, groups=torch.tensor([0, 0]))) == pytest.approx(
        (math.log(2) + t2i) / 2, rel=1e-6)
    # The scale is capped at 100.
    big = contrastive_loss(image, text, torch.tensor(10.0))
    assert float(big) == pytest.approx(float(contrastive_loss(image, text, torch.tensor(math.log(100.0)))))
    with pytest.raises(ValueError, match="groups"):
        contrastive_loss(image, text, log_scale, groups=torch.tensor([0, 1, 2]))


def test_pool_images_is_the_mean_of_each_image():
    x = torch.arange(10.0).view(5, 2)
    grid = torch.tensor([[1, 2], [3, 1]])
    assert torch.equal(pool_images(x, grid), torch.stack([x[:2].mean(0), x[2:].mean(0)]))
    with pytest.raises(ValueError, match="patches"):
        pool_images(x[:4], grid)


def test_vocab_pads_and_marks_unknown_words():
    vocab = CaptionVocab.from_texts(["a red circle.", "the digit 7."])
    ids = vocab.encode(["a red circle.", "a purple circle."], max_len=8)
    assert ids.shape == (2, 4) and ids[1, 1] == CaptionVocab.UNK and ids[0].tolist() == ids[0].tolist()
    assert vocab.encode(["the digit 7."], 8).tolist() == [[6, 7, 8, 5]]
    with pytest.raises(ValueError, match="more than"):
        vocab.encode(["a red circle."], max_len=3)


def test_the_loss_falls_on_a_tiny_batch():
    torch.manual_seed(0)   # the caption encoder's layers draw their init from the global generator
    scenes = caption_scenes(0, 0, 6)
    vocab = CaptionVocab.from_texts([s.caption for s in scenes])
    model = ContrastiveTower(VisionConfig(**TINY_VISION), len(vocab), embed_dim=16, text_dim=16, text_layers=1,
                             text_heads=2)
    pixels, grid, ids, groups = collate(scenes, vocab, model.text.max_len)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    # A plateau at log 6 (every embedding alike) before the images separate, then a fall to ~0.01 by step 250 at one
    # or two threads alike. (At 3e-3 the loss oscillated after the plateau, 0.16-0.91 at step 200 by thread count.)
    for _ in range(300):
        loss = model(pixels, grid, ids, groups)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * math.log(6) and losses[-1] < 0.1 * losses[0]
    assert retrieval_accuracy(model, scenes, vocab, batch=6)["image_to_caption"] >= 0.5   # chance 1/6


def _tower(seed: int = 0, **changes) -> MoonViT:
    tower = MoonViT(VisionConfig(**{**TINY_VISION, **changes}))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_()
    return tower


def test_tower_file_round_trips_exactly_and_refuses_a_wrong_one(tmp_path):
    saved = _tower(seed=1)
    path = save_tower(tmp_path / "tower.safetensors", saved)
    target = _tower(seed=2)
    load_tower(path, target)
    for (name, a), (_, b) in zip(saved.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name

    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tower(tmp_path / "absent.safetensors", target)
    with pytest.raises(ValueError, match="differs from the model's.*num_layers: 1, 2"):
        load_tower(save_tower(tmp_path / "other.safetensors", _tower(num_layers=1)), target)
    tensors = {f"vision_tower.{k}": v for k, v in saved.state_dict().items()}
    renamed = dict(tensors)
    renamed["vision_tower.patch_embedding.weight"] = renamed.pop("vision_tower.patch_embed.weight")
    save_file(renamed, str(tmp_path / "renamed.safetensors"))    # no metadata: the names alone are checked
    with pytest.raises(ValueError, match="missing \\['vision_tower.patch_embed.weight'\\].*patch_embedding"):
        load_tower(tmp_path / "renamed.safetensors", target)
    reshaped = dict(tensors)
    reshaped["vision_tower.pos_embed"] = torch.zeros(2, 2, 32)
    save_file(reshaped, str(tmp_path / "reshaped.safetensors"))
    with pytest.raises(ValueError, match="shapes differ.*pos_embed: file \\(2, 2, 32\\), model \\(4, 4, 32\\)"):
        load_tower(tmp_path / "reshaped.safetensors", target)
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_tower(tmp_path / "junk.safetensors", target)
