"""Incremental detokenisation with stop strings, in constant time per token.

A byte-level BPE token may end in the middle of a UTF-8 character, and a stop string may span
several tokens, so text is released only when it is final: not ending in an incomplete character
(U+FFFD from the decoder) and not possibly the start of a stop string. When a stop string
appears, the text before it is released and the stream ends; the stop string itself is not sent.

Each token decodes only a short window of ids: the tokens since the last complete character, plus
the one before them for context (a decoder may render a token differently at the start of a text),
as vLLM's incremental detokeniser does. So a 4,000-token answer costs the same per token as a short
one, instead of decoding the whole output again at every token.
"""

from __future__ import annotations

from typing import Any


class StreamDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.prefix = 0           # first id of the decode window
        self.read = 0             # ids before this one are decoded into released or held text
        self.held = ""            # final text held back: it may be the start of a stop string
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (possibly empty)."""
        self.token_ids.append(token_id)
        delta = self._new_text(final=False)
        if not delta:
            return ""
        text = self.held + delta
        for stop in self.stop:
            found = text.find(stop)
            if found != -1:
                self.stopped = True
                self.held = ""
                return text[:found]
        keep = self._held_back(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The stream ended for another reason: release what was held back for stop strings, and an
        incomplete last character's decodable part."""
        if self.stopped:
            return ""
        text, self.held = self.held + self._new_text(final=True), ""
        return text

    def _new_text(self, final: bool) -> str:
        """The text the ids since ``read`` add, once it does not end in an incomplete character (or,
        when final, with the incomplete end dropped); advances the window past it."""
        window = self.token_ids[self.prefix:]
        before = self.tokenizer.decode(self.token_ids[self.prefix:self.read])
        text = self.tokenizer.decode(window)
        if text.endswith("\ufffd"):
            if not final:
                return ""
            text = text.rstrip("\ufffd")
        if len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.token_ids)
        return text[len(before):]

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if stop.startswith(text[len(text) - size:]):
                    held = size
                    break
        return held
