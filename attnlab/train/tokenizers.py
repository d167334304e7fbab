"""Tokenizers for training from scratch, serialisable into a checkpoint's JSON.

- ``word`` (default): words, punctuation marks and newlines, the ``vocab_size - 1``
  most frequent in the training text plus ``<unk>`` (id 0). Closest to the word-level
  WikiText setup of the JoMA experiments, and the output layer stays small.
- ``char``: every character of the training text plus ``<unk>``.
- ``smollm2``: the embedded SmolLM2 BPE (49152 ids; large output layer, slow on CPU).
"""
from __future__ import annotations

import re
from collections import Counter

from attnlab.errors import AttnlabError

WORD_RE = re.compile(r"\n|\w+(?:'\w+)*|[^\w\s]")
UNK = "<unk>"


class VocabTokenizer:
    """Word or character tokenizer over a fixed vocabulary; unknown pieces map to id 0."""

    def __init__(self, kind: str, vocab: list[str]):
        if kind not in ("word", "char"):
            raise AttnlabError(f"unknown vocabulary tokenizer {kind!r}")
        self.kind, self.vocab = kind, list(vocab)
        self.index = {p: i for i, p in enumerate(self.vocab)}

    @classmethod
    def fit(cls, kind: str, text: str, vocab_size: int | None = None) -> "VocabTokenizer":
        counts = Counter(cls._pieces(kind, text))
        keep = [p for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
        if vocab_size is not None:
            if vocab_size < 2:
                raise AttnlabError(f"vocab_size must be >= 2, got {vocab_size}")
            keep = keep[:vocab_size - 1]
        return cls(kind, [UNK] + keep)

    @staticmethod
    def _pieces(kind: str, text: str) -> list[str]:
        return WORD_RE.findall(text) if kind == "word" else list(text)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(p, 0) for p in self._pieces(self.kind, text)]

    def decode(self, ids) -> str:
        sep = " " if self.kind == "word" else ""
        return sep.join(self.vocab[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab": self.vocab}


class PretrainedTokenizer:
    """A checkpoint's own tokenizer (no fitting; its full vocabulary): the embedded SmolLM2's by
    default, or that of any model `attnlab.load` reads (fine-tuning a pretrained model)."""

    kind = "smollm2"

    def __init__(self, source: str = "smollm2-135m", tok=None):
        from attnlab.model.loaders import resolve
        from attnlab.model.tokenizer import load_tokenizer
        self.source = str(source)
        self.tok = tok if tok is not None else load_tokenizer(resolve(self.source))
        if self.tok is None:
            raise AttnlabError(f"{self.source} has no tokenizer")

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def to_dict(self) -> dict:
        return {"kind": "smollm2"} if self.source == "smollm2-135m" else {"kind": "pretrained", "source": self.source}


def make_tokenizer(kind: str, text: str, vocab_size: int | None = None):
    """A tokenizer of `kind` ("word", "char", "smollm2"), fitted on `text` when it has a vocabulary."""
    if kind == "smollm2":
        return PretrainedTokenizer()
    if kind in ("word", "char"):
        return VocabTokenizer.fit(kind, text, vocab_size if kind == "word" else None)
    raise AttnlabError(f"unknown tokenizer {kind!r}; choose from word, char, smollm2")


def tokenizer_from_dict(d: dict):
    if d["kind"] in ("smollm2", "pretrained"):
        return PretrainedTokenizer(d.get("source", "smollm2-135m"))
    return VocabTokenizer(d["kind"], d["vocab"])
