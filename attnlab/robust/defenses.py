"""Defenses against adversarial suffixes, each a small class with one interface: `check(prompt) -> Verdict`.

- `PerplexityFilter` (Jain et al. 2023): GCG's suffixes are strings no language model would write, so their
  tokens' negative log-likelihood is high. Scored where the model reads the text: in a chat request, the user's
  message inside the rendered template ("chat"); a raw completion prompt alone ("text"). The score is the highest
  mean NLL over windows of `window` tokens (a suffix appended to a long, fluent prompt is diluted in the whole
  prompt's mean, not in its windows). Standalone it costs one prefill; in the server it costs none: the request's
  own prefill also returns the logits of the user's tokens (`Screen`), and only the head over them is extra.
- `SmoothLLM` (Robey et al. 2023): N copies of the prompt with q% of its characters swapped at random, a reply
  to each, a majority vote of a judge over the replies; GCG suffixes are brittle to character edits. Costs N
  generations.
- `Guard`: the server's and `attnlab guard`'s spec ("ppl", "ppl:THRESHOLD[:TEXT_THRESHOLD]") parsed before the
  model loads.

The attention view (`attention_share.py`) is a measurement, not a filter.
"""
from __future__ import annotations

import math
import random
import string
import uuid
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler

# Windowed NLL thresholds (nats/token) calibrated on ordinary prompts (docs/robust.md: `attnlab guard --calibrate`),
# (model file, context): threshold; "chat": a user message in the chat template, "text": a prompt alone
CALIBRATED = {("SmolLM2-135M-Instruct.Q4_1.gguf", "chat"): 10.0,
              ("SmolLM2-135M-Instruct.Q4_1.gguf", "text"): 10.5,
              ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "chat"): 10.4,
              ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "text"): 10.7}
WINDOW = 10
CONTEXTS = ("chat", "text")


@dataclass(frozen=True)
class Verdict:
    flagged: bool
    score: float
    reason: str

    def as_dict(self) -> dict:
        return {"flagged": self.flagged, "score": round(self.score, 4), "reason": self.reason}


def user_spans(messages: list[dict], rendered: str, render, encode) -> list[tuple[int, int]]:
    """The token ranges [a, b) of the user messages' contents in `encode(rendered)` (rendered = render(messages)):
    each content's place found by rendering the messages again with a unique mark in its stead (a reply may quote
    the user), then the tokens of the text before its first character and before its end. Where the template does
    not copy a content verbatim, the whole prompt is one span (checked rather than skipped)."""
    tag = uuid.uuid4().hex
    marks = {i: f"\ue001{tag}{i}\ue001" for i, m in enumerate(messages) if m.get("role") == "user" and m["content"]}
    skeleton = render([{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)])
    spans, out, at = [], [], 0
    for i, mark in marks.items():
        cut = skeleton.find(mark, at)
        if cut < 0:
            break
        out.append(skeleton[at:cut])
        c0 = sum(map(len, out))
        out.append(messages[i]["content"])
        spans.append((c0, c0 + len(messages[i]["content"])))
        at = cut + len(mark)
    if len(spans) < len(marks) or "".join(out) + skeleton[at:] != rendered:
        return [(0, len(encode(rendered)))]
    return [(len(encode(rendered[:c0])), len(encode(rendered[:c1]))) for c0, c1 in spans]


