"""Reading a K3 tokenizer: the ``tokenizer.json`` a run holds (HF ``tokenizers``, byte-level BPE).

Shared by training, which builds and saves it (``train/tokenizer.py``), and serving, which loads it
with the model. ``EOS`` (``<|endoftext|>``) ends every document and every plain completion.

**Chat role tokens.** Kimi's role markers (``ROLE_TOKENS``: ``<|im_system|>``, ``<|im_user|>``,
``<|im_assistant|>``, ``<|im_middle|>``, ``<|im_end|>``) are special tokens, one id each, used by
the chat template (``kimik3/serve/chat.py``; ``<|im_end|>`` ends an assistant turn). They sit after
every BPE id, so adding them moves no existing id: ``add_role_tokens`` appends the missing ones
after the tokenizer's last id, provided they stay below the model's vocabulary size (the embedding
has no row beyond it). A tokenizer that predates them gets them at load time
(``load_tokenizer(path, vocab_size=...)``) when the model's vocabulary has room; one whose ids
already fill the vocabulary (BPE trained to the model's size, or padded to it) is left as it is,
and the chat template then spells the markers as plain text (several byte-level tokens each).
The embeddings of ids added at load time are whatever the model holds there: untrained unless the
run was trained with the role tokens.

**tokenizer_config.json.** Saved next to ``tokenizer.json`` (``write_tokenizer_config``), as
Hugging Face tokenizers do: the Jinja ``chat_template``, ``bos_token``/``eos_token``, the special
tokens, and the settings that let ``transformers.AutoTokenizer`` read the pair.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
ROLE_TOKENS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END)
SPECIAL_TOKENS = (EOS, *ROLE_TOKENS)
# Images in a prompt (the released K3 tokenizer's names, as torchtitan's port lists them): one image is
# ``<|media_begin|>`` + ``num_image_tokens(H, W)`` x ``<|media_pad|>`` (the placeholders the image's embeddings
# replace, ``kimik3.model.vision``) + ``<|media_end|>``. Not part of SPECIAL_TOKENS: a text-only tokenizer keeps
# its ids; ``add_media_tokens`` appends them for a model with a vision tower.
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_END, MEDIA_PAD)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# The chat template (Jinja, as in Hugging Face's ``tokenizer_config.json``): each message is
# ``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>``; the generation prompt opens an assistant
# message. ``kimik3/serve/chat.py`` renders it one message at a time (see there for what a template
# must satisfy).
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "<|im_{{ message.role }}|>{{ message.role }}<|im_middle|>{{ message.content }}<|im_end|>\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "<|im_assistant|>assistant<|im_middle|>\n"
    "{%- endif -%}\n"
)


def tokenizers_module() -> Any:
    """The ``tokenizers`` package, or a clear error naming what to install."""
    try:
        import tokenizers
    except ImportError:
        raise RuntimeError("the 'tokenizers' package is needed: pip install tokenizers") from None
    return tokenizers


def load_tokenizer(path: str | Path, vocab_size: int | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file; errors name the file.

    ``vocab_size`` (the model's): the role tokens the file lacks are added when they fit below it
    (``add_role_tokens``); when they do not, the tokenizer is returned without them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: tokenizer file missing")
    try:
        tokenizer = tokenizers_module().Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{path}: not a valid tokenizer file ({err})") from None
    if vocab_size is not None and role_tokens_fit(tokenizer, vocab_size):
        add_role_tokens(tokenizer, vocab_size)
    return tokenizer


def load_tokenizer_from_json(text: str, source: str | Path = "<string>") -> Any:
    """Parse a tokenizer serialised with ``to_str()``; ``source`` names it in errors."""
    try:
        return tokenizers_module().Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for malformed input
        raise ValueError(f"{source}: not a valid tokenizer file ({err})") from None


# -- special tokens -------------------------------------------------------------------------------------
def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """``{token: id}`` of the tokenizer's special tokens (its added tokens flagged special)."""
    return {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special}


def has_role_tokens(tokenizer: Any) -> bool:
    """Whether every role marker is a special token of ``tokenizer`` (one id each)."""
    specials = special_token_ids(tokenizer)
    return all(token in specials for token in ROLE_TOKENS)


def missing_role_tokens(tokenizer: Any) -> list[str]:
    specials = special_token_ids(tokenizer)
    return [token for token in ROLE_TOKENS if token not in specials]


def role_tokens_fit(tokenizer: Any, vocab_size: int) -> bool:
    """Whether the missing role tokens can be appended with ids below ``vocab_size``."""
    return tokenizer.get_vocab_size(with_added_tokens=True) + len(missing_role_tokens(tokenizer)) <= vocab_size


