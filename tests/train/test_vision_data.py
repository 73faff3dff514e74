"""The generated image-text corpus, the multimodal batches and a few steps of `kimik3 train --vision`."""

import collections

import numpy as np
import pytest
import torch

from kimik3.model.vision import K3VLForCausalLM, num_image_tokens
from kimik3.parallel.context import training_context
from kimik3.tokenizer import MEDIA_PAD
from kimik3.train.trainer import Trainer
from kimik3.train.vision_corpus import CELL, CHOICES, COLOURS, KINDS, held_out_questions, make_sample
from kimik3.train.vision_data import VisionSource, bind_image_token, evaluate_qa, wilson_interval

from tests.corpus import write_code_corpus
from tests.model.test_vision import TINY_VISION
from tests.train.small_run import small_args, small_config, write_small_vision_run_inputs


def test_corpus_is_deterministic_and_splits_differ():
    a, b = make_sample(3, "train", 17), make_sample(3, "train", 17)
    assert np.array_equal(a.image, b.image) and a.text == b.text and a.answer == b.answer
    train = {make_sample(0, "train", i).image.tobytes() for i in range(50)}
    test = {s.image.tobytes() for s in held_out_questions(0, 50)}
    assert not train & test
    assert held_out_questions(1, 5)[0].image.tobytes() != held_out_questions(0, 5)[0].image.tobytes()
    with pytest.raises(ValueError):
        make_sample(0, "val", 0)


def test_answers_match_the_images_and_are_balanced():
    samples = held_out_questions(0, 600)
    sizes = collections.Counter(s.image.shape[:2] for s in samples)
    assert len(sizes) == 9                                      # 56/84/112 x 56/84/112: several aspect ratios
    answers = collections.defaultdict(collections.Counter)
    for s in samples:
        assert s.answer in s.choices == CHOICES[s.kind]
        answers[s.kind][s.answer] += 1
        image = s.image.astype(int)
        if s.kind == "colour":   # the asked shape's centre pixel has the answer's colour
            (_, colour, cy, cx), = [o for o in s.objects if o[0] == s.text.split()[-1].rstrip("?")]
            assert colour == s.answer and tuple(image[cy, cx]) == COLOURS[colour]
        elif s.kind == "count":
            assert len(s.objects) == ("one", "two", "three", "four").index(s.answer) + 1
        elif s.kind == "side":
            target = s.objects[0]
            assert (target[3] < s.image.shape[1] / 2) == (s.answer == "left")
            assert tuple(image[target[2], target[3]]) == COLOURS[target[1]]
        elif s.kind == "digit":
            assert s.objects[0][1] == s.answer and image.max() > 150   # a bright digit is drawn
        elif s.kind == "shape":
            assert s.objects[0][0] == s.answer
    assert set(answers) == set(KINDS)
    for kind, counts in answers.items():   # every answer present, none above twice its fair share
        assert set(counts) == set(CHOICES[kind])
        assert max(counts.values()) < 2 * sum(counts.values()) / len(CHOICES[kind])
    assert all(s.objects[0][2] < s.image.shape[0] and CELL == 28 for s in samples)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    corpus = write_code_corpus(tmp_path_factory.mktemp("corpus"), 30)
    return VisionSource.load(str(corpus), 640, training_context(torch.device("cpu"), None), seed=0,
                             text_fraction=0.25)


def test_batches_place_one_placeholder_per_image_token(source):
    x, y, extra = source.batch_at(5, 0, 6, 96)
    again = source.batch_at(5, 0, 6, 96)
    assert torch.equal(x, again[0]) and torch.equal(extra["pixel_values"], again[2]["pixel_values"])
    assert torch.equal(x[:, 1:], y[:, :-1])                     # next-token labels
    pad = source.media[MEDIA_PAD]
    grid = extra["image_grid_hw"]
    assert int((x == pad).sum()) == int((grid // 2).prod(-1).sum())
    assert extra["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    blank = VisionSource(source.text, seed=0, blank=True)
    bx, _, bextra = blank.batch_at(5, 0, 6, 96)
    assert torch.equal(bx, x) and bextra["pixel_values"].unique().numel() == 1   # same tokens, nothing to see
    sample = held_out_questions(0, 1)[0]
    assert source.prompt_ids(sample).count(pad) == num_image_tokens(*sample.image.shape[:2])


def test_qa_evaluation_of_an_untrained_model_is_near_chance(source):
    spec = small_config().to_dict()
    spec["vision"] = TINY_VISION
    from kimik3.config.schema import K3Config

    model = K3VLForCausalLM(bind_image_token(K3Config.from_dict(spec), source), seed=0)
    result = evaluate_qa(model, source, count=60)
    assert result.n == 60 and set(result.total) <= set(KINDS)
    assert 0.0 <= result.accuracy <= 0.7
    assert "all" in result.table("x")
    lo, hi = wilson_interval(50, 100)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(0.19, abs=0.01)


def test_vision_training_smoke(tmp_path):
    corpus, path = write_small_vision_run_inputs(tmp_path)
    args = small_args(path, corpus, tmp_path / "run", steps=12, seq_len=64, batch_size=4, vision=True,
                      eval_every=100, checkpoint_every=100, lr=1e-2)
    trainer = Trainer(args, log=lambda _: None)
    assert isinstance(trainer.model, K3VLForCausalLM)
    assert trainer.model.image_token_id == trainer.data.media[MEDIA_PAD]
    tower = trainer.model.vision_tower.patch_embed.weight.detach().clone()
    summary = trainer.run()
    losses = [r["loss"] for r in summary.history]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    assert not torch.equal(tower, trainer.model.vision_tower.patch_embed.weight)   # the tower trains
    loaded = K3VLForCausalLM.from_pretrained(summary.run_dir)
    assert loaded.config.vision.image_token_id == trainer.data.media[MEDIA_PAD]
