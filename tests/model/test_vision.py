"""MoonViT-V2: token-count rule, 2D RoPE, pixel shuffle, packed attention, parameter counts, the multimodal model."""

import math

import pytest
import torch

from kimik3.config.params import param_counts
from kimik3.config.schema import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.model.vision import (
    K3VLForCausalLM,
    MoonViT,
    VisionConfig,
    fit_size,
    num_image_tokens,
    pack_images,
    pixel_shuffle,
    pixel_unshuffle,
    preprocess_image,
)
from kimik3.model.vision.packing import block_diagonal_attention_reference, packed_attention
from kimik3.model.vision.rope import apply_rope_2d, patch_positions, rope_angles

TINY_VISION = dict(dim=32, num_layers=2, num_heads=2, qkv_dim=32, mlp_hidden=64, pos_emb_height=4, pos_emb_width=4)


# ---------------------------------------------------------------------------------------------- token rule
@pytest.mark.parametrize("height, width, tokens", [
    (3584, 3584, 16_384),          # the seed: 256² patches -> 128²
    (28, 28, 1),
    (1, 1, 1),                     # padded up to one 28 x 28 cell
    (29, 28, 2),                   # one pixel over: padded to two cells
    (1024, 1024, 37 * 37),
    (448, 896, 16 * 32),           # 1:2 aspect ratio
    (896, 448, 32 * 16),
    (100, 30, 4 * 2),
    (3584, 1792, 128 * 64),        # under the budget: native
])
def test_num_image_tokens(height, width, tokens):
    assert num_image_tokens(height, width) == tokens


@pytest.mark.parametrize("height, width", [(7168, 7168), (4800, 3600), (20000, 1000), (3585, 3584)])
def test_large_images_scale_down_within_budget_keeping_aspect(height, width):
    assert num_image_tokens(height, width, max_tokens=10**9) > 16_384      # over the budget at native size
    h, w = fit_size(height, width)
    assert num_image_tokens(height, width) <= 16_384
    assert num_image_tokens(height, width) > 0.9 * 16_384    # scaled no further than needed (1% steps)
    assert abs(h / w - height / width) < 0.02 * height / width
    assert h <= height and w <= width


def test_bad_image_sizes_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="zero-size"):
        num_image_tokens(0, 10)
    with pytest.raises(TypeError):
        num_image_tokens(10.5, 10)
    with pytest.raises(TypeError, match="uint8"):
        preprocess_image(torch.zeros(28, 28, 3))
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        preprocess_image(torch.zeros(28, 28, dtype=torch.uint8))
    with pytest.raises(ValueError, match="zero-size"):
        preprocess_image(torch.zeros(0, 28, 3, dtype=torch.uint8))


def test_preprocess_patches_and_padding():
    image = torch.randint(0, 256, (30, 45, 3), dtype=torch.uint8)
    patches, (rows, cols) = preprocess_image(image)
    assert (rows, cols) == (4, 4) and patches.shape == (16, 3 * 14 * 14)
    first = patches[0].view(3, 14, 14)
    assert torch.allclose(first, image[:14, :14].permute(2, 0, 1).float() / 127.5 - 1)
    # Patch (row 2, col 3) covers pixels [28:42, 42:56]: rows 28-29 and columns 42-44 real, the rest padding 0.
    p = patches[2 * 4 + 3].view(3, 14, 14)
    assert torch.allclose(p[:, :2, :3], image[28:30, 42:45].permute(2, 0, 1).float() / 127.5 - 1)
    assert p[:, 2:].abs().max() == 0 and p[:, :, 3:].abs().max() == 0


# ---------------------------------------------------------------------------------------------- 2D RoPE
def _naive_rope(x_THK, positions, theta=10000.0):
    """Rotate each pair with an explicit 2 x 2 matrix, angle from the pair's axis and frequency."""
    T, H, K = x_THK.shape
    out = torch.empty_like(x_THK, dtype=torch.float64)
    for t in range(T):
        y, x = positions[t].tolist()
        for m in range(K // 2):
            j, axis = divmod(m, 2)
            freq = theta ** (-4 * j / K)
            angle = (x if axis == 0 else y) * freq
            rot = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]],
                               dtype=torch.float64)
            out[t, :, 2 * m:2 * m + 2] = x_THK[t, :, 2 * m:2 * m + 2].double() @ rot.T
    return out


