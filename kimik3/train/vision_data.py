"""Multimodal batches for ``kimik3 train --vision``: the generated image-text corpus with the text corpus,
and the held-out question-answer evaluation.

Tokens: the text corpus's byte-level BPE trained to ``vocab_size - 3`` entries, then the three media tokens
(``kimik3.tokenizer.add_media_tokens``); ``bind_image_token`` writes ``<|media_pad|>``'s id into the model
config (the vocabulary's last id when the BPE fills its entries). One sample is ``<|media_begin|>``,
``num_image_tokens(H, W)`` placeholders, ``<|media_end|>``, then the caption, or ``Q: <question> A:`` and
`` <answer>``, then a newline and EOS.

A batch row is either a window of the text corpus (a ``text_fraction`` of the rows) or image-text samples
packed back to back, its tail filled from the text corpus. Every image of the batch goes into one packed
``pixel_values`` [patches, 3·14·14] with ``image_grid_hw`` [images, 2], in the order their placeholders appear
row by row (what ``K3VLForCausalLM`` expects). Labels are the next tokens; the model ignores those that are
placeholders, so the loss is on text. The batch of step s is a pure function of (seed, s), as for text.

``blank=True`` gives the text-only baseline: the same samples with every image replaced by a uniform grey
one of the same size (the same tokens, nothing to see).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kimik3.config.schema import K3Config
from kimik3.model.vision.tokens import num_image_tokens, pack_images
from kimik3.parallel.context import ParallelContext
from kimik3.tokenizer import EOS, MEDIA_BEGIN, MEDIA_END, MEDIA_PAD, MEDIA_TOKENS, add_media_tokens
from kimik3.train.data import load_corpus
from kimik3.train.source import CorpusSource
from kimik3.train.tokenizer import tokenize_corpus
from kimik3.train.vision_corpus import KINDS, Sample, held_out_questions, make_sample

CORPUS_VERSION = "scenes-v1"   # in the fingerprint: a change of the generator makes old checkpoints refuse to resume


@dataclass
class VisionSource:
    """A ``DataSource`` (``kimik3.train.source``) whose ``batch_at`` also returns the batch's images."""

    text: CorpusSource
    seed: int = 0
    text_fraction: float = 0.25
    blank: bool = False
    media: dict[str, int] = field(default_factory=dict)
    sample_prompt: str = CorpusSource.sample_prompt

    def __post_init__(self) -> None:
        if not 0.0 <= self.text_fraction < 1.0:
            raise ValueError(f"--vision-text-fraction must be in [0, 1), got {self.text_fraction}")
        self.media = add_media_tokens(self.text.tokenizer, self.text.vocab_size)
        self._eos = self.text.tokenizer.token_to_id(EOS)
        self._piece_cache: dict[str, list[int]] = {}

    @classmethod
    def load(cls, data: str | None, vocab_size: int, ctx: ParallelContext, **kwargs: Any) -> "VisionSource":
        corpus = load_corpus(data)
        with ctx.main_first():
            tokenized = tokenize_corpus(corpus, vocab_size - len(MEDIA_TOKENS))
        return cls(CorpusSource(corpus, tokenized.tokenizer, tokenized.train_ids, tokenized.val_ids, vocab_size),
                   **kwargs)

    # ------------------------------------------------------------------ DataSource
    @property
    def tokenizer(self) -> Any:
        return self.text.tokenizer

    @property
    def unigram(self) -> float:
        return self.text.unigram

    @property
    def fingerprint(self) -> str:
        key = f"{self.text.fingerprint}|{CORPUS_VERSION}|{self.seed}|{self.text_fraction}|{self.blank}"
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def describe(self) -> str:
        images = "blanked images (text-only baseline)" if self.blank else "rendered scenes"
        return (f"{self.text.describe()}; with generated image-text samples ({images}, corpus seed {self.seed}), "
                f"{self.text_fraction:.0%} of the rows text only")

    def eval_windows(self, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text.eval_windows(seq_len, max_windows)

    def with_tokenizer(self, tokenizer: Any) -> "VisionSource":
        return VisionSource(self.text.with_tokenizer(tokenizer), self.seed, self.text_fraction, self.blank)

    # ------------------------------------------------------------------ samples -> tokens
    def _encode(self, text: str) -> list[int]:
        if text not in self._piece_cache:
            self._piece_cache[text] = self.tokenizer.encode(text).ids
        return self._piece_cache[text]

    def image_of(self, sample: Sample) -> torch.Tensor:
        image = torch.from_numpy(np.ascontiguousarray(sample.image))
        return torch.full_like(image, 128) if self.blank else image

    def image_ids(self, sample: Sample) -> list[int]:
        h, w = sample.image.shape[:2]
        return ([self.media[MEDIA_BEGIN]] + [self.media[MEDIA_PAD]] * num_image_tokens(h, w)
                + [self.media[MEDIA_END]])

    def prompt_ids(self, sample: Sample) -> list[int]:
        """The image and the question up to ``A:`` (a caption sample: the image alone)."""
        text = self._encode(f"Q: {sample.text} A:") if sample.answer is not None else []
        return self.image_ids(sample) + text

    def sample_ids(self, sample: Sample) -> list[int]:
        if sample.answer is None:
            body = self._encode(" " + sample.text)
        else:
            body = self._encode(f"Q: {sample.text} A:") + self._encode(" " + sample.answer)
        return self.image_ids(sample) + body + self._encode("\n") + [self._eos]

    def batch_at(self, step: int, seed: int, batch_size: int,
                 seq_len: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(input_ids [B, T], labels [B, T], {"pixel_values", "image_grid_hw"}) of ``step``."""
        rng = np.random.default_rng([seed, step, 7])
        text_ids, text_labels = self.text.batch_at(step, seed, batch_size, seq_len)
        rows, images = [], []
        for b in range(batch_size):
            if rng.random() < self.text_fraction:
                rows.append(None)
                continue
            row: list[int] = []
            while True:
                sample = make_sample(self.seed, "train", int(rng.integers(2**31)))
                ids = self.sample_ids(sample)
                if len(row) + len(ids) > seq_len:
                    break
                row += ids
                images.append(self.image_of(sample))
            rows.append(row)
        inputs, labels = text_ids.clone(), text_labels.clone()
        for b, row in enumerate(rows):
            if row:
                # The samples, then the rest of the text window: after the last sample's EOS, its next token.
                n = len(row)
                inputs[b, :n] = torch.tensor(row)
                labels[b, :n - 1] = torch.tensor(row[1:])
                labels[b, n - 1] = text_ids[b, n] if n < seq_len else text_labels[b, n - 1]
        extra: dict[str, torch.Tensor] = {}
        if images:
            pixels, grid = pack_images(images)
            extra = {"pixel_values": pixels, "image_grid_hw": grid}
        return inputs, labels, extra


def bind_image_token(config: K3Config, source: VisionSource) -> K3Config:
    """``config`` with its placeholder id set to the source tokenizer's ``<|media_pad|>`` (the BPE of a small
    corpus may stop short of ``vocab_size - 3`` entries, so the id is read, not assumed); saved with the run."""
    if config.vision is None:
        raise ValueError(f"--vision needs a model config with a vision tower; {config.name!r} has none (use a *-vl "
                         "preset, e.g. tiny-vl)")
    vision = dataclasses.replace(config.vision, image_token_id=source.media[MEDIA_PAD])
    return dataclasses.replace(config, vision=vision)


# ---------------------------------------------------------------------------------------------- evaluation
@dataclass(slots=True)
class QAResult:
    correct: dict[str, int]
    total: dict[str, int]
    chance: dict[str, float]

    @property
    def accuracy(self) -> float:
        return sum(self.correct.values()) / max(1, sum(self.total.values()))

    @property
    def n(self) -> int:
        return sum(self.total.values())

    @property
    def chance_overall(self) -> float:
        return sum(self.chance[k] * self.total[k] for k in self.total) / max(1, self.n)

    def interval(self, kind: str | None = None, z: float = 1.96) -> tuple[float, float]:
        """The Wilson 95% interval of the accuracy (overall, or of one kind)."""
        k = sum(self.correct.values()) if kind is None else self.correct[kind]
        n = self.n if kind is None else self.total[kind]
        return wilson_interval(k, n, z)

    def table(self, label: str) -> str:
        lines = []
        for kind in [*self.total, None]:
            acc = (self.accuracy if kind is None else self.correct[kind] / max(1, self.total[kind]))
            lo, hi = self.interval(kind)
            chance = self.chance_overall if kind is None else self.chance[kind]
            n = self.n if kind is None else self.total[kind]
            lines.append(f"{label:<12} {kind or 'all':<8} {n:>5} {acc:>8.3f}  [{lo:.3f}, {hi:.3f}]  {chance:.3f}")
        return "\n".join(lines)


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


@torch.no_grad()
def evaluate_qa(model: torch.nn.Module, source: VisionSource, count: int = 1000, batch_rows: int = 64,
                seed: int | None = None) -> QAResult:
    """Accuracy on the first ``count`` held-out questions: each choice's answer tokens scored by the model's
    log-probability after the image and the question (teacher forced); the likeliest choice is the answer.
    The images are blanked when ``source.blank`` (the text-only baseline is evaluated as it was trained)."""
    samples = held_out_questions(source.seed if seed is None else seed, count)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    # Rows of (sample, choices scored, tokens, answer start). When every choice of a question is one token, one
    # row scores them all from the same next-token distribution; otherwise one row per choice.
    rows: list[tuple[int, list[int], list[int], int]] = []
    for s, sample in enumerate(samples):
        prompt = source.prompt_ids(sample)
        answers = [source._encode(" " + choice) for choice in sample.choices]
        if all(len(a) == 1 for a in answers):
            rows.append((s, list(range(len(answers))), prompt, len(prompt)))
        else:
            rows += [(s, [c], prompt + a, len(prompt)) for c, a in enumerate(answers)]
    scores = np.full((len(samples), max(len(s.choices) for s in samples)), -np.inf)
    try:
        for start in range(0, len(rows), batch_rows):
            chunk = rows[start:start + batch_rows]
            width = max(len(ids) for _, _, ids, _ in chunk)
            eos = source._eos
            ids = torch.tensor([ids + [eos] * (width - len(ids)) for _, _, ids, _ in chunk], device=device)
            pixels, grid = pack_images([source.image_of(samples[s]) for s, _, _, _ in chunk])
            logp = model(ids, pixel_values=pixels.to(device), image_grid_hw=grid.to(device)).logits.float()
            logp = logp.log_softmax(-1)
            for r, (s, choices, tokens, begin) in enumerate(chunk):
                if len(choices) > 1:   # single-token choices, read at the prompt's last position
                    firsts = [source._encode(" " + samples[s].choices[c])[0] for c in choices]
                    scores[s, choices] = logp[r, begin - 1, firsts].cpu().numpy()
                else:
                    targets = torch.tensor(tokens[begin:], device=device)
                    positions = torch.arange(begin - 1, len(tokens) - 1, device=device)
                    scores[s, choices[0]] = float(logp[r, positions, targets].sum())
    finally:
        model.train(was_training)
    correct = {k: 0 for k in KINDS}
    total = {k: 0 for k in KINDS}
    chance = {k: 0.0 for k in KINDS}
    for s, sample in enumerate(samples):
        total[sample.kind] += 1
        chance[sample.kind] = 1 / len(sample.choices)
        correct[sample.kind] += int(sample.choices[int(np.argmax(scores[s, :len(sample.choices)]))] == sample.answer)
    kinds = [k for k in KINDS if total[k]]
    return QAResult({k: correct[k] for k in kinds}, {k: total[k] for k in kinds}, {k: chance[k] for k in kinds})


__all__ = ["QAResult", "VisionSource", "bind_image_token", "evaluate_qa", "wilson_interval"]
