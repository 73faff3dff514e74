"""Reading a K3 tokenizer: the ``tokenizer.json`` a run holds (HF ``tokenizers``, byte-level BPE).

Shared by training, which builds and saves it (``train/tokenizer.py``), and serving, which loads it
with the model. ``EOS`` (``<|endoftext|>``) ends every document and every generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"


def tokenizers_module() -> Any:
    """The ``tokenizers`` package, or a clear error naming what to install."""
    try:
        import tokenizers
    except ImportError:
        raise RuntimeError("the 'tokenizers' package is needed: pip install tokenizers") from None
    return tokenizers


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer file missing")
    try:
        return tokenizers_module().Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path}: not a valid tokenizer file ({err})") from None


def load_tokenizer_from_json(text: str, source: str | Path = "<string>") -> Any:
    """Parse a tokenizer serialised with ``to_str()``; ``source`` names it in errors."""
    try:
        return tokenizers_module().Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for malformed input
        raise ValueError(f"{source}: not a valid tokenizer file ({err})") from None
