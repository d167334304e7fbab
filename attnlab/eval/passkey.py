"""Passkey retrieval (Mohtashami & Jaggi 2023, as used by Position Interpolation and YaRN).

A random number is hidden at a chosen depth of long, repetitive filler text and asked
for at the end. It tests what perplexity cannot: whether one specific early fact is
still reachable. A model extended by RoPE scaling can retrieve it from anywhere in its
window; a KV-cache policy that evicted the needle cannot, however flat its perplexity.
"""
from __future__ import annotations

import random
import re

import torch

from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(lm, length: int, depth: float, key: str) -> list[int]:
    """Token ids of about `length` tokens (never more) with the needle after `depth` of the filler."""
    if not 0 <= depth <= 1:
        raise AttnlabError(f"depth must be in [0, 1], got {depth}")

    def n(text):
        return len(lm.encode_rendered(text))

    fixed = len(lm.encode(PREFIX + NEEDLE.format(key=key) + QUESTION))
    per = n(FILLER * 16) / 16
    units = int((length - fixed - 8) / per)
    if units < 1:
        raise AttnlabError(f"length {length} is too short for a passkey prompt (needs > {fixed + 8 + per:.0f} tokens)")
    while True:
        before = round(depth * units)
        text = PREFIX + FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION
        ids = lm.encode(text)
        if len(ids) <= length:
            return ids
        units -= 1 + (len(ids) - length) // max(1, int(per))


@torch.inference_mode()
def retrieve(lm, ids: list[int], key: str, policy=None, chunk: int = 512) -> tuple[bool, str]:
    """Prefill ids (through a cache thinned by policy, if any), decode greedily; (correct, answer)."""
    cache = lm.new_cache(capacity=len(ids) + 16, policy=policy)
    n_new = len(lm.encode_rendered(" " + key)) + 2
    out = list(lm.stream(ids, cache, Sampler(), n_new, chunk=chunk, stop_at_eos=True))
    answer = lm.tokenizer.decode(out, skip_special_tokens=True)
    digits = re.search(r"\d+", answer)
    return bool(digits) and digits.group() == key, answer.strip()


def passkey_eval(lm, lengths: list[int], depths: list[float], trials: int = 3, seed: int = 0,
                 policy=None, chunk: int = 512, progress=None) -> list[dict]:
    """Accuracy per (length, depth) over `trials` random 5-digit keys (the same keys for every
    length and depth, so rows are paired). policy: one KV policy object or None (full cache)."""
    if trials < 1:
        raise AttnlabError(f"trials must be >= 1, got {trials}")
    keys = [str(random.Random(seed * 1000 + t).randint(10000, 99999)) for t in range(trials)]
    rows = []
    for length in lengths:
        for depth in depths:
            answers, correct = [], 0
            for key in keys:
                ids = passkey_prompt(lm, length, depth, key)
                ok, answer = retrieve(lm, ids, key, policy, chunk)
                correct += ok
                answers.append({"key": key, "answer": answer, "correct": ok, "tokens": len(ids)})
                if progress is not None:
                    progress(1)
            rows.append({"length": length, "depth": depth, "trials": trials, "correct": correct,
                         "accuracy": correct / trials, "answers": answers})
    return rows