def add_role_tokens(tokenizer: Any, vocab_size: int | None = None) -> list[int]:
    """Make the role markers special tokens of ``tokenizer`` (in place); returns their ids, in ``ROLE_TOKENS`` order.

    Missing markers get the ids after the tokenizer's last one, so no existing id moves. With
    ``vocab_size`` (the model's), a ``ValueError`` says so when they would not fit below it: such a
    tokenizer predates the role tokens and fills the model's vocabulary."""
    missing = missing_role_tokens(tokenizer)
    if missing and vocab_size is not None and not role_tokens_fit(tokenizer, vocab_size):
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        raise ValueError(f"the tokenizer has {size:,} ids and the model's vocabulary {vocab_size:,}: no room for "
                         f"the chat role tokens {', '.join(missing)} (the tokenizer predates them; train a new "
                         "tokenizer with them, or serve chat with the markers spelled as plain text)")
    if missing:
        tk = tokenizers_module()
        tokenizer.add_special_tokens([tk.AddedToken(token, special=True, normalized=False) for token in missing])
    return [tokenizer.token_to_id(token) for token in ROLE_TOKENS]


# -- tokenizer_config.json ------------------------------------------------------------------------------
def _as_tokenizer(tokenizer: Any) -> Any:
    return load_tokenizer_from_json(tokenizer) if isinstance(tokenizer, str) else tokenizer


def tokenizer_config(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of ``tokenizer`` (a ``tokenizers.Tokenizer`` or its JSON text).

    ``chat_template``: the Jinja chat template to store (default: ``DEFAULT_CHAT_TEMPLATE``)."""
    if chat_template is None:
        chat_template = DEFAULT_CHAT_TEMPLATE
    tokenizer = _as_tokenizer(tokenizer)
    added = sorted(tokenizer.get_added_tokens_decoder().items())
    specials = [token.content for _, token in added if token.special]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # Every document is followed by EOS, so EOS also stands before the next one (GPT-2's convention).
        "bos_token": EOS,
        "eos_token": EOS,
        "additional_special_tokens": [token for token in specials if token != EOS],
        "added_tokens_decoder": {str(token_id): {"content": token.content, "lstrip": token.lstrip,
                                                 "normalized": token.normalized, "rstrip": token.rstrip,
                                                 "single_word": token.single_word, "special": token.special}
                                 for token_id, token in added},
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }


def write_tokenizer_config(folder: str | Path, tokenizer: Any, chat_template: str | None = None) -> Path:
    """Write ``tokenizer_config.json`` into ``folder`` (next to its ``tokenizer.json``); returns its path.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or its JSON text (what checkpoints hold)."""
    from kimik3.files import atomic_write

    path = Path(folder) / TOKENIZER_CONFIG_FILE
    text = json.dumps(tokenizer_config(tokenizer, chat_template), indent=2, ensure_ascii=False) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def read_tokenizer_config(folder: str | Path) -> dict[str, Any] | None:
    """``folder``'s ``tokenizer_config.json`` as a dict; None when there is none (a run saved before it)."""
    path = Path(folder) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a valid tokenizer config ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a valid tokenizer config (a JSON object is expected)")
    return config


# -- media tokens -------------------------------------------------------------------------------------------
def add_media_tokens(tokenizer: Any, vocab_size: int) -> dict[str, int]:
    """Make ``MEDIA_TOKENS`` special tokens of ``tokenizer`` (in place), appended after its last id in that
    order, so a tokenizer of ``vocab_size - 3`` ids puts ``<|media_pad|>`` at ``vocab_size - 1`` (the vision
    config's default placeholder id). Returns ``{token: id}``; ValueError when they do not fit below ``vocab_size``."""
    specials = special_token_ids(tokenizer)
    missing = [token for token in MEDIA_TOKENS if token not in specials]
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size + len(missing) > vocab_size:
        raise ValueError(f"the tokenizer has {size:,} ids and the model's vocabulary {vocab_size:,}: no room for "
                         f"the media tokens {', '.join(missing)} (train the BPE to {vocab_size - len(MEDIA_TOKENS)} "
                         "entries)")
    if missing:
        tk = tokenizers_module()
        tokenizer.add_special_tokens([tk.AddedToken(token, special=True, normalized=False) for token in missing])
    return {token: tokenizer.token_to_id(token) for token in MEDIA_TOKENS}


def image_prompt(num_tokens: int) -> str:
    """The text of one image in a prompt: begin, ``num_tokens`` placeholders, end."""
    if num_tokens < 1:
        raise ValueError(f"an image has at least one token, got {num_tokens}")
    return MEDIA_BEGIN + MEDIA_PAD * num_tokens + MEDIA_END
