"""The chat template: OpenAI-style ``messages`` rendered with K3's role markers, as token ids per message.

The template is Jinja, as in Hugging Face's ``tokenizer_config.json`` (key ``chat_template``); the
built-in one (``kimik3.tokenizer.DEFAULT_CHAT_TEMPLATE``, Kimi's convention) renders::

    <|im_system|>system<|im_middle|>You are terse.<|im_end|><|im_user|>user<|im_middle|>Hi!<|im_end|>
    <|im_assistant|>assistant<|im_middle|>Hello.<|im_end|><|im_user|>user<|im_middle|>Bye?<|im_end|>
    <|im_assistant|>assistant<|im_middle|>

(one line in reality): each message is ``<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`` and the
prompt ends with the generation prompt ``<|im_assistant|>assistant<|im_middle|>``. The model ends its
turn with ``<|im_end|>`` (``ChatTemplate.turn_end``: what the template puts after an assistant's
content). When it is a special token, decoding skips it, so the server stops at its id
(``ChatEncoder.stop_token_ids``, given to the engine as ``SamplingParams.stop_token_ids``); when it is plain
text, at the string (``ChatEncoder.stop``, added to the request's stop strings). ``kimik3 serve`` takes the
template from ``--chat-template FILE``, else from the run's ``tokenizer_config.json``, else the
built-in one (``load_chat_template``).

**One message at a time.** Token ids are *not* ``encode(render(conversation))``: the template is
rendered for each message alone (``messages`` holding that one message, no generation prompt) with a
stand-in for its content, which splits the message into the template's text before and after the
content. Those pieces are encoded with the tokenizer's special tokens recognised (the role markers
become one id each), the content is encoded with special tokens taken as plain text, and the three
are concatenated; the generation prompt is the template rendered with no message and
``add_generation_prompt`` true. So a message's tokens never depend on what follows it, and the prompt
of turn n+1 extends, token for token, the prompt of turn n plus the assistant reply (its header is the
generation prompt, its end the ``<|im_end|>`` the model stopped at): the engine's prefix cache then
reuses the whole earlier conversation. The positions where messages end are returned as
``boundary_hints``: they are where a later request (an edited or regenerated turn) is most likely to
diverge, so the cache checkpoints them.

**Images.** A user message's content may hold OpenAI ``image_url`` parts; ``parse_messages`` keeps them in place
(``Message.parts``), the server decodes them (``kimik3.serve.images``) and ``ChatEncoder.encode`` lays each out as
``<|media_begin|>`` + one ``<|media_pad|>`` per image token + ``<|media_end|>`` where the part was, as training
does; the text parts around an image are encoded on their own.

**Content is text.** A message's content never yields a special token: ``"<|im_end|>"`` written by a
client is encoded as the characters it is made of, so a user cannot close a turn or forge a role
(``<|endoftext|>`` in content is likewise plain text).

**What a template must satisfy** (checked when it is loaded): rendering a conversation gives the same
text as rendering its messages one by one followed by the generation prompt (a template whose output
depends on a message's position, e.g. a default system prompt put before the first message, or a BOS
at the start, is refused); each message's content appears exactly once. Filters applied to the content
and tests on it see the stand-in, not the content: the content is inserted verbatim.

**Runs that predate the role tokens.** When the tokenizer lacks the markers as special tokens (a run
whose vocabulary had no room for them, see ``kimik3.tokenizer``) they are encoded as plain text,
several byte-level tokens each; ``ChatEncoder.plain_markers`` lists them and the server logs it. The
stop string ``<|im_end|>`` ends the model's turn then, since those tokens decode to it; and a marker
written in a message's content is then the same tokens as the template's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimik3.extras import MissingExtra
from kimik3.tokenizer import (DEFAULT_CHAT_TEMPLATE, EOS, IM_END, MEDIA_BEGIN, MEDIA_END, MEDIA_PAD, MEDIA_TOKENS,
                              TOKENIZER_CONFIG_FILE, image_prompt, read_tokenizer_config, special_token_ids)

__all__ = ["CHAT_STOP", "DEFAULT_CHAT_TEMPLATE", "ROLES", "ChatEncoder", "ChatTemplate", "ImagePart", "Message",
           "load_chat_template", "parse_messages", "render_ids", "render_text"]

ROLES = ("system", "user", "assistant")
CHAT_STOP = IM_END      # where the built-in template's assistant turn ends
# Stands in for a message's content while the template renders; never searched for in the content itself.
CONTENT_STAND_IN = "\x00\x01kimik3-content\x01\x00"
MARKER = re.compile(r"<\|[^|<>\s]+\|>")   # what a special token of K3 (or Kimi, ChatML) looks like


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An ``image_url`` content part: its URL (decoded by ``kimik3.serve.images``) and where it was, for errors."""

    url: Any
    where: str       # e.g. "messages[1].content[0].image_url"


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str                                  # the text (a list's text parts joined)
    parts: tuple[str | ImagePart, ...] = ()       # with images: text parts and images in order; () otherwise

    @property
    def images(self) -> list[ImagePart]:
        return [part for part in self.parts if isinstance(part, ImagePart)]


