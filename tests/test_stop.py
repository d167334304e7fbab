"""The one stop check (`attnlab.stop.Stop`): a stop string first (its text cut), then a stop id, then max_tokens."""
from __future__ import annotations

from attnlab.stop import Stop


class Chars:
    """A tokenizer whose token t is the character chr(t)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_reasons_in_order_and_nothing_after_the_end():
    stop = Stop(3, stop_ids={7})
    assert [stop.push(t) or stop.reason for t in (1, 2)] == [None, None]
    stop.push(7)
    assert stop.reason == "stop" and stop.count == 3
    stop.push(5)
    assert stop.count == 3  # the reply had ended
    length = Stop(2, stop_ids={7})
    length.push(1)
    length.push(2)
    assert length.reason == "length"
    assert Stop(0).reason == "length"  # nothing to sample


def test_a_stop_string_cuts_the_text_and_ends_the_reply():
    stop = Stop(10, stops=["cd"], tokenizer=Chars())
    text = "".join(stop.push(ord(c)) for c in "abc")
    assert text == "ab" and stop.reason is None  # "c" held back: it may start the stop
    assert stop.push(ord("d")) == "" and stop.reason == "stop" and stop.tail() == ""
    plain = Stop(2, stops=["zz"], tokenizer=Chars())
    got = plain.push(ord("a")) + plain.push(ord("z"))
    assert plain.reason == "length" and got + plain.tail() == "az"
