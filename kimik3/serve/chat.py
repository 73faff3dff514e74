"""The chat template: OpenAI-style ``messages`` rendered as plain text a base model can continue.

K3's tokenizer is a byte-level BPE with a single special token (``<|endoftext|>``), so the template
uses plain-text role markers that any byte-level BPE encodes::

    System: You are terse.\\n\\nUser: Hi!\\n\\nAssistant: Hello.\\n\\nUser: Bye?\\n\\nAssistant:

Each message is ``"<Label>:" + body + "\\n\\n"`` with ``Label`` one of ``System``, ``User``,
``Assistant``, and ``body`` the content with one separating space put in front, unless the content
is empty or already starts with whitespace (a model continuing ``"Assistant:"`` writes the space
itself, so a reply sent back verbatim renders exactly as it was generated). The prompt ends with
the generation prompt ``"Assistant:"``; the server adds the stop string ``"\\n\\nUser:"`` so the
model stops where it would start the user's next turn.

Token ids are *not* ``encode(whole_text)``: the label, the body and the ``"\\n\\n"`` of every
message are encoded separately and concatenated. So a message's tokens never depend on what follows
it, and the prompt of turn n+1 extends, token for token, the prompt of turn n plus the (re-encoded)
assistant reply: the engine's prefix cache then reuses the whole earlier conversation. The
positions where messages end are returned as ``boundary_hints``: they are where a later request
(an edited or regenerated turn) is most likely to diverge, so the cache checkpoints them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLE_LABELS: dict[str, str] = {"system": "System", "user": "User", "assistant": "Assistant"}
TURN_END = "\n\n"
GENERATION_PROMPT = "Assistant:"
CHAT_STOP = "\n\nUser:"


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


def _content_text(content: Any, where: str) -> str:
    """A string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts joined together."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def parse_messages(messages: Any) -> list[Message]:
    """Validate OpenAI-style messages; a ``ValueError`` names the offending message and field."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError("messages must be a list of {role, content} objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    parsed = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLE_LABELS:
            raise ValueError(f"{where}.role must be one of {sorted(ROLE_LABELS)}, got {role!r}")
        if "content" not in msg or msg["content"] is None:
            raise ValueError(f"{where}.content is required")
        if msg.get("tool_calls"):
            raise ValueError(f"{where}.tool_calls: tool calls are not supported")
        parsed.append(Message(role, _content_text(msg["content"], where)))
    return parsed


def _pieces(message: Message) -> tuple[str, str, str]:
    body = message.content
    if body and not body[0].isspace():
        body = " " + body
    return f"{ROLE_LABELS[message.role]}:", body, TURN_END


def render_text(messages: Any, add_generation_prompt: bool = True) -> str:
    """The prompt as text (what ``render_ids`` encodes); for logs, docs and tests."""
    text = "".join("".join(_pieces(m)) for m in parse_messages(messages))
    return text + GENERATION_PROMPT if add_generation_prompt else text


def render_ids(tokenizer: Any, messages: Any, add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
    """``(prompt_ids, boundary_hints)``: the template's tokens, and the token count after each message.

    ``tokenizer`` needs ``encode(text).ids`` (a HF ``tokenizers.Tokenizer``). Every piece is encoded
    on its own so the ids are prefix-stable across turns (see the module docstring).
    """
    return encode_messages(tokenizer, parse_messages(messages), add_generation_prompt)


def encode_messages(tokenizer: Any, messages: list[Message],
                    add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
    """``render_ids`` of messages already validated by ``parse_messages``."""
    ids: list[int] = []
    hints: list[int] = []
    for message in messages:
        for piece in _pieces(message):
            if piece:
                ids.extend(tokenizer.encode(piece).ids)
        hints.append(len(ids))
    if add_generation_prompt:
        ids.extend(tokenizer.encode(GENERATION_PROMPT).ids)
    return ids, hints
