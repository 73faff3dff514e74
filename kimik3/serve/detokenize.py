"""Incremental detokenisation with stop strings.

A byte-level BPE token may end in the middle of a UTF-8 character, and a stop string may span
several tokens, so text is released only when it is final: not ending in an incomplete character
(U+FFFD from the decoder) and not possibly the start of a stop string. When a stop string
appears, the text before it is released and the stream ends; the stop string itself is not sent.
"""

from __future__ import annotations

from typing import Any


class StreamDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.sent = ""            # text already released
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the newly final text (possibly empty)."""
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids)
        if text.endswith("\ufffd"):
            return ""
        for stop in self.stop:
            # Only search where a new match can be: a stop string cannot lie inside sent text.
            found = text.find(stop, max(0, len(self.sent) - len(stop) + 1))
            if found != -1:
                self.stopped = True
                return self._release(text[:found])
        return self._release(text[:len(text) - self._held_back(text)])

    def flush(self) -> str:
        """The stream ended for another reason: release what was held back for stop strings."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids).rstrip("\ufffd")
        return self._release(text)

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if stop.startswith(text[len(text) - size:]):
                    held = size
                    break
        return held

    def _release(self, final: str) -> str:
        if len(final) <= len(self.sent):
            return ""
        delta, self.sent = final[len(self.sent):], final
        return delta