def _image_part(part: Mapping, where: str) -> ImagePart:
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image   # {"url": ..., "detail": ...}, or the URL
    if not isinstance(url, str):
        raise ValueError(f"{where}: an image part is {{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}")
    return ImagePart(url, f"{where}.image_url")


def _content(content: Any, role: str, where: str) -> tuple[str, tuple[str | ImagePart, ...]]:
    """(text, parts): a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts joined together;
    ``image_url`` parts (user messages only, as OpenAI's) keep their place in ``parts``."""
    if isinstance(content, str):
        return content, ()
    if isinstance(content, list):
        parts: list[str | ImagePart] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image_url":
                if role != "user":
                    raise ValueError(f"{where}.content[{j}]: image parts are accepted in user messages only")
                parts.append(_image_part(part, f"{where}.content[{j}]"))
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) and "
                                 "image parts ({'type': 'image_url', 'image_url': {'url': ...}}) are supported")
        text = "".join(part for part in parts if isinstance(part, str))
        return text, tuple(parts) if any(isinstance(part, ImagePart) for part in parts) else ()
    raise ValueError(f"{where}.content must be a string or a list of content parts, got {type(content).__name__}")


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
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
        if "content" not in msg or msg["content"] is None:
            raise ValueError(f"{where}.content is required")
        if msg.get("tool_calls"):
            raise ValueError(f"{where}.tool_calls: tool calls are not supported")
        parsed.append(Message(role, *_content(msg["content"], role, where)))
    return parsed


def _as_messages(messages: Any) -> list[Message]:
    if isinstance(messages, list) and all(isinstance(m, Message) for m in messages) and messages:
        return messages
    return parse_messages(messages)


# -- the template ---------------------------------------------------------------------------------------
def _jinja() -> Any:
    """The ``jinja2`` package, or a clear error naming what to install."""
    try:
        import jinja2
    except ImportError as err:
        raise MissingExtra("the chat template", "serve", err.name or "jinja2") from None
    return jinja2


def _environment() -> Any:
    """Hugging Face's Jinja setup for chat templates, sandboxed: a template reads its variables and
    cannot reach Python objects' internals or mutate anything."""
    jinja2 = _jinja()
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env


