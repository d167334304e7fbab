"""Defenses against adversarial suffixes, each a small class with one interface: `check(prompt) -> Verdict`.

- `PerplexityFilter` (Jain et al. 2023): GCG's suffixes are strings no language model would write, so their
  tokens' negative log-likelihood is high. Scored on the prompt's text alone (no chat template): the mean NLL of
  the whole prompt, or the highest mean over windows of `window` tokens (a suffix appended to a long, fluent
  prompt is diluted in the whole-prompt mean, not in its windows). Costs one prefill of the prompt.
- `SmoothLLM` (Robey et al. 2023): N copies of the prompt with q% of its characters swapped at random, a reply
  to each, a majority vote of a judge over the replies; GCG suffixes are brittle to character edits. Costs N
  generations.
- `Guard`: the server's and `attnlab guard`'s spec ("ppl", "ppl:THRESHOLD") parsed before the model loads.

The attention view (`attention_share.py`) is a measurement, not a filter.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler

# Windowed NLL thresholds (nats/token) calibrated on ordinary prompts (docs/robust.md: `attnlab guard --calibrate`)
CALIBRATED = {("SmolLM2-135M-Instruct.Q4_1.gguf", None): 10.5,  # (model file, layers): threshold
              ("SmolLM2-135M-Instruct.Q4_1.gguf", 6): 33.9,
              ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", None): 10.7}
WINDOW = 10


@dataclass(frozen=True)
class Verdict:
    flagged: bool
    score: float
    reason: str

    def as_dict(self) -> dict:
        return {"flagged": self.flagged, "score": round(self.score, 4), "reason": self.reason}


class PerplexityFilter:
    """Flags a prompt whose NLL (nats/token, on `lm`) passes `threshold`: over the whole prompt (window None) or
    in its worst window of `window` tokens (prompts shorter than a window are scored whole).

    layers: score with the first `layers` blocks only, then the final norm and head (an early exit: a proxy of the
    perplexity at a fraction of the prefill; its own threshold); None: the whole network."""

    def __init__(self, lm, threshold: float, window: int | None = WINDOW, layers: int | None = None):
        if window is not None and window < 2:
            raise AttnlabError(f"the perplexity window must be >= 2 tokens, got {window}")
        if layers is not None and not 1 <= layers <= lm.cfg.n_layers:
            raise AttnlabError(f"the filter's layers must be in 1..{lm.cfg.n_layers}, got {layers}")
        self.lm, self.threshold, self.window, self.layers = lm, float(threshold), window, layers

    def nll(self, ids: list[int]) -> torch.Tensor:
        """Per-token NLL [T - 1] of ids (each token given those before it)."""
        if len(ids) < 2:
            return torch.zeros(0)
        x = torch.tensor(ids)[None]
        logits = self.lm.logits(x) if self.layers is None else self._early(x)
        return F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none")

    @torch.inference_mode()
    def _early(self, x: torch.Tensor) -> torch.Tensor:
        """logits [1, T, vocab] from the first `layers` blocks (the network's own modules, eager)."""
        from attnlab.model.llama import Pass
        m = self.lm.model
        h, ctx = m.embed(x), Pass.full(m.rope, x)
        for i, layer in enumerate(m.layers[:self.layers]):
            h = layer(h, ctx, i)
        return m.lm_head(m.norm(h)).float()

    def score(self, prompt: str | list[int]) -> float:
        ids = self.lm.encode(prompt) if isinstance(prompt, str) else list(prompt)
        nll = self.nll(ids)
        if not len(nll):
            return 0.0
        if self.window is None or len(nll) <= self.window:
            return float(nll.mean())
        return float(nll.unfold(0, self.window, 1).mean(1).max())

    def check(self, prompt: str | list[int]) -> Verdict:
        s = self.score(prompt)
        where = "the prompt" if self.window is None else f"a {self.window}-token window of the prompt"
        flagged = s > self.threshold
        reason = (f"perplexity filter: {where} scores {s:.2f} nats/token, above the threshold {self.threshold:g}"
                  if flagged else "")
        return Verdict(flagged, s, reason)

    def check_messages(self, messages: list[dict]) -> Verdict:
        """A chat request: each user message's text checked alone; the first flagged one, else the highest score."""
        verdicts = [self.check(m["content"]) for m in messages
                    if m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"]]
        if not verdicts:
            return Verdict(False, 0.0, "")
        return next((v for v in verdicts if v.flagged), max(verdicts, key=lambda v: v.score))


def perturb(text: str, rate: float, rng: random.Random) -> str:
    """SmoothLLM's swap perturbation: int(rate * len) distinct character positions replaced by random printable
    characters."""
    chars = list(text)
    for i in rng.sample(range(len(chars)), int(len(chars) * rate)):
        chars[i] = rng.choice(string.printable)
    return "".join(chars)


class SmoothLLM:
    """N perturbed copies (q = `rate` of the characters swapped), a greedy reply of `max_new` tokens to each,
    `judge(reply) -> bool` on each; flagged when a strict majority of the replies is judged attacked. `reply`
    returns a reply consistent with the majority, as the paper's defended model does."""

    def __init__(self, lm, judge, copies: int = 10, rate: float = 0.10, max_new: int = 16, seed: int = 0):
        if copies < 1 or not 0 < rate <= 1:
            raise AttnlabError(f"SmoothLLM needs copies >= 1 and 0 < rate <= 1, got {copies}, {rate}")
        self.lm, self.judge, self.copies, self.rate, self.max_new = lm, judge, copies, rate, max_new
        self.rng = random.Random(seed)
        self.calls = 0  # generations run: the defense's cost in model calls

    def replies(self, prompt: str) -> list[str]:
        texts = [perturb(prompt, self.rate, self.rng) for _ in range(self.copies)]
        ids = [self.lm.chat_ids([{"role": "user", "content": t}]) for t in texts]
        out = self.lm.generate_ids(ids, self.max_new, Sampler(0.0))
        self.calls += len(texts)
        return [self.lm.tokenizer.decode(o, skip_special_tokens=True) for o in out]

    def vote(self, replies: list[str]) -> tuple[bool, list[bool]]:
        votes = [bool(self.judge(r)) for r in replies]
        return sum(votes) * 2 > len(votes), votes

    def reply(self, prompt: str) -> tuple[str, Verdict]:
        replies = self.replies(prompt)
        flagged, votes = self.vote(replies)
        pick = next(r for r, v in zip(replies, votes) if v == flagged)
        share = sum(votes) / len(votes)
        reason = f"SmoothLLM: {sum(votes)} of {len(votes)} perturbed copies judged attacked" if flagged else ""
        return pick, Verdict(flagged, share, reason)

    def check(self, prompt: str) -> Verdict:
        return self.reply(prompt)[1]


@dataclass(frozen=True)
class Guard:
    """A guard spec, parsed before the model loads: 'ppl' (the calibrated threshold of the model file) or
    'ppl:THRESHOLD' (windowed NLL, nats/token). `build(lm)` gives the filter whose `check` the server calls."""
    kind: str = "ppl"
    threshold: float | None = None
    layers: int | None = None  # 'ppl:THRESHOLD:LAYERS': the early-exit filter of the first LAYERS blocks

    @classmethod
    def parse(cls, text: str) -> "Guard":
        kind, _, value = text.strip().partition(":")
        value, _, depth = value.partition(":")
        try:
            layers = int(depth) if depth else None
        except ValueError:
            raise AttnlabError(f"the ppl guard's layers must be an integer, got {depth!r}") from None
        if kind != "ppl":
            raise AttnlabError(f"unknown guard {kind!r}; the guard is ppl or ppl:THRESHOLD (nats/token)")
        try:
            threshold = float(value) if value else None
        except ValueError:
            raise AttnlabError(f"the ppl guard's threshold must be a number, got {value!r}") from None
        if threshold is not None and not threshold > 0:
            raise AttnlabError(f"the ppl guard's threshold must be > 0, got {value}")
        return cls(kind, threshold, layers)

    def build(self, lm) -> PerplexityFilter:
        threshold = self.threshold
        if threshold is None:
            name = getattr(lm.source, "name", str(lm.source))
            if (name, self.layers) not in CALIBRATED:
                raise AttnlabError(f"no calibrated perplexity threshold for {name} ({self.layers or 'all'} layers); "
                                   "give one (ppl:THRESHOLD) or calibrate it with `attnlab guard MODEL --calibrate`")
            threshold = CALIBRATED[name, self.layers]
        return PerplexityFilter(lm, threshold, WINDOW, self.layers)
