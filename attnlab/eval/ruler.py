"""RULER's synthetic long-context tasks (Hsieh et al. 2024), generated locally.

Why: perplexity says nothing about whether a compressed KV cache can still *find* one
fact in a long context; RULER asks exactly that, with tasks that need no download, and
it is what kvpress reports for every press. Seven of RULER's tasks are here, following
the paper's definitions and its base-model prompt templates:

* niah_single / niah_multikey / niah_multivalue / niah_multiquery: "special magic
  numbers" (7 digits) for word keys hidden in a haystack (the held-out plays, RULER's
  "essay" haystack, or its noise sentences); multikey adds 3 distractor needles,
  multivalue gives one key 4 values, multiquery asks for 4 keys at once;
* vt (variable tracking): a chain of 4 hops `VAR X = VAR Y` from a 5-digit value, in
  noise; all 5 variable names are the answer;
* cwe (common words): a numbered word list where 10 words appear often and the rest
  3 times; the 10 frequent words are the answer;
* fwe (frequent words): "coded" words drawn from a Zipf law (alpha 2); the 3 most
  frequent are the answer.
RULER's QA tasks are left out: they need SQuAD / HotpotQA, which cannot be downloaded here.

Every sample is sized to a target length in the model's tokenizer (the whole prompt,
answer prefix included, never more than the target and within one unit of it: a word
of haystack, a line of a list) and is a pure function of (task, length, seed, index).
Scoring is RULER's `string_match_all`: the share of expected answers found in the
prediction, case-insensitive, averaged over samples, times 100.
"""
from __future__ import annotations

import functools
import random
import re
import string
from collections import Counter
from collections.abc import Callable

from attnlab.errors import AttnlabError

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
MAX_NEW = {"niah_single": 12, "niah_multikey": 12, "niah_multivalue": 40, "niah_multiquery": 40, "vt": 24,
           "cwe": 48, "fwe": 16}  # tokens to generate: the answer and a little slack (generation stops at a newline)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_PROMPT = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n{context}\n")
NIAH_ONE = ("What is the special magic number for {query} mentioned in the provided text? "
            "The special magic number for {query} mentioned in the provided text is")
NIAH_ALL = ("What are all the special magic numbers for {query} mentioned in the provided text? "
            "The special magic numbers for {query} mentioned in the provided text are")
VT_PROMPT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
             "Question: Find all variables that are assigned the value {query} in the text above. Answer: According "
             "to the chain(s) of variable assignment in the text above, {n} variables are assigned the value "
             "{query}, they are:")
CWE_PROMPT = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
              "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
              "above list? Answer: The top 10 words that appear most often in the list are:")
FWE_PROMPT = ("Read the following coded text and track the frequency of each coded word. Find the three most "
              "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
              "the dots '....'. What are the three most frequently appeared words in the above coded text? Answer: "
              "According to the coded text above, the three most frequently appeared words are:")


@functools.lru_cache(maxsize=1)
def _plays() -> str:
    from attnlab.data import corpus
    return corpus("shakespeare:test")


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Distinct plain words of the held-out plays (4-9 letters): keys and CWE's words."""
    words = set(re.findall(r"\b[a-z]{4,9}\b", _plays()))  # lower-case words only: no names
    return tuple(sorted(words))


def _pieces(text: str) -> list[str]:
    """Words with their trailing whitespace: joining any prefix gives back the text's prefix."""
    return re.findall(r"\S+\s*", text)


