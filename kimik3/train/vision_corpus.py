"""A generated image-text corpus (no download): rendered scenes with captions and questions the image answers.

Every sample is a pure function of (seed, split, index) (``make_sample``), so the corpus needs no storage,
the train split is as large as training wants, and the test split is fixed by its seed: its images come
from a random stream of their own (split id 1; train is 0), so no test image is a training image.

Scenes (numpy rasterisation): a dark noisy canvas of 56, 84 or 112 pixels a side (aspect ratios 1:2 to 2:1),
cut into 28 x 28 cells (one LM token each after patch 14 and the 2 x 2 merge). Objects sit one per cell,
jittered: a circle, square or triangle of 16-24 pixels in red, green, blue or yellow; or one rendered digit
(a 5 x 7 bitmap font scaled 3x) anywhere on the canvas.

Question kinds, each with its answer drawn uniformly first and the scene built to match, so the question's
text says nothing about the answer (a model that never sees the image can only guess; chance in brackets):

- ``colour``: "what colour is the <shape>?" (1/4), the other objects of other shapes;
- ``shape``: "what shape is the <colour> object?" (1/3), the other objects of other colours;
- ``count``: "how many shapes are there?" one to four (1/4);
- ``side``: "is the <colour> <shape> on the left or the right?" (1/2), its centre in the left or right third;
- ``digit``: "what digit is shown?" (1/10).

A training sample is either a caption ("a red circle, a blue square.", "the digit 7.") or one question and
its answer; a test sample is always a question.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

COLOURS = {"red": (220, 45, 45), "green": (45, 190, 60), "blue": (55, 90, 235), "yellow": (235, 210, 50)}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = ("one", "two", "three", "four")
SIDES = ("left", "right")
DIGITS = tuple("0123456789")
KINDS = ("colour", "shape", "count", "side", "digit")
CHOICES = {"colour": tuple(COLOURS), "shape": SHAPES, "count": COUNT_WORDS, "side": SIDES, "digit": DIGITS}
SIDES_PX = (56, 84, 112)
CELL = 28
SPLITS = {"train": 0, "test": 1}
CAPTION_FRACTION = 0.25   # of training samples

# 5 x 7 bitmap digits, one string of 7 rows of 5 bits each.
_FONT = {
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
}
DIGIT_SCALE = 3


@dataclass(slots=True)
class Sample:
    image: np.ndarray          # uint8 [H, W, 3]
    kind: str                  # a question kind, or "caption"
    text: str                  # the question ("what colour is the circle?") or the caption
    answer: str | None         # None for a caption
    choices: tuple[str, ...]   # the kind's possible answers (empty for a caption)
    objects: list[tuple[str, str, int, int]]  # (shape or "digit", colour or the digit, centre y, centre x)


def _canvas(rng: np.random.Generator) -> np.ndarray:
    h, w = (int(rng.choice(SIDES_PX)) for _ in range(2))
    base = rng.integers(20, 60)
    noise = rng.integers(-8, 9, size=(h, w, 1))
    return np.clip(base + noise, 0, 255).repeat(3, axis=2).astype(np.uint8)


def _draw(image: np.ndarray, shape: str, colour: str, cy: int, cx: int, size: int) -> None:
    h, w = image.shape[:2]
    yy, xx = np.mgrid[0:h, 0:w]
    r = size / 2
    if shape == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    elif shape == "square":
        mask = (np.abs(yy - cy) <= r * 0.85) & (np.abs(xx - cx) <= r * 0.85)
    else:   # an upward triangle: its half-width grows from 0 at the top to r at the bottom
        top = cy - r
        mask = (yy >= top) & (yy <= cy + r) & (np.abs(xx - cx) <= (yy - top) / 2)
    image[mask] = COLOURS[colour]


def _draw_digit(image: np.ndarray, digit: str, y0: int, x0: int, colour: tuple[int, int, int]) -> None:
    rows = _FONT[digit].split()
    for r, bits in enumerate(rows):
        for c, bit in enumerate(bits):
            if bit == "1":
                image[y0 + r * DIGIT_SCALE:y0 + (r + 1) * DIGIT_SCALE,
                      x0 + c * DIGIT_SCALE:x0 + (c + 1) * DIGIT_SCALE] = colour


def _cells(image: np.ndarray) -> list[tuple[int, int]]:
    h, w = image.shape[:2]
    return [(r, c) for r in range(h // CELL) for c in range(w // CELL)]


def _place(rng: np.random.Generator, image: np.ndarray, items: list[tuple[str, str]],
           cells: list[tuple[int, int]]) -> list[tuple[str, str, int, int]]:
    """Draw ``items`` (shape, colour) into the given cells, jittered inside each; returns what was drawn."""
    drawn = []
    for (shape, colour), (r, c) in zip(items, cells):
        size = int(rng.integers(16, 25))
        slack = (CELL - size) // 2
        cy = r * CELL + CELL // 2 + int(rng.integers(-slack, slack + 1))
        cx = c * CELL + CELL // 2 + int(rng.integers(-slack, slack + 1))
        _draw(image, shape, colour, cy, cx, size)
        drawn.append((shape, colour, cy, cx))
    return drawn


def _pick_cells(rng: np.random.Generator, image: np.ndarray, n: int) -> list[tuple[int, int]]:
    cells = _cells(image)
    order = rng.permutation(len(cells))[:n]
    return [cells[i] for i in order]


def _others(rng: np.random.Generator, pool: tuple[str, ...], exclude: str, n: int) -> list[str]:
    rest = [x for x in pool if x != exclude]
    return [rest[i] for i in rng.permutation(len(rest))[:n]]


def _caption(objects: list[tuple[str, str, int, int]]) -> str:
    if objects and objects[0][0] == "digit":
        return f"the digit {objects[0][1]}."
    ordered = sorted(objects, key=lambda o: (o[2] // CELL, o[3]))
    return ", ".join(f"a {colour} {shape}" for shape, colour, _, _ in ordered) + "."


def make_sample(seed: int, split: str, index: int) -> Sample:
    """The ``index``-th sample of ``split`` ("train" or "test") of the corpus seeded ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if index < 0:
        raise ValueError(f"sample index must be >= 0, got {index}")
    rng = np.random.default_rng([seed, SPLITS[split], index])
    kind = KINDS[int(rng.integers(len(KINDS)))]
    image = _canvas(rng)
    capacity = len(_cells(image))
    extra = int(rng.integers(0, min(3, capacity - 1) + 1))    # distractors
    if kind == "colour":
        answer, target = str(rng.choice(tuple(COLOURS))), str(rng.choice(SHAPES))
        extra = min(extra, len(SHAPES) - 1)
        items = [(target, answer)] + [(s, str(rng.choice(tuple(COLOURS)))) for s in _others(rng, SHAPES, target, extra)]
        objects = _place(rng, image, items, _pick_cells(rng, image, len(items)))
        question = f"what colour is the {target}?"
    elif kind == "shape":
        answer, target = str(rng.choice(SHAPES)), str(rng.choice(tuple(COLOURS)))
        items = [(answer, target)] + [(str(rng.choice(SHAPES)), c) for c in _others(rng, tuple(COLOURS), target, extra)]
        objects = _place(rng, image, items, _pick_cells(rng, image, len(items)))
        question = f"what shape is the {target} object?"
    elif kind == "count":
        n = int(rng.integers(1, len(COUNT_WORDS) + 1))
        answer = COUNT_WORDS[n - 1]
        items = [(str(rng.choice(SHAPES)), str(rng.choice(tuple(COLOURS)))) for _ in range(n)]
        objects = _place(rng, image, items, _pick_cells(rng, image, n))
        question = "how many shapes are there?"
    elif kind == "side":
        answer = str(rng.choice(SIDES))
        cols = image.shape[1] // CELL
        wanted = [c for c in range(cols) if (c + 0.5) * CELL < image.shape[1] / 3] if answer == "left" else \
                 [c for c in range(cols) if (c + 0.5) * CELL > 2 * image.shape[1] / 3]
        col = int(rng.choice(wanted))
        cell = (int(rng.integers(image.shape[0] // CELL)), col)
        shape, colour = str(rng.choice(SHAPES)), str(rng.choice(tuple(COLOURS)))
        rest = [x for x in _cells(image) if x[1] == (cols - 1 - col) and 2 * col != cols - 1]
        items, cells = [(shape, colour)], [cell]
        if rest and extra:   # one distractor of another colour on the other side
            items.append((str(rng.choice(SHAPES)), _others(rng, tuple(COLOURS), colour, 1)[0]))
            cells.append(rest[int(rng.integers(len(rest)))])
        objects = _place(rng, image, items, cells)
        question = f"is the {colour} {shape} on the left or the right?"
    else:
        answer = str(rng.choice(DIGITS))
        dh, dw = 7 * DIGIT_SCALE, 5 * DIGIT_SCALE
        y0 = int(rng.integers(0, image.shape[0] - dh + 1))
        x0 = int(rng.integers(0, image.shape[1] - dw + 1))
        _draw_digit(image, answer, y0, x0, tuple(int(v) for v in rng.integers(170, 256, size=3)))
        objects = [("digit", answer, y0 + dh // 2, x0 + dw // 2)]
        question = "what digit is shown?"
    if split == "train" and rng.random() < CAPTION_FRACTION:
        return Sample(image, "caption", _caption(objects), None, (), objects)
    return Sample(image, kind, question, answer, CHOICES[kind], objects)


def held_out_questions(seed: int, count: int) -> list[Sample]:
    """The first ``count`` samples of the test split (questions only)."""
    return [make_sample(seed, "test", i) for i in range(count)]
