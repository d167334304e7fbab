"""The Session step API and incremental detokenisation that the CLI, ChatSession and the server share."""
from __future__ import annotations

import pytest
import torch

from attnlab.sampling import Sampler
from attnlab.session import Session
from attnlab.textstream import TextStream


def test_session_generation_equals_batched_generate_and_pauses_anywhere(tiny):
    prompt = [5, 6, 7, 8, 9]
    ref = tiny.generate_ids([prompt], 10, Sampler())[0]
    s = Session(tiny, chunk=2)
    s.feed(prompt)
    gen = s.generate(Sampler(), 10)
    got = [next(gen) for _ in range(4)]  # pause mid-reply: exactly the yielded tokens but the last are fed
    assert s.fed == len(prompt) + 3
    got += list(gen)
    assert got == ref and s.fed == len(prompt) + len(ref) - 1
    # feeding the pending token continues the same sequence a full forward sees
    s.feed([got[-1]])
    full = tiny.logits(torch.tensor([prompt + got]))[0, -1]
    torch.testing.assert_close(s.logits, full, atol=1e-4, rtol=1e-4)


def test_session_rejects_bad_input(tiny):
    s = Session(tiny)
    with pytest.raises(ValueError, match="empty prompt"):
        next(s.generate(Sampler(), 3))
    with pytest.raises(ValueError, match="one row"):
        s.feed([[1, 2], [3, 4]])


def test_session_extend_feeds_only_the_new_text(smollm2):
    s = Session(smollm2)
    first = smollm2.render_chat([{"role": "user", "content": "Hi"}])
    assert s.extend(first) == len(smollm2.encode_rendered(first))
    reply = list(s.generate(Sampler(), 5))
    answer = smollm2.tokenizer.decode(reply, skip_special_tokens=True)
    second = smollm2.render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "Bye"}])
    assert s.matches(second) and not s.matches(first.replace("Hi", "Ho"))
    new = second[len(s.text):]
    assert s.extend(second) == len(smollm2.encode_rendered(new))
    ids = smollm2.encode_rendered(second)
    assert abs(s.fed - len(ids)) <= 1  # token boundaries at the seams may differ by a merge


def test_textstream_releases_only_final_text(smollm2):
    tok = smollm2.tokenizer
    text = "Grüße 🌍 " * 30 + "naïve café"
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok)
    deltas = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