def test_rope_2d_matches_naive_rotation():
    torch.manual_seed(0)
    grid = torch.tensor([[2, 3], [4, 2]])
    positions = patch_positions(grid)
    assert positions[:6].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert positions[6:8].tolist() == [[0, 0], [0, 1]]           # every image restarts at (0, 0)
    x = torch.randn(positions.shape[0], 2, 16)
    got = apply_rope_2d(x, rope_angles(positions, 16))
    assert torch.allclose(got.double(), _naive_rope(x, positions), atol=1e-5)


def test_rope_2d_scores_depend_on_relative_offset_only():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def score(pq, pk):
        aq, ak = rope_angles(torch.tensor([pq]), 8), rope_angles(torch.tensor([pk]), 8)
        return float((apply_rope_2d(q, aq) * apply_rope_2d(k, ak)).sum())

    assert score((3, 5), (1, 2)) == pytest.approx(score((10, 7), (8, 4)), abs=1e-5)
    assert score((3, 5), (1, 2)) != pytest.approx(score((3, 5), (2, 1)), abs=1e-3)  # x and y are told apart


# ---------------------------------------------------------------------------------------------- pixel shuffle
def test_pixel_shuffle_groups_2x2_neighbours_and_inverts():
    rows, cols, d = 4, 6, 3
    x = torch.arange(rows * cols * d, dtype=torch.float32).view(rows * cols, d)
    merged = pixel_shuffle(x, rows, cols)
    assert merged.shape == (2 * 3, 4 * d)
    # Token (1, 2) holds patches (2, 4), (2, 5), (3, 4), (3, 5) in that order.
    expected = torch.cat([x[r * cols + c] for r, c in ((2, 4), (2, 5), (3, 4), (3, 5))])
    assert torch.equal(merged[1 * 3 + 2], expected)
    assert torch.equal(pixel_unshuffle(merged, rows, cols), x)
    with pytest.raises(ValueError, match="2 x 2"):
        pixel_shuffle(x[:15], 3, 5)


# ---------------------------------------------------------------------------------------------- packing
def test_packed_attention_matches_block_diagonal_reference():
    torch.manual_seed(2)
    cu = torch.tensor([0, 6, 10, 16, 40])            # two images of 6 patches batch together, others alone
    q, k, v = (torch.randn(40, 2, 8) for _ in range(3))
    assert torch.allclose(packed_attention(q, k, v, cu), block_diagonal_attention_reference(q, k, v, cu), atol=1e-5)


def test_attention_stays_inside_each_image():
    torch.manual_seed(3)
    tower = MoonViT(VisionConfig(**TINY_VISION))
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.2)
    images = [torch.randint(0, 256, s, dtype=torch.uint8) for s in ((56, 84, 3), (28, 56, 3), (84, 56, 3))]
    pixels, grid = pack_images(images)
    out = tower(pixels, grid)
    assert out.shape == (pixels.shape[0], 32)
    images[1] = 255 - images[1]                       # perturb the middle image only
    pixels2, _ = pack_images(images)
    out2 = tower(pixels2, grid)
    n0, n1 = 4 * 6, 2 * 4
    assert torch.equal(out[:n0], out2[:n0]) or torch.allclose(out[:n0], out2[:n0], atol=1e-6)
    assert torch.allclose(out[n0 + n1:], out2[n0 + n1:], atol=1e-6)
    assert (out[n0:n0 + n1] - out2[n0:n0 + n1]).abs().max() > 1e-2
    # Each image alone gives what it gives packed.
    alone, grid0 = pack_images(images[2:])
    assert torch.allclose(tower(alone, grid0), out2[n0 + n1:], atol=1e-5)


def test_bad_packed_inputs_are_refused():
    tower = MoonViT(VisionConfig(**TINY_VISION))
    with pytest.raises(ValueError, match="describes"):
        tower(torch.zeros(10, 588), torch.tensor([[2, 2]]))
    with pytest.raises(ValueError, match="merge"):
        tower(torch.zeros(3, 588), torch.tensor([[1, 3]]))
    with pytest.raises(TypeError, match="float"):
        tower(torch.zeros(4, 588, dtype=torch.int64), torch.tensor([[2, 2]]))
    with pytest.raises(ValueError, match="588"):
        tower(torch.zeros(4, 500), torch.tensor([[2, 2]]))


