"""One conversation on one KV cache: feed tokens, sample the next, repeat.

Why it exists: `LM.stream`, `ChatSession` and the HTTP server hold a conversation whose
state (cache, next-token logits, the rendered text the cache holds) outlives one request,
and the server must pause decoding between tokens to interleave clients. The decoding
loop itself is the engine's one loop (`LM.decode`, ending by the one stop check, `attnlab.stop.Stop`); a
session is its batch-1 caller, and the server's runner feeds it through the engine's step (`took`).

Invariant: after yielding token t, `generate` has fed every earlier reply token but not t;
the caller continues the conversation by feeding t (e.g. the EOS that closes a chat turn)
with its next prompt. `text` is the rendered text whose tokens the cache holds, so a new
turn that re-renders the whole history can feed only what lies past it (`extend`).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler


class Session:
    def __init__(self, lm, cache=None, chunk: int = 512):
        self.lm, self.chunk = lm, chunk
        self.cache = cache if cache is not None else lm.new_cache()
        self.logits: torch.Tensor | None = None  # [vocab] next-token logits after everything fed
        self.text = ""                            # rendered text held by the cache (chat use)
        self.fed = 0                              # tokens fed so far
        self.ids: list[int] = []                  # those tokens, in order (what a continuation must start with)
        self.drafter, self.stats = None, None     # speculative decoding (the LM's options): its drafter, a SpecStats

    @torch.inference_mode()
    def feed(self, ids) -> None:
        """Append token ids (list or [T] / [1, T] tensor) to the cache; prompts go in chunks of `chunk`."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise AttnlabError(f"a session feeds one row of token ids, got shape {tuple(ids.shape)}")
        if ids.shape[1] == 0:
            return
        self.took(ids[0].tolist(), self.lm.prefill(ids, self.cache, self.chunk)[0])

    def took(self, ids: list[int], logits: torch.Tensor | None) -> None:
        """Tokens the engine's step appended to this cache (`feed`, or the server's runner), and the logits [vocab]
        after the last of them (None: a reply's token, whose logits the caller samples itself)."""
        self.ids += ids
        self.fed += len(ids)
        self.logits = logits

    def unfeed(self, k: int) -> None:
        """Take back the last k tokens fed (a speculative step's kept drafts past where the reply stopped)."""
        if k:
            self.cache.truncate(self.cache.seen - k)
            self.ids, self.fed, self.logits = self.ids[:-k], self.fed - k, None

    def rewind(self, n: int) -> None:
        """Forget every token past the first n (only a cache that never evicted): the next feed goes on from there."""
        self.cache.truncate(n)
        self.ids, self.fed, self.logits = self.ids[:n], n, None

    def matches(self, text: str) -> bool:
        """Whether `text` (a rendered prompt) continues what this cache holds."""
        return text.startswith(self.text)

    def new_ids(self, text: str) -> list[int]:
        """Token ids of the part of the rendered `text` past what the cache holds."""
        if not self.matches(text):
            raise AttnlabError("the prompt does not continue this session")
        return self.lm.encode_rendered(text[len(self.text):]) if len(text) > len(self.text) else []

    def extend(self, text: str, ids: list[int] | None = None) -> int:
        """Feed the part of the rendered `text` past `self.text` (ids: its `new_ids`, if known); returns the count."""
        ids = self.new_ids(text) if ids is None else ids
        self.feed(ids)
        self.text = text
        return len(ids)

    def sample(self, sampler: Sampler) -> int:
        if self.logits is None:
            raise AttnlabError("nothing to continue from: feed a prompt (or the last reply token) first")
        return int(sampler(self.logits[None])[0])

    def generate(self, sampler: Sampler, max_new_tokens: int, stop_at_eos: bool = True) -> Iterator[int]:
        """Yield up to max_new_tokens sampled ids, stopping after an EOS; the last one is not fed.

        When the generator ends or is closed early, `text` gains the reply tokens that were fed, and
        the session waits for its next feed (which starts with the last reply token).
        """
        if self.logits is None and max_new_tokens:
            raise AttnlabError("nothing to continue from: empty prompt")
        eos = self.lm.eos_ids if stop_at_eos else set()
        reply: list[int] = []
        logits = self.logits[None] if max_new_tokens else None
        spec = self.lm.options.speculative
        if spec is not None:  # the same tokens, drafted and verified (`attnlab.speculative`); the drafter is kept
            from attnlab.speculative import decode, make_drafter
            self.drafter = self.drafter or make_drafter(self.lm, spec)
            tokens = decode(self.lm, self.cache, self.ids, logits, sampler, max_new_tokens, eos, spec, self.drafter,
                            self.stats)
        else:
            tokens = (int(t[0]) for t in self.lm.decode(self.cache, logits, sampler, max_new_tokens, eos))
        try:
            for token in tokens:
                if reply:
                    self.took(reply[-1:], None)  # every reply token but this one is in the cache
                reply.append(token)
                yield reply[-1]
        finally:
            tokens.close()  # a speculative decode cuts its cache back to the reply's tokens before the last
            self.end_reply(reply)

    def end_reply(self, reply: list[int]) -> None:
        """A reply is over: every token of it but the last was fed (and recorded); `text` gains those, and the
        session waits for its next feed, which starts with the last one."""
        if reply:
            self.logits = None
        if len(reply) > 1 and self.lm.tokenizer is not None:
            self.text += self.lm.tokenizer.decode(reply[:-1], skip_special_tokens=False)
