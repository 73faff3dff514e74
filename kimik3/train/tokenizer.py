"""Byte-level BPE trained on the corpus with HF ``tokenizers``, cached by corpus fingerprint.

Byte-level means every string round-trips: unknown characters fall back to their UTF-8 bytes.
Document boundaries are marked with ``<|endoftext|>`` (id 0); Kimi's chat role markers (``ROLE_TOKENS``) are special
tokens too (ids 1-5), so a trained run can be served with the chat template. The cache holds the tokenizer and
the encoded splits (``.npy``, loaded with ``allow_pickle=False``), keyed by the corpus fingerprint,
the vocabulary size and this recipe's version, so a second run on the same corpus starts at once.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimik3.files import atomic_write
from kimik3.tokenizer import EOS, SPECIAL_TOKENS, load_tokenizer, tokenizers_module
from kimik3.train.data import Corpus, Document

RECIPE_VERSION = "bytelevel-bpe-v2"  # v2: the role markers are special tokens


def cache_dir() -> Path:
    return Path(os.environ.get("KIMIK3_CACHE", Path.home() / ".cache" / "kimik3"))


def train_tokenizer(docs: list[Document], vocab_size: int):
    """Train a byte-level BPE with ``vocab_size`` entries (the special tokens first: EOS, then the role markers)."""
    tk = tokenizers_module()
    least = 256 + len(SPECIAL_TOKENS)
    if vocab_size < least:
        raise ValueError(f"vocab_size must be >= {least} for a byte-level BPE (256 bytes + {len(SPECIAL_TOKENS)} "
                         f"special tokens), got {vocab_size}")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return tokenizer


def encode_documents(tokenizer, docs: list[Document]) -> np.ndarray:
    """All documents as one id stream, each followed by EOS; uint16 when the vocab allows."""
    eos = tokenizer.token_to_id(EOS)
    encodings = tokenizer.encode_batch([d.text for d in docs])
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 65536 else np.int32
    pieces = []
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, dtype=dtype))
        pieces.append(np.asarray([eos], dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def _save_npy(path: Path, ids: np.ndarray) -> None:
    with open(path, "wb") as handle:
        np.save(handle, ids, allow_pickle=False)


@dataclass(slots=True)
class TokenizedCorpus:
    tokenizer: object          # tokenizers.Tokenizer
    train_ids: np.ndarray      # [N_train] token stream
    val_ids: np.ndarray        # [N_val]
    cache_key: str
    from_cache: bool


def tokenize_corpus(corpus: Corpus, vocab_size: int, use_cache: bool = True) -> TokenizedCorpus:
    """Train (or reload) the tokenizer for ``corpus`` and encode both splits."""
    key = hashlib.sha256(f"{RECIPE_VERSION}|{vocab_size}|{corpus.fingerprint}".encode()).hexdigest()[:20]
    folder = cache_dir() / "tokenized" / key
    tok_path, train_path, val_path = folder / "tokenizer.json", folder / "train.npy", folder / "val.npy"
    if use_cache and tok_path.is_file() and train_path.is_file() and val_path.is_file():
        try:
            return TokenizedCorpus(load_tokenizer(tok_path), np.load(train_path, allow_pickle=False),
                                   np.load(val_path, allow_pickle=False), key, True)
        except (ValueError, OSError):
            pass  # a damaged cache entry is rebuilt below
    tokenizer = train_tokenizer(corpus.train, vocab_size)
    train_ids = encode_documents(tokenizer, corpus.train)
    val_ids = encode_documents(tokenizer, corpus.val)
    if use_cache:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(tok_path, lambda tmp: tokenizer.save(str(tmp)))
        for path, ids in ((train_path, train_ids), (val_path, val_ids)):
            atomic_write(path, lambda tmp, ids=ids: _save_npy(tmp, ids))
    return TokenizedCorpus(tokenizer, train_ids, val_ids, key, False)
