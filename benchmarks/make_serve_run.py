"""Write a servable run directory with random weights, for serving benchmarks (benchmarks/serve_http.py).

``kimik3 serve --run DIR`` needs what ``kimik3 train`` leaves: ``config.json`` + ``model.safetensors``
(``K3ForCausalLM.save_pretrained``) and a ``tokenizer.json``. Training is beside the point for a
throughput benchmark, so this makes them directly, in seconds: the preset's model with seeded random
weights (bf16 on cuda, fp32 on cpu, as ``kimik3 serve`` loads it) and a byte-level BPE trained, as
``kimik3 train`` trains it (``kimik3.train.tokenizer.train_tokenizer``), on about 1 MB of the embedded
corpus (the Python standard library's sources).

The vocabulary. The model's (163,840 in ``debug``) is far larger than what a BPE learns from 1 MB in
a second, and a random model emits ids all over its vocabulary. An id the tokenizer does not know
decodes to nothing: ``kimik3 serve`` does not crash on it (the tokenizer drops it), but it streams no
chunk for it either (``server._stream`` sends a chunk only for non-empty text), so most tokens of a
random model would never reach the client and time to first token would measure the first *known*
token. A real K3 tokenizer covers the whole vocabulary, so by default the BPE's vocabulary is padded
to the model's with placeholder tokens (`` aa``, `` ab``, ... : a space and 2-4 ASCII letters, no
merges lead to them, so encoding text is unchanged) and every generated token streams as one chunk.
``--no-pad-vocab`` keeps the bare BPE (ids beyond it are then legitimate outputs that stream as
nothing).

    python benchmarks/make_serve_run.py --out runs/debug-random                 # debug, cuda if present
    python benchmarks/make_serve_run.py --out /tmp/tiny --preset tiny --device cpu

``debug`` on an H200: 13 s (1.9 GiB of bf16 weights); ``tiny`` on a CPU: a few seconds. (``debug`` on a
2-core CPU takes minutes and writes 3.8 GiB of fp32.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed

BPE_CORPUS_CHARS = 1_000_000   # characters of the stdlib the BPE is trained on (about a second)
BYTE_LEVEL_SPACE = "\u0120"    # how the byte-level alphabet writes a space ("Ġ")


def stdlib_documents(max_chars: int = BPE_CORPUS_CHARS) -> list:
    """The first ``max_chars`` characters of the embedded corpus (stdlib .py files, in a fixed order)."""
    from kimik3.train.data import STDLIB_EXCLUDED_DIRS, Document, stdlib_root

    root, docs, total = stdlib_root(), [], 0
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            text = (Path(directory) / name).read_text(encoding="utf-8", errors="replace")
            if text.strip():
                docs.append(Document(str(Path(directory, name).relative_to(root)), text))
                total += len(text)
            if total >= max_chars:
                return docs
    return docs


def placeholder_tokens(taken: set[str]):
    """Byte-level token strings " aa", " ab", ..., " zzzz" that are not in ``taken``, in a fixed order."""
    for size in (2, 3, 4):
        for letters in itertools.product(string.ascii_lowercase, repeat=size):
            token = BYTE_LEVEL_SPACE + "".join(letters)
            if token not in taken:
                yield token


def pad_vocabulary(tokenizer, vocab_size: int):
    """``tokenizer`` (a byte-level BPE) with placeholder tokens appended up to ``vocab_size`` ids."""
    from kimik3.tokenizer import load_tokenizer_from_json

    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing <= 0:
        return tokenizer
    next_id = max(vocab.values()) + 1
    for token in itertools.islice(placeholder_tokens(set(vocab)), missing):
        vocab[token] = next_id
        next_id += 1
    padded = load_tokenizer_from_json(json.dumps(spec), "padded tokenizer")
    if padded.get_vocab_size() != vocab_size:
        raise AssertionError(f"padding gave {padded.get_vocab_size()} ids, not {vocab_size}")
    return padded


def build_tokenizer(vocab_size: int, bpe_vocab: int, pad: bool):
    """A BPE trained on the stdlib (its special tokens: EOS and the chat template's role tokens), padded (when
    ``pad``) to ``vocab_size`` ids."""
    from kimik3.train.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(stdlib_documents(), min(bpe_vocab, vocab_size))
    return pad_vocabulary(tokenizer, vocab_size) if pad else tokenizer


def make_run(out: str | Path, preset: str = "debug", device: str | None = None, seed: int = 0,
             bpe_vocab: int = 8192, pad_vocab: bool = True) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``tokenizer.json`` into ``out``; return it."""
    import torch

    from kimik3.config import K3Config
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.tokenizer import write_tokenizer_config

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = K3Config.preset(preset)
    tokenizer = build_tokenizer(config.vocab_size, bpe_vocab, pad_vocab)
    with torch.no_grad():
        model = K3ForCausalLM(config, device=device, seed=seed)   # bf16 on cuda, fp32 on cpu
        model.save_pretrained(out)
    del model
    tokenizer.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out, tokenizer)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the run directory to write (created if missing)")
    parser.add_argument("--preset", default="debug", help="model preset: tiny, debug (k3 is far too large)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights")
    parser.add_argument("--device", default=None, help="where the weights are made: cuda (bf16) or cpu (fp32); "
                        "default cuda when present")
    parser.add_argument("--bpe-vocab", type=int, default=8192,
                        help="entries the BPE learns (capped at the model's vocabulary)")
    parser.add_argument("--no-pad-vocab", action="store_true",
                        help="keep the bare BPE: ids beyond it are generated but stream no text")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = make_run(args.out, args.preset, args.device, args.seed, args.bpe_vocab, not args.no_pad_vocab)
    from kimik3.tokenizer import load_tokenizer

    vocab = load_tokenizer(out / "tokenizer.json").get_vocab_size()
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out}: preset {args.preset}, seed {args.seed}, weights {size / 2**20:,.0f} MiB, "
          f"tokenizer {vocab:,} ids ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