def _haystack(kind: str, rng: random.Random, words: int) -> list[str]:
    if kind == "noise":
        unit = _pieces(NOISE)
        return (unit * (words // len(unit) + 1))[:words]
    if kind != "plays":
        raise AttnlabError(f"unknown haystack {kind!r}; choose from plays, noise")
    pieces = _pieces(_plays())
    if words > len(pieces):
        raise AttnlabError(f"the plays have {len(pieces)} words, {words} asked")
    start = rng.randrange(0, len(pieces) - words + 1)
    return pieces[start:start + words]


def _boundary(pieces: list[str], at: int) -> int:
    """The sentence or line boundary nearest to word index `at` (a needle is inserted there)."""
    def ok(i):
        return i == 0 or i == len(pieces) or pieces[i - 1].rstrip(" ").endswith(("\n", ".", "!", "?", ";", ":"))
    for d in range(0, 40):
        for i in (at - d, at + d):
            if 0 <= i <= len(pieces) and ok(i):
                return i
    return at


def _insert(pieces: list[str], needles: list[str], depths: list[float]) -> tuple[str, list[int]]:
    """The haystack with each needle at its depth (share of the haystack's words before it); returns
    the text and each needle's character offset."""
    spots = sorted((_boundary(pieces, round(d * len(pieces))), i) for i, d in enumerate(depths))
    out, offsets, size, last = [], [0] * len(needles), 0, 0
    for at, i in spots:
        part = "".join(pieces[last:at])
        if part and not part[-1].isspace():
            part += " "
        offsets[i] = size + len(part)
        sep = "\n" if not part or part.endswith("\n") else " "
        out += [part, needles[i] + sep]
        size += len(part) + len(needles[i]) + 1
        last = at
    out.append("".join(pieces[last:]))
    return "".join(out), offsets


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def _key(rng: random.Random) -> str:
    vocab = _vocabulary()
    return f"{rng.choice(vocab)}-{rng.choice(vocab)}"


def _fit(encode: Callable[[str], list[int]], build: Callable[[int], tuple[str, dict]], length: int,
         lo: int = 1, hi: int = 1 << 16) -> tuple[str, dict, int]:
    """The largest size n in [lo, hi] whose prompt build(n) fits in `length` tokens (token count grows with n)."""
    n_tokens = len(encode(build(lo)[0]))
    if n_tokens > length:
        raise AttnlabError(f"length {length} is too short for this task (its smallest prompt has {n_tokens} tokens)")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(build(mid)[0])) <= length:
            lo = mid
        else:
            hi = mid - 1
    text, meta = build(lo)
    return text, meta, len(encode(text))


# ---------------------------------------------------------------- the tasks

def _niah(task: str, rng: random.Random, haystack: str, depth: float | None, n_words: int):
    keys = [_key(rng) for _ in range(4)]
    while len(set(keys)) < 4:
        keys = [_key(rng) for _ in range(4)]
    if task == "niah_single":
        needles, queries = [(keys[0], _number(rng, 7))], [keys[0]]
    elif task == "niah_multikey":
        needles, queries = [(k, _number(rng, 7)) for k in keys], [keys[0]]
    elif task == "niah_multivalue":
        needles, queries = [(keys[0], _number(rng, 7)) for _ in range(4)], [keys[0]]
    else:
        needles, queries = [(k, _number(rng, 7)) for k in keys], keys
    answers = [v for k, v in needles if k in queries]
    order = list(range(len(needles)))
    rng.shuffle(order)  # the asked needle is not always the first one
    depths = [depth if depth is not None and i == 0 else rng.random() for i in range(len(needles))]
    pool = _haystack(haystack, random.Random(rng.random()), n_words)  # one draw; every size tried is a prefix
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + " and " + queries[-1]
    question = (NIAH_ONE if task in ("niah_single", "niah_multikey") else NIAH_ALL).format(query=query)
    texts = [NEEDLE.format(key=needles[i][0], value=needles[i][1]) for i in order]
    depth_of = [depths[i] for i in order]

    def build(n):
        context, offsets = _insert(pool[:n], texts, depth_of)
        head = NIAH_PROMPT.format(context="")[:-1]
        return NIAH_PROMPT.format(context=context) + question, {
            "needle_chars": [len(head) + o for o in offsets], "context_chars": (len(head), len(head) + len(context))}
    return build, answers, {"depths": depth_of, "needles": texts, "queries": queries}


def _vt(rng: random.Random, hops: int = 4):
    def chain(r):
        names: list[str] = []  # in draw order: a set's order would follow PYTHONHASHSEED
        while len(names) < hops + 1:
            name = "".join(r.choice(string.ascii_uppercase) for _ in range(5))
            names += [name] if name not in names else []
        value = _number(r, 5)
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(hops)]
        return names, value, lines

    ex_names, ex_value, ex_lines = chain(random.Random(rng.random()))
    example_context = "".join(NOISE if i % 2 == 0 else f"{ex_lines[i // 2]}.\n" for i in range(2 * len(ex_lines)))
    example = VT_PROMPT.format(context=example_context, query=ex_value, n=hops + 1) + " " + " ".join(ex_names) + "\n\n"
    names, value, lines = chain(rng)
    spots = sorted(rng.random() for _ in lines)

    unit = _pieces(NOISE)

    def build(n):
        pieces = (unit * (n // len(unit) + 1))[:n]
        context, _ = _insert(pieces, [f"{x}." for x in lines], spots)
        return example + VT_PROMPT.format(context=context, query=value, n=hops + 1), {}
    return build, names, {}


def _cwe(rng: random.Random, length: int, n_common: int = 10):
    vocab = list(_vocabulary())
    words = rng.sample(vocab, 2000)
    common, rare_pool = words[:n_common], words[n_common:]
    # RULER's 30 and 3 repeats from 4K tokens on; a shorter list has room for fewer
    f_common = max(3, min(30, length // 160))
    f_rare = max(1, f_common // 10)

    ex = random.Random(rng.random()).sample(vocab, n_common + 5)
    ex_list = ex[:n_common] * 2 + ex[n_common:]
    random.Random(1).shuffle(ex_list)
    example = CWE_PROMPT.format(context="\n".join(f"{i + 1}. {w}" for i, w in enumerate(ex_list))) + " " + \
        " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[:n_common])) + "\n\n"
    order_seed = rng.random()

    def build(n):
        items = common * f_common + rare_pool[:n] * f_rare
        random.Random(order_seed).shuffle(items)
        return example + CWE_PROMPT.format(context="\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))), {}
    return build, common, {"f_common": f_common, "f_rare": f_rare}


def _fwe(rng: random.Random, alpha: float = 2.0, vocab_size: int = 1000):
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5))))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    weights = [1 / (i + 1) ** alpha for i in range(vocab_size)]
    draw_seed = rng.random()

    def build(n):
        draws = random.Random(draw_seed).choices(vocab, weights, k=n)
        return FWE_PROMPT.format(context=" ".join(draws)), {"draws": draws}

    def answers(meta):
        top = Counter(meta["draws"]).most_common(4)
        return [w for w, _ in top[:3]], len(top) < 4 or top[2][1] > top[3][1]
    return build, answers


def make_sample(task: str, encode: Callable[[str], list[int]], length: int, seed: int = 0, index: int = 0,
                haystack: str = "plays", depth: float | None = None) -> dict:
    """One sample: {"task", "length", "index", "prompt", "ids", "answers", ...}; deterministic in its arguments.

    length is the prompt's size in tokens of `encode` (never exceeded); depth (NIAH) puts the asked
    needle after that share of the haystack (default: a seeded random depth, as in RULER).
    """
    if task not in TASKS:
        raise AttnlabError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    if depth is not None and not 0 <= depth <= 1:
        raise AttnlabError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"{task}/{length}/{seed}/{index}")
    extra: dict = {}
    if task.startswith("niah"):
        words = max(64, length)  # a word is more than one token: always enough haystack
        build, answers, extra = _niah(task, rng, "noise" if haystack == "noise" else haystack, depth, words)
        text, meta, n = _fit(encode, build, length, 0, words)
    elif task == "vt":
        build, answers, extra = _vt(rng)
        text, meta, n = _fit(encode, build, length, 0, length)
    elif task == "cwe":
        build, answers, extra = _cwe(rng, length)
        text, meta, n = _fit(encode, build, length, 0, 1990)
    else:
        for attempt in range(20):  # redraw until the top 3 are strictly more frequent than the 4th
            build, answer_of = _fwe(random.Random(rng.random()))
            text, meta, n = _fit(encode, build, length, 1, length)
            answers, clear = answer_of(meta)
            if clear:
                break
        meta = {}
    ids = encode(text)
    return {"task": task, "length": length, "seed": seed, "index": index, "prompt": text, "ids": ids,
            "tokens": len(ids), "context_tokens": context_tokens(text, ids, encode), "answers": answers,
            "max_new": MAX_NEW[task], **extra, **meta}


def context_tokens(text: str, ids: list[int], encode: Callable[[str], list[int]]) -> int:
    """How many leading tokens of the prompt are its context: the rest is the question (from the last
    "Question:" or NIAH's "What ..." line on, answer prefix included). kvpress's question protocol
    compresses the context only; the prompt's tokens are split, never re-tokenised."""
    cut = max(text.rfind("\nQuestion:"), text.rfind("\nWhat ")) + 1
    head = encode(text[:cut]) if cut > 0 else ids
    n = 0
    while n < min(len(head), len(ids)) and head[n] == ids[n]:
        n += 1
    return n


def string_match_all(pred: str, answers: list[str]) -> float:
    """RULER's metric for these tasks: the share of expected answers found in the prediction (case-insensitive)."""
    p = pred.lower()
    return sum(a.lower() in p for a in answers) / len(answers)
