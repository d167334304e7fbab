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
        self.scan = StopScanner(list(stops)) if stops else None
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


class StopScanner:
    """Cuts streamed text at the first stop string to complete, holding back only what may start one.

    Why a KMP automaton per stop: re-searching the held text for every stop after every token
    costs time quadratic in a stop's length, on the model thread. Here each character costs
    amortised O(1) per stop, so a reply's scan is linear in its text whatever the stops.
    """

    def __init__(self, stops: list[str]):
        self.stops, self.buf, self.stopped = stops, "", False
        self.fail = [_failure(s) for s in stops]
        self.state = [0] * len(stops)  # per stop: length of its longest prefix that ends the text so far

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        text, start = self.buf + delta, len(self.buf)
        for j in range(start, len(text)):
            c, done = text[j], 0
            for i, s in enumerate(self.stops):
                k, fail = self.state[i], self.fail[i]
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):  # of the stops completed by this character, the longest starts first
                    done, k = max(done, k), fail[k - 1]
                self.state[i] = k
            if done:
                self.buf, self.stopped = "", True
                return text[:j + 1 - done]
        hold = max(self.state, default=0)
        out, self.buf = text[:len(text) - hold], text[len(text) - hold:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f
