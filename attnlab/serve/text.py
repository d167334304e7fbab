"""Chat text the server tokenises: special tokens only where the chat template put them.

Why: rendering the history with the template and tokenising the result would turn a user's
typed `<|im_end|>` into the real end-of-turn token (role injection). Before rendering, every
special-token string in message content is escaped with a private-use mark (ESC); `encode`
turns unescaped special strings into their ids and everything else, escaped ones included,
into plain text. The escaped rendering is what sessions store and match by prefix, so a typed
`<|im_end|>` and a real one never share a cache.
"""
from __future__ import annotations

import re

ESC = "\ue000"


class ChatText:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                          reverse=True)
        self.ids = {s: tokenizer.convert_tokens_to_ids(s) for s in specials}
        alt = "|".join(re.escape(s) for s in specials) or "(?!)"
        self.special = re.compile(alt)
        self.token = re.compile(f"{ESC}{ESC}|{ESC}(?:{alt})|(?:{alt})")
        # a bound on the characters one token stands for (a vocabulary entry decodes to at most as many
        # characters as it has: byte-level entries are one byte per character): a prompt longer than
        # max_prompt_tokens * this surely has too many tokens, and is refused before tokenising
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))

    def escape(self, content: str) -> str:
        """Message content with its special-token strings (and the mark itself) marked as text."""
        return self.special.sub(lambda m: ESC + m.group(0), content.replace(ESC, ESC + ESC))

    def encode(self, text: str) -> list[int]:
        """Ids of escaped, template-rendered text (the counterpart of `LM.encode_rendered`)."""
        ids, plain, at = [], [], 0
        for m in self.token.finditer(text):
            plain.append(text[at:m.start()])
            at, s = m.end(), m.group(0)
            if s == ESC + ESC:
                plain.append(ESC)
            elif s.startswith(ESC):
                plain.append(s[1:])
            else:
                ids += self._plain("".join(plain)) + [self.ids[s]]
                plain = []
        plain.append(text[at:])
        return ids + self._plain("".join(plain))

    def _plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
