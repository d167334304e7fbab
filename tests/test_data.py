"""Tests for attnlab.data: the Shakespeare corpus, its split and file specs."""

import pytest

from attnlab import data
from attnlab.data import CorpusError, corpus, plays


def test_full_corpus_nonempty_deterministic_and_markup_free():
    text = corpus("shakespeare")
    assert len(text) > 1_000_000
    data.play_text.cache_clear()
    assert corpus("shakespeare") == text
    for mark in ("**", "#", "*", "_", "\\"):
        assert mark not in text, mark


def test_hamlet_renders_speakers_directions_and_headers():
    text = corpus("shakespeare:hamlet")
    assert "To be, or not to be: that is the question:" in text
    assert "ACT I\n\nSCENE I. Elsinore." in text
    assert "BERNARDO: Who's there?" in text
    assert "[Enter HORATIO and MARCELLUS]" in text
    assert corpus("shakespeare:HAMLET") == text


def test_splits_disjoint_cover_all_plays_and_test_has_hamlet():
    split = {s: plays(s) for s in data.SPLITS}
    assert plays("val") == split["validation"]
    names = [p for s in split.values() for p in s]
    assert len(names) == len(set(names))
    assert sorted(names) == plays()
    assert "hamlet" in split["test"]
    assert all(split.values())
    test = corpus("shakespeare:test")
    assert len(test) >= 150_000 and len(test.split()) > 20_000
    assert corpus("shakespeare:train") != test


def test_file_path(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("héllo wörld\n", encoding="utf-8")
    assert corpus(str(f)) == "héllo wörld\n"


@pytest.mark.parametrize("spec", ["shakespeare:no-such-play", "/no/such/file.txt",
                                  "shakespeare:bogus:x"])
def test_bad_specs_raise_corpus_error(spec):
    with pytest.raises(CorpusError) as e:
        corpus(spec)
    assert "\n" not in str(e.value)


def test_unknown_play_lists_valid_names():
    with pytest.raises(ValueError, match="hamlet"):
        corpus("shakespeare:hamlett")


def test_empty_file_raises(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("  \n", encoding="utf-8")
    with pytest.raises(CorpusError, match="empty"):
        corpus(str(f))
