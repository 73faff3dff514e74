"""What the training loop trains on: a ``DataSource`` gives the batch of each step, the validation
windows, the tokenizer and the data's fingerprint.

``CorpusSource`` is pre-training's (a corpus tokenized into one stream, random windows; ``loader.py``);
supervised fine-tuning plugs in its own source with loss masks (labels -100 off the assistant's tokens,
``kimik3.posttrain.sft.SFTSource``). A source's batch of step s is a pure function of (seed, s), which
is what makes ``--resume`` exact.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from kimik3.parallel.context import ParallelContext
from kimik3.train.data import Corpus, load_corpus
from kimik3.train.loader import batch_at, eval_windows
from kimik3.train.tokenizer import encode_documents, tokenize_corpus

__all__ = ["CorpusSource", "DataSource", "unigram_loss"]


class DataSource(Protocol):
    tokenizer: Any          # tokenizers.Tokenizer, saved with every checkpoint
    fingerprint: str        # changes with the data: a checkpoint resumes only on the same
    unigram: float          # the add-one unigram baseline's validation loss (nats/token)
    sample_prompt: str      # what the end of a run samples a completion of

    def describe(self) -> str:
        """The log line that says what the run trains on."""

    def batch_at(self, step: int, seed: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T], labels [B, T]) of ``step``; labels -100 where no loss is taken."""

    def eval_windows(self, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The validation windows (the same every evaluation): ([W, T], [W, T])."""

    def with_tokenizer(self, tokenizer: Any) -> "DataSource":
        """The same data encoded with ``tokenizer`` (a checkpoint's, when it differs)."""


def unigram_loss(train_ids: np.ndarray, val_ids: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the add-one unigram model of the train split on val."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[val_ids].mean())


class CorpusSource:
    """Pre-training data: ``--data`` (or the stdlib) tokenized with the corpus's own (cached) BPE."""

    sample_prompt = "def fibonacci(n):\n"

    def __init__(self, corpus: Corpus, tokenizer: Any, train_ids: np.ndarray, val_ids: np.ndarray, vocab_size: int):
        self.corpus, self.tokenizer, self.vocab_size = corpus, tokenizer, vocab_size
        self.train_ids, self.val_ids = train_ids, val_ids
        self.fingerprint = corpus.fingerprint
        self.unigram = unigram_loss(train_ids, val_ids, vocab_size)

    @classmethod
    def load(cls, data: str | None, vocab_size: int, ctx: ParallelContext) -> "CorpusSource":
        corpus = load_corpus(data)   # a bad data path fails before any model is built
        with ctx.main_first():  # rank 0 trains (or finds) the cached tokenizer; the others read it
            tokenized = tokenize_corpus(corpus, vocab_size)
        return cls(corpus, tokenized.tokenizer, tokenized.train_ids, tokenized.val_ids, vocab_size)

    def describe(self) -> str:
        return (f"{self.corpus.description}: {len(self.corpus.train)} train / {len(self.corpus.val)} val documents, "
                f"{len(self.train_ids):,} / {len(self.val_ids):,} tokens")

    def batch_at(self, step: int, seed: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch_at(self.train_ids, step, seed, batch_size, seq_len)

    def eval_windows(self, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return eval_windows(self.val_ids, seq_len, max_windows)

    def with_tokenizer(self, tokenizer: Any) -> "CorpusSource":
        return CorpusSource(self.corpus, tokenizer, encode_documents(tokenizer, self.corpus.train),
                            encode_documents(tokenizer, self.corpus.val), self.vocab_size)
