"""When a reply ends: the one stop check of every decoding loop (`LM.decode`, `Session.generate`, the server's
runner), so EOS, stop ids, stop strings and max_tokens mean the same thing everywhere.

A reply ends at the token that completes a stop string (its text cut before the stop), at a stop id (an EOS:
the token is the reply's last), or after max_tokens tokens, checked in that order after each sampled token.
"""
from __future__ import annotations


class Stop:
    """push(token) for each sampled token -> the new text it releases ("" without a tokenizer); `reason` turns
    "stop" or "length" at the token that ends the reply (None until then); `tail()` the text held back."""

    def __init__(self, max_tokens: int, stop_ids=(), stops=(), tokenizer=None):
        self.max_tokens, self.stop_ids = max_tokens, frozenset(stop_ids)
        self.scan = None
        if stops:
            from attnlab.serve.protocol import StopScanner
            self.scan = StopScanner(list(stops))
        self.text = None
        if tokenizer is not None:
            from attnlab.textstream import TextStream
            self.text = TextStream(tokenizer)
        self.count, self.cut = 0, False
        self.reason: str | None = "length" if max_tokens <= 0 else None

    def push(self, token: int) -> str:
        if self.reason is not None:
            return ""
        self.count += 1
        text = self.text.push(token) if self.text is not None else ""
        if self.scan is not None:
            text = self.scan.push(text)
            self.cut = self.scan.stopped
        if self.cut or token in self.stop_ids:
            self.reason = "stop"
        elif self.count >= self.max_tokens:
            self.reason = "length"
        return text

    def tail(self) -> str:
        """What the text stream held back (an incomplete character, a possible stop's start); none after a cut."""
        if self.text is None or self.cut:
            return ""
        text = self.text.flush()
        return self.scan.push(text) + self.scan.flush() if self.scan is not None else text