class PerplexityFilter:
    """Flags a prompt whose worst window of `window` NLLs (nats/token, on `lm`) passes `threshold` (a span shorter
    than a window is scored whole; window None: the mean over each span whole). context "chat": the prompt as a user
    message in the chat template; "text": the prompt alone (a completion request)."""

    def __init__(self, lm, threshold: float, window: int | None = WINDOW, context: str = "chat"):
        if window is not None and window < 2:
            raise AttnlabError(f"the perplexity window must be >= 2 tokens, got {window}")
        if context not in CONTEXTS:
            raise AttnlabError(f"the filter's context is chat or text, not {context!r}")
        self.lm, self.threshold, self.window, self.context = lm, float(threshold), window, context

    def tokens(self, prompt: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids the model reads for prompt, and the spans of them that are the user's."""
        if self.context == "text":
            ids = self.lm.encode(prompt)
            return ids, [(0, len(ids))]
        messages = [{"role": "user", "content": prompt}]
        rendered = self.lm.render_chat(messages)
        return self.lm.encode_rendered(rendered), user_spans(messages, rendered, self.lm.render_chat,
                                                             self.lm.encode_rendered)

    def nll(self, ids: list[int]) -> torch.Tensor:
        """Per-token NLL [T] of ids, each given those before it (the first, given nothing: NaN)."""
        x = torch.tensor(ids)[None]
        out = torch.full((len(ids),), math.nan)
        if len(ids) > 1:
            out[1:] = F.cross_entropy(self.lm.logits(x)[0, :-1], x[0, 1:], reduction="none")
        return out

    def windowed(self, nll: torch.Tensor, spans: list[tuple[int, int]]) -> float:
        """The highest mean over `window` consecutive scored NLLs (or a whole span's) in any span (NaN: not scored)."""
        best = 0.0
        for a, b in spans:
            part = nll[a:b]
            part = part[~part.isnan()]
            if len(part):
                whole = self.window is None or len(part) <= self.window
                w = part.mean() if whole else part.unfold(0, self.window, 1).mean(1).max()
                best = max(best, float(w))
        return best

    def score(self, prompt: str | list[int]) -> float:
        ids, spans = self.tokens(prompt) if isinstance(prompt, str) else (list(prompt), [(0, len(prompt))])
        return self.windowed(self.nll(ids), spans)

    def verdict(self, score: float) -> Verdict:
        flagged = score > self.threshold
        where = "the prompt" if self.window is None else f"a {self.window}-token window of the prompt"
        reason = (f"perplexity filter: {where} scores {score:.2f} nats/token, above the threshold {self.threshold:g}"
                  if flagged else "")
        return Verdict(flagged, score, reason)

    def check(self, prompt: str | list[int]) -> Verdict:
        return self.verdict(self.score(prompt))


@dataclass(eq=False)
class Screen:
    """The filter inside a request's own prefill (the server's guard): which prompt positions' logits the prefill
    must return, the NLL of the user's tokens from them, and the verdict once the prompt is in.

    spans: the user's tokens, [a, b) in the prompt fed (a token at 0 has no logits before it in this prompt: not
    scored); reject(verdict): the exception a flagged request fails with."""
    filt: PerplexityFilter
    spans: list[tuple[int, int]]
    reject: object
    nll: dict = field(default_factory=dict)  # prompt position -> its token's NLL

    def fed_from(self, n: int) -> None:
        """The prompt fed starts n tokens in (a session held the rest, its user tokens checked when they were fed)."""
        self.spans = [(max(a - n, 0), b - n) for a, b in self.spans if b > n]

    def wants(self, a: int, b: int) -> range | str:
        """The logits a prompt chunk [a, b) returns: from the first position whose next token is the user's on
        (its last position's, the session's next logits, included), else the last only."""
        first = min((max(s - 1, a) for s, e in self.spans if max(s, 1) < e and max(s - 1, a) < min(e - 1, b)),
                    default=None)
        return "last" if first is None else range(first - a, b - a)

    def take(self, at: int, logits: torch.Tensor, prompt: list[int]) -> None:
        """logits [n, vocab] of prompt positions at.. : the NLL of each next token that is the user's."""
        pos = [p for p in range(at, min(at + len(logits), len(prompt) - 1))
               if any(s <= p + 1 < e for s, e in self.spans)]
        if pos:
            nll = F.cross_entropy(logits[[p - at for p in pos]].float(), torch.tensor([prompt[p + 1] for p in pos]),
                                  reduction="none")
            self.nll.update(zip((p + 1 for p in pos), nll.tolist()))

    def failure(self) -> Exception | None:
        """Once the prompt is in: the exception to fail with if the filter flags the user's tokens, else None."""
        end = max((e for _, e in self.spans), default=0)
        nll = torch.tensor([self.nll.get(p, math.nan) for p in range(end)])
        v = self.filt.verdict(self.filt.windowed(nll, self.spans))
        return self.reject(v) if v.flagged else None


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
    """A guard spec, parsed before the model loads: 'ppl' (the model file's calibrated thresholds),
    'ppl:THRESHOLD' (windowed NLL, nats/token, for chat messages and raw prompts alike) or
    'ppl:THRESHOLD:TEXT_THRESHOLD' (raw prompts apart; either may be empty: calibrated). `build(lm, context)` gives
    the filter of chat messages or raw prompts."""
    kind: str = "ppl"
    threshold: float | None = None
    text_threshold: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Guard":
        kind, *values = text.strip().split(":")
        if kind != "ppl":
            raise AttnlabError(f"unknown guard {kind!r}; the guard is ppl or ppl:THRESHOLD[:TEXT_THRESHOLD] "
                               "(nats/token)")
        if len(values) > 2:
            raise AttnlabError(f"the ppl guard takes at most two thresholds, got {text!r}")
        out = []
        for value in values:
            try:
                out.append(float(value) if value else None)
            except ValueError:
                raise AttnlabError(f"the ppl guard's threshold must be a number, got {value!r}") from None
            if out[-1] is not None and not out[-1] > 0:
                raise AttnlabError(f"the ppl guard's threshold must be > 0, got {value}")
        chat = out[0] if out else None
        return cls(kind, chat, out[1] if len(out) > 1 else chat)

    def build(self, lm, context: str = "chat") -> PerplexityFilter:
        threshold = self.threshold if context == "chat" else self.text_threshold
        if threshold is None:
            name = getattr(lm.source, "name", str(lm.source))
            if (name, context) not in CALIBRATED:
                raise AttnlabError(f"no calibrated perplexity threshold for {name} ({context} prompts); give one "
                                   "(ppl:THRESHOLD) or calibrate it with `attnlab guard MODEL --calibrate`")
            threshold = CALIBRATED[name, context]
        return PerplexityFilter(lm, threshold, WINDOW, context)