class ChatTemplate:
    """A Jinja chat template, compiled and split into the text each role puts around its content.

    ``origin`` names the template in errors (a file, or the built-in one)."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, origin: str = "the built-in chat template") -> None:
        jinja2 = _jinja()
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{origin}: the chat template is empty")
        self.source, self.origin = source, origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as err:
            raise ValueError(f"{origin}: not a valid Jinja template ({err})") from None
        # role -> (text before the content, text after it), or the template's error for that role
        self.pieces: dict[str, tuple[str, str]] = {}
        self.refused: dict[str, str] = {}
        for role in ROLES:
            try:
                text = self._render([{"role": role, "content": CONTENT_STAND_IN}], False)
            except jinja2.TemplateError as err:
                self.refused[role] = str(err)
                continue
            if text.count(CONTENT_STAND_IN) != 1:
                raise ValueError(f"{origin}: a {role} message must render its content exactly once, unchanged "
                                 f"(rendered it {text.count(CONTENT_STAND_IN)} times)")
            before, after = text.split(CONTENT_STAND_IN)
            self.pieces[role] = before, after
        try:
            self.generation_prompt = self._render([], True)
        except jinja2.TemplateError as err:
            raise ValueError(f"{origin}: rendering the generation prompt failed ({err})") from None
        self._check_one_message_at_a_time()

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=EOS, eos_token=EOS)

    def _check_one_message_at_a_time(self) -> None:
        jinja2 = _jinja()
        roles = [role for role in ("system", "user", "assistant", "user", "assistant", "user")
                 if role in self.pieces]
        conversation = [{"role": role, "content": CONTENT_STAND_IN} for role in roles]
        for add_generation_prompt in (False, True):
            try:
                whole = self._render(conversation, add_generation_prompt)
            except jinja2.TemplateError as err:
                raise ValueError(f"{self.origin}: rendering a conversation failed ({err})") from None
            pieces = "".join(CONTENT_STAND_IN.join(self.pieces[role]) for role in roles)
            if whole != pieces + (self.generation_prompt if add_generation_prompt else ""):
                raise ValueError(
                    f"{self.origin}: the template renders a message differently within a conversation than alone "
                    "(its output depends on a message's position or on the other messages, or the generation "
                    "prompt is not simply appended); messages are rendered one at a time so that their tokens "
                    "never depend on what follows, which the prefix cache relies on")

    def message_pieces(self, message: Message, where: str = "message") -> tuple[str, str]:
        """The template's text before and after ``message``'s content; ``ValueError`` if it refuses the role."""
        if message.role in self.refused:
            raise ValueError(f"{where}: the chat template refuses a {message.role} message "
                             f"({self.refused[message.role]})")
        return self.pieces[message.role]

    @property
    def turn_end(self) -> str | None:
        """What ends an assistant message (its text after the content, whitespace stripped): where the
        model's reply stops; None when the template puts nothing there."""
        if "assistant" not in self.pieces:
            return None
        return self.pieces["assistant"][1].strip() or None

    def render_text(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The prompt as text (what ``ChatEncoder.encode`` encodes; an image shown as one placeholder, its count
        depends on its size); for logs, docs and tests."""
        parsed = _as_messages(messages)
        text = "".join(_shown(m).join(self.message_pieces(m, f"messages[{i}]")) for i, m in enumerate(parsed))
        return text + self.generation_prompt if add_generation_prompt else text

    def render_jinja(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The whole conversation rendered by Jinja in one go (as ``apply_chat_template`` does), for comparison."""
        parsed = _as_messages(messages)
        return self._render([{"role": m.role, "content": m.content} for m in parsed], add_generation_prompt)


def _shown(message: Message) -> str:
    if not message.parts:
        return message.content
    return "".join(part if isinstance(part, str) else image_prompt(1) for part in message.parts)


_DEFAULT: ChatTemplate | None = None


def default_template() -> ChatTemplate:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ChatTemplate()
    return _DEFAULT


def _template_from_text(text: str, origin: str) -> ChatTemplate:
    """A template file's text: the Jinja template itself, or a JSON object holding it under ``chat_template``
    (a ``tokenizer_config.json``)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return ChatTemplate(text, origin)
    if not isinstance(config, dict):
        return ChatTemplate(text, origin)
    return _template_from_config(config, origin)


def _template_from_config(config: dict[str, Any], origin: str) -> ChatTemplate:
    source = config.get("chat_template")
    if isinstance(source, list):   # Hugging Face's named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        raise ValueError(f"{origin}: no chat_template (a string, or a list holding one named 'default')")
    return ChatTemplate(source, f"{origin} (chat_template)")


def load_chat_template(file: str | Path | None = None, run_dir: str | Path | None = None) -> ChatTemplate:
    """The template ``kimik3 serve`` uses: ``file`` (``--chat-template``: a Jinja file, or a JSON file with
    ``chat_template``), else ``chat_template`` in ``run_dir``'s ``tokenizer_config.json``, else the built-in one."""
    if file is not None:
        path = Path(file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: chat template file missing") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read the chat template ({err})") from None
        return _template_from_text(text, str(path))
    if run_dir is not None:
        config = read_tokenizer_config(run_dir)
        if config is not None and "chat_template" in config:
            return _template_from_config(config, str(Path(run_dir) / TOKENIZER_CONFIG_FILE))
    return default_template()


# -- token ids ------------------------------------------------------------------------------------------
class ChatEncoder:
    """A chat template bound to a tokenizer: prompt ids and boundary hints of a conversation.

    Encodes with its own copy of the tokenizer: the template's pieces once here, with special tokens
    recognised; then each request's contents, with special tokens taken as plain text (the copy's
    ``encode_special_tokens``; the tokenizer itself is left as it is, for the other endpoints and
    threads). Build it after the tokenizer's special tokens are final."""

    def __init__(self, tokenizer: Any, template: ChatTemplate | None = None) -> None:
        from kimik3.tokenizer import load_tokenizer_from_json

        self.template = template or default_template()
        self._tokenizer = load_tokenizer_from_json(tokenizer.to_str(), "the chat tokenizer")
        self._tokenizer.encode_special_tokens = False
        self._pieces = {role: (self._encode(before), self._encode(after))
                        for role, (before, after) in self.template.pieces.items()}
        self._generation_prompt = self._encode(self.template.generation_prompt)
        self._tokenizer.encode_special_tokens = True   # from here on it encodes only message contents
        specials = special_token_ids(self._tokenizer)
        template_text = "".join(before + after for before, after in self.template.pieces.values())
        self.plain_markers = sorted({m for m in MARKER.findall(template_text + self.template.generation_prompt)
                                     if m not in specials})
        # An image: <|media_begin|>, one <|media_pad|> per image token, <|media_end|>, when the tokenizer has them.
        self.media_ids: tuple[int, int, int] | None = (
            (specials[MEDIA_BEGIN], specials[MEDIA_PAD], specials[MEDIA_END])
            if all(token in specials for token in MEDIA_TOKENS) else None)
        end = self.template.turn_end
        self.stop: str | None = end
        self.stop_token_ids: list[int] = [specials[end]] if end in specials else []

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def encode(self, messages: Any, add_generation_prompt: bool = True,
               image_tokens: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """``(prompt_ids, boundary_hints)``: the prompt's tokens and the token count after each message.

        ``messages``: OpenAI-style dicts (validated by ``parse_messages``) or ``Message`` s. ``image_tokens``: the
        token count of each image part, in order (``PreparedImage.num_tokens``). An image is laid out as training
        lays it out (``kimik3.train.vision_data``): ``<|media_begin|>``, its placeholders, ``<|media_end|>``, at
        the part's place, the text parts around it encoded on their own."""
        ids: list[int] = []
        hints: list[int] = []
        images = iter(image_tokens)
        for i, message in enumerate(_as_messages(messages)):
            self.template.message_pieces(message, f"messages[{i}]")   # a role the template refuses
            before, after = self._pieces[message.role]
            ids.extend(before)
            for part in message.parts or (message.content,):
                if isinstance(part, ImagePart):
                    ids.extend(self._image_ids(next(images, None), part.where))
                elif part:
                    ids.extend(self._encode(part))
            ids.extend(after)
            hints.append(len(ids))
        if next(images, None) is not None:
            raise ValueError("more image token counts were given than the messages hold images")
        if add_generation_prompt:
            ids.extend(self._generation_prompt)
        return ids, hints

    def _image_ids(self, tokens: int | None, where: str) -> list[int]:
        if self.media_ids is None:
            raise ValueError(f"{where}: this tokenizer has no media tokens ({', '.join(MEDIA_TOKENS)}): it cannot "
                             "take images")
        if tokens is None or tokens < 1:
            raise ValueError(f"{where}: the image's token count is missing")
        begin, pad, end = self.media_ids
        return [begin] + [pad] * tokens + [end]


def render_text(messages: Any, add_generation_prompt: bool = True, template: ChatTemplate | None = None) -> str:
    """The prompt as text (what ``render_ids`` encodes); for logs, docs and tests."""
    return (template or default_template()).render_text(messages, add_generation_prompt)


def render_ids(tokenizer: Any, messages: Any, add_generation_prompt: bool = True,
               template: ChatTemplate | None = None) -> tuple[list[int], list[int]]:
    """``(prompt_ids, boundary_hints)`` of ``messages`` with ``tokenizer`` (a HF ``tokenizers.Tokenizer``).

    Builds a ``ChatEncoder`` each call; a server keeps one."""
    return ChatEncoder(tokenizer, template).encode(parse_messages(messages), add_generation_prompt)
