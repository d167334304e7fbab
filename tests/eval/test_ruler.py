"""RULER's generators: every sample carries its answer, sits at the asked depth and length, reproduces
from its seed; scoring is RULER's string_match_all; the runner resumes from finished units."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from attnlab.eval.ruler import TASKS, make_sample, string_match_all


@pytest.fixture(scope="module")
def encode():
    from attnlab.model.loaders import resolve
    from attnlab.model.tokenizer import load_tokenizer
    tok = load_tokenizer(resolve("smollm2-135m"))
    return lambda text: tok.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("length", [512, 1024])
def test_lengths_are_within_a_few_tokens_of_the_target(encode, length):
    for task in TASKS:
        for index in range(2):
            s = make_sample(task, encode, length, seed=3, index=index)
            assert length - 8 <= s["tokens"] <= length, (task, index, s["tokens"])
            assert s["tokens"] == len(encode(s["prompt"])) and s["ids"] == encode(s["prompt"])


def test_seeds_reproduce_and_differ(encode):
    for task in TASKS:
        a, b = make_sample(task, encode, 512, seed=1, index=0), make_sample(task, encode, 512, seed=1, index=0)
        assert a["prompt"] == b["prompt"] and a["answers"] == b["answers"]
        c = make_sample(task, encode, 512, seed=2, index=0)
        assert c["answers"] != a["answers"]


def test_samples_do_not_depend_on_the_python_hash_seed():
    # vt once listed its chain from a set, so its prompt changed from one process to the next
    code = ("from attnlab.eval.ruler import TASKS, make_sample\n"
            "for t in TASKS: print(make_sample(t, lambda s: list(s.encode()), 3000, seed=0, index=0)['prompt'])")
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(h)}, text=True,
                           capture_output=True, check=True).stdout for h in (1, 2, 3)}
    assert len(outs) == 1


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("haystack", ["plays", "noise"])
def test_needle_sits_at_the_depth_asked(encode, depth, haystack):
    s = make_sample("niah_single", encode, 1024, seed=0, index=1, haystack=haystack, depth=depth)
    start, end = s["context_chars"]
    at = s["needle_chars"][0]
    assert s["prompt"][at:].startswith(s["needles"][0])
    # depth in tokens: the share of the haystack's tokens before the needle
    before = len(encode(s["prompt"][start:at]))
    total = len(encode(s["prompt"][start:end])) - len(encode(s["needles"][0]))
    assert abs(before / total - depth) < 0.05, (before, total)


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_niah_answers_are_the_asked_keys_values(encode, task):
    s = make_sample(task, encode, 512, seed=0, index=0)
    found = dict()
    for key, value in re.findall(r"special magic numbers for (\S+) is: (\d{7})\.", s["prompt"]):
        found.setdefault(key, []).append(value)
    asked = [k for k in found if re.search(rf"magic numbers? for [^?]*{re.escape(k)}", s["prompt"].split("\n")[-1])]
    assert sorted(v for k in asked for v in found[k]) == sorted(s["answers"])
    n_needles = {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4, "niah_multiquery": 4}[task]
    assert sum(map(len, found.values())) == n_needles
    assert len(s["answers"]) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)


def test_vt_answers_are_the_chain(encode):
    s = make_sample("vt", encode, 1024, seed=0, index=0)
    task = s["prompt"].split("\n\n", 2)[-1]  # after the one-shot example
    value = re.search(r"assigned the value (\d+) in the text above", task.split("Question:")[-1]).group(1)
    names = set()
    for line in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", task):
        src = line[1]
        if src == value or src[4:] in names:
            names.add(line[0])
    assert sorted(names) == sorted(s["answers"]) and len(names) == 5


def test_word_extraction_answers_are_the_most_frequent(encode):
    s = make_sample("cwe", encode, 1024, seed=0, index=0)
    items = re.findall(r"^\d+\. (\w+)$", s["prompt"].split("Question:")[-2].split("\n\n")[-1], re.M)
    counts = Counter(items)
    assert {w for w, _ in counts.most_common(10)} == set(s["answers"])
    assert min(counts[w] for w in s["answers"]) > max(c for w, c in counts.items() if w not in s["answers"])
    f = make_sample("fwe", encode, 1024, seed=0, index=0)
    words = Counter(f["prompt"].split("coded words. ")[1].split("\nQuestion")[0].split())
    top = words.most_common(4)
    assert [w for w, _ in top[:3]] == f["answers"] and top[2][1] > top[3][1]


def test_string_match_all_is_rulers_metric():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert string_match_all("XYZAB xyzac", ["xyzab", "XYZAC", "QQQQQ"]) == pytest.approx(2 / 3)
    assert string_match_all("", ["a"]) == 0.0


def test_bad_task_and_depth_are_clear_errors(encode):
    from attnlab.errors import AttnlabError
    with pytest.raises(AttnlabError, match="unknown RULER task"):
        make_sample("qa", encode, 512)
    with pytest.raises(AttnlabError, match="depth"):
        make_sample("niah_single", encode, 512, depth=1.5)
    with pytest.raises(AttnlabError, match="too short"):
        make_sample("cwe", encode, 200)