# ---------------------------------------------------------------------------------------------- configs and counts
def test_full_config_is_401m_and_counts_match_the_meta_model():
    config = K3Config.preset("k3-vl")
    v = config.vision
    assert (v.num_layers, v.patch_size, v.merge_size) == (27, 14, 2)
    counts = param_counts(config)
    assert abs(counts["vision_tower"] - 401e6) / 401e6 < 0.01
    model = K3VLForCausalLM(config, device="meta")
    assert sum(p.numel() for p in model.vision_tower.parameters()) == counts["vision_tower"]
    assert sum(p.numel() for p in model.mm_projector.parameters()) == counts["mm_projector"]
    assert counts["total_with_vision"] == counts["total"] + counts["vision_tower"] + counts["mm_projector"]
    # The port's debug tower with its projector: the reference's 36,486,656.
    assert param_counts(K3Config.preset("debug-vl"))["vision_total"] == 36_486_656


def test_text_config_json_unchanged_and_vision_round_trips():
    assert "vision" not in K3Config.preset("tiny").to_dict()
    config = K3Config.preset("tiny-vl")
    assert K3Config.from_json(config.to_json()) == config
    bad = config.to_dict()
    bad["vision"]["num_heads"] = 3
    with pytest.raises(ValueError, match="vision.num_heads"):
        K3Config.from_dict(bad)
    bad = config.to_dict()
    bad["vision"]["colour"] = 1
    with pytest.raises(ValueError, match="vision.colour"):
        K3Config.from_dict(bad)


# ---------------------------------------------------------------------------------------------- the multimodal model
def _small_vl_config() -> K3Config:
    """The suite's small text model (``tests/train/small_run.py``), 2 layers, vocabulary 256, with the tiny tower."""
    from tests.train.small_run import small_config

    spec = small_config().to_dict()
    spec.update(name="small-vl", vocab_size=256, num_layers=2, vision=TINY_VISION)
    return K3Config.from_dict(spec)


def test_images_replace_placeholders_and_text_model_is_unchanged():
    config = _small_vl_config()
    model = K3VLForCausalLM(config, seed=0)
    text_spec = config.to_dict()
    del text_spec["vision"]
    text = K3ForCausalLM(K3Config.from_dict(text_spec), seed=0)
    text_keys = set(text.state_dict())
    assert text_keys <= set(model.state_dict())
    assert all(torch.equal(text.state_dict()[k], model.state_dict()[k]) for k in text_keys)   # same init
    ids = torch.randint(1, 200, (2, 12))
    with torch.no_grad():
        assert torch.equal(text(ids).logits, model(ids).logits)   # no image: the text model, exactly

    images = [torch.randint(0, 256, (56, 28, 3), dtype=torch.uint8), torch.randint(0, 256, (28, 84, 3),
                                                                                    dtype=torch.uint8)]
    pixels, grid = pack_images(images)
    pad = config.vocab_size - 1
    ids = torch.randint(1, 200, (2, 12))
    ids[0, 3:5] = pad            # image 0: 2 tokens
    ids[1, 1:4] = pad            # image 1: 3 tokens
    with torch.no_grad():
        out = model(ids, pixel_values=pixels, image_grid_hw=grid).logits
        pixels2 = pixels.clone()
        pixels2[grid[0].prod():] += 1.0                          # change image 1 only
        out2 = model(ids, pixel_values=pixels2, image_grid_hw=grid).logits
    assert torch.allclose(out[0], out2[0], atol=1e-6)           # row 0 never sees image 1
    assert (out[1, 1:] - out2[1, 1:]).abs().max() > 1e-4
    assert torch.allclose(out[1, :1], out2[1, :1], atol=1e-6)   # causal: before the image, nothing changes

    labels = torch.roll(ids, -1, 1)
    loss = model(ids, labels=labels, pixel_values=pixels, image_grid_hw=grid).loss
    loss.backward()
    assert model.vision_tower.patch_embed.weight.grad.abs().sum() > 0   # trained end to end
    with pytest.raises(ValueError, match="placeholders"):
        model(ids[:, :4], pixel_values=pixels, image_grid_hw=grid)
    with pytest.raises(ValueError, match="no pixel_values"):
        model(ids)
