"""Incremental detokenisation: turn sampled token ids into text as soon as it is final.

Decoding token by token breaks multi-byte characters and merges (a token can change how
the previous ones decode), so each push re-decodes the ids since the last safe point and
releases only text that later tokens cannot change. Used by the CLI (printing) and the
server (SSE deltas).
"""
from __future__ import annotations


class TextStream:
    """push(token) -> the new final text (also written to `out` if given); flush() -> whatever is left."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.printed = tokenizer, out, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character
        return self._emit(text)

    def flush(self) -> str:
        """Release any held-back text (an incomplete character at the very end of a reply)."""
        return self._emit(self.tok.decode(self.ids, skip_special_tokens=True)) if self.ids else ""

    def _emit(self, text: str) -> str:
        delta = text[self.printed:]
        if delta and self.out is not None:
            self.out.write(delta)
            self.out.flush()
        self.printed = len(text)
        if len(self.ids) > 64 and text.endswith((" ", "\n")):  # keep decoding cost bounded on long streams
            self.ids, self.printed = [], 0
        return delta
