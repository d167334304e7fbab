"""A multi-turn conversation on one KV cache: each turn feeds only its new tokens.

The cache holds the rendered conversation so far (minus the reply's closing token, which
was sampled but not fed). A new turn renders the whole conversation with the chat
template and feeds only the text past what the cache already holds (`Session.extend`),
so the history is never prefilled twice; with a bounded cache policy the conversation can
go on forever.
"""
from __future__ import annotations

from collections.abc import Iterator

from attnlab.sampling import Sampler
from attnlab.session import Session


class ChatSession:
    def __init__(self, lm, sampler: Sampler, max_new_tokens: int = 256, cache_factory=None):
        self.lm, self.sampler, self.max_new_tokens = lm, sampler, max_new_tokens
        self.new_cache = cache_factory or lm.new_cache
        self.stats = None  # a SpecStats the next replies fill (speculative decoding, the LM's options)
        self.reset()

    def reset(self) -> None:
        self.session, self.messages = Session(self.lm, self.new_cache()), []

    @property
    def cache(self):
        return self.session.cache

    @property
    def fed(self) -> str:
        """The rendered text whose tokens the cache holds."""
        return self.session.text

    def ask(self, user: str) -> Iterator[int]:
        """Yield the reply's token ids as they are sampled; the reply joins the history at the end."""
        self.messages.append({"role": "user", "content": user})
        text = self.lm.render_chat(self.messages)
        if not self.session.matches(text):  # the template re-rendered history differently: start afresh
            self.session = Session(self.lm, self.new_cache())
        self.session.extend(text)
        self.session.stats = self.stats
        reply = []
        for token in self.session.generate(self.sampler, self.max_new_tokens):
            reply.append(token)
            yield token
        self.messages.append({"role": "assistant", "content": self.lm.tokenizer.decode(reply, skip_special_tokens=True)})
