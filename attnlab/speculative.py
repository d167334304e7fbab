"""Speculative decoding: a cheap drafter proposes k tokens, the target scores all k + 1 positions in one step.

Why it is lossless: the verification row (the last sampled token and the k drafts) goes through the engine's one
step (`LM.step`, logits "all") against the target's own cache; the longest prefix the target agrees with is kept,
plus one token of the target's own, and the cache is cut back to what it then holds (`KVCache.truncate`). At
temperature 0 "agrees" is "is the target's argmax", so the tokens are plain greedy decoding's (to the rounding of a
chunk's kernel against a decode step's: a near tie can flip); at temperature > 0 a draft is kept with probability
min(1, p/q) and a rejection resamples from the normalised residual max(0, p - q) (Leviathan et al. 2023), so every
token is distributed as the target's sampler would draw it. A deterministic drafter (ngram) has a one-hot q.

Drafters, one interface (`propose(context, k, sampler)` -> draft ids and their q, or None when one-hot;
`accepted(n)` after each verification):
  ngram[:N[:K]]          the latest earlier occurrence of the longest suffix (up to N tokens) proposes what followed
  self:sink:W[:K]        the same weights over their own StreamingLLM-window cache of W tokens
  self:quest:BUDGET[:K]  the same weights under Quest attention over their own paged cache
  draft:PATH[:K]         a second model file with the same vocabulary
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from attnlab.batch import Batch
from attnlab.errors import AttnlabError
from attnlab.sampling import top_token
from attnlab.stop import Stop

KINDS = ("ngram", "self", "draft")
SINK_SLACK = 32  # a self:sink draft cache evicts in blocks of this many tokens, so drafts fit between evictions


@dataclass(frozen=True)
class SpeculativeSpec:
    """A parsed --speculative SPEC: the drafter's kind, K drafts per step (adaptive: K is the most, each step's
    chosen by acceptance and measured costs, `AdaptiveK`), ngram's N, self's cheaper KV ('sink:W' or
    'quest:BUDGET'), draft's model file. K is written 4 (fixed), a8 (adaptive, at most 8) or left out (a8)."""
    kind: str
    k: int = 8
    n: int = 3
    cheap: str | None = None
    path: str | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, text: "str | SpeculativeSpec | None") -> "SpeculativeSpec | None":
        if text is None or isinstance(text, SpeculativeSpec):
            return text
        parts = str(text).strip().split(":")
        kind, rest = parts[0], parts[1:]
        usage = "use ngram[:N[:K]], self:sink:W[:K], self:quest:BUDGET[:K] or draft:PATH[:K] (K: 4 fixed, a8 adaptive)"
        if kind not in KINDS:
            raise AttnlabError(f"unknown speculative spec {text!r}; {usage}")
        try:
            if kind == "ngram":
                if len(rest) > 2:
                    raise ValueError
                return cls._checked("ngram", *_k(rest[1:]), n=int(rest[0]) if rest else 3)
            if kind == "self":
                if len(rest) not in (2, 3) or rest[0] not in ("sink", "quest"):
                    raise ValueError
                return cls._checked("self", *_k(rest[2:]), cheap=f"{rest[0]}:{int(rest[1])}")
            k = _k([])
            if len(rest) > 1 and (rest[-1].isdigit() or rest[-1][:1] == "a" and rest[-1][1:].isdigit()):
                k = _k([rest.pop()])
            if not rest or not rest[0]:
                raise ValueError
            return cls._checked("draft", *k, path=":".join(rest))
        except ValueError:
            raise AttnlabError(f"bad speculative spec {text!r}; {usage} (N, K, W, BUDGET integers)") from None

    @classmethod
    def _checked(cls, kind, k, adaptive, **fields) -> "SpeculativeSpec":
        spec = cls(kind, k, adaptive=adaptive, **fields)
        if spec.k < 1 or spec.n < 1 or (spec.cheap and int(spec.cheap.split(":")[1]) < 1):
            raise AttnlabError(f"speculative {kind}: K, N, W and BUDGET must be >= 1")
        return spec

    def __str__(self) -> str:
        k = f"a{self.k}" if self.adaptive else str(self.k)
        return {"ngram": f"ngram:{self.n}:{k}", "self": f"self:{self.cheap}:{k}", "draft": f"draft:{self.path}:{k}"}[
            self.kind]


def _k(rest: list[str]) -> tuple[int, bool]:
    """(K, adaptive) of a spec's K field: '4' fixed, 'a8' adaptive up to 8, none: a8."""
    if not rest:
        return 8, True
    text = rest[0]
    return (int(text[1:]), True) if text[:1] == "a" else (int(text), False)


@dataclass
class SpecStats:
    """What a speculative generation did: drafts proposed and kept, verification steps, tokens produced."""
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    tokens: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps, "tokens": self.tokens,
                "acceptance": round(self.acceptance, 4), "tokens_per_step": round(self.tokens_per_step, 4)}


# ---------------------------------------------------------------- drafters

class NgramDrafter:
    """Prompt/history lookup: the latest earlier occurrence of the context's last m tokens (m = N down to 1)
    proposes the tokens that followed it. An index of every m-gram's latest end, grown as the context grows."""

    def __init__(self, n: int):
        self.n, self.index, self.ctx = n, [dict() for _ in range(n + 1)], []

    def _grow(self, context: list[int]) -> None:
        if context[:len(self.ctx)] != self.ctx:  # another conversation: start over
            self.index, self.ctx = [dict() for _ in range(self.n + 1)], []
        start = len(self.ctx)
        self.ctx = list(context)
        for end in range(max(start - 1, 1), len(context)):  # an m-gram ending before `end` is followed by ctx[end]
            for m in range(1, min(self.n, end) + 1):
                self.index[m][tuple(context[end - m:end])] = end

    def propose(self, context: list[int], k: int, sampler) -> tuple[list[int], None]:
        self._grow(context)
        for m in range(min(self.n, len(context) - 1), 0, -1):
            end = self.index[m].get(tuple(context[-m:]))
            if end is not None:
                return context[end:end + k], None
        return [], None

    def accepted(self, n: int) -> None:
        pass


class ModelDrafter:
    """A model (the target's weights under a cheaper KV configuration, or another file) drafting over a cache of its
    own. Its cache holds the context's tokens it was fed; each proposal first cuts it back to the part the context
    still agrees with, so rejected drafts never linger. A bounded (sink) cache drafts only as far as it can without
    evicting, so the cut is always allowed."""

    def __init__(self, lm, policy_factory=lambda: None):
        self.lm, self.policy_factory = lm, policy_factory
        self.cache, self.fed = None, []

    def propose(self, context: list[int], k: int, sampler) -> tuple[list[int], torch.Tensor | None]:
        same = 0
        for a, b in zip(self.fed, context[:-1]):
            if a != b:
                break
            same += 1
        if self.cache is None or same < self.cache.kept_from:
            self.cache, self.fed, same = self.lm.new_cache(capacity=len(context) + 64, policy=self.policy_factory()), [], 0
        self.cache.truncate(same)
        logits = self.lm.prefill(torch.tensor([context[same:]]), self.cache)
        self.fed = list(context)
        drafts, qs = [], []
        for i in range(k):
            if sampler.temperature == 0:
                t = int(top_token(logits[0]))
            else:
                q = sampler.probs(logits[0])
                t = int(torch.multinomial(q, 1, generator=sampler.generator))
                qs.append(q)
            drafts.append(t)
            left = room(self.cache)
            if i == k - 1 or (left is not None and left < 1):
                break
            logits = self.lm.step(Batch.one([[t]], self.cache))[0][:, -1]
            self.fed.append(t)
        return drafts, torch.stack(qs) if qs else None

    def accepted(self, n: int) -> None:
        pass


def make_drafter(lm, spec: SpeculativeSpec):
    """The drafter of spec for target lm (a draft model file is loaded once per target and kept on it)."""
    if spec.kind == "ngram":
        return NgramDrafter(spec.n)
    if spec.kind == "self":
        name, size = spec.cheap.split(":")
        if name == "quest":
            return ModelDrafter(lm.with_attention(f"quest:{size}"))
        from attnlab.kv.policies import make_policy
        base = lm.with_attention(None)
        return ModelDrafter(base, lambda: make_policy("sink", int(size), block=SINK_SLACK))
    drafts = lm.__dict__.setdefault("_draft_models", {})
    if spec.path not in drafts:
        draft = type(lm).load(spec.path, lm.options.but(speculative=None, policy=None, attention=None, sparsity=None),
                        tokenizer=False)
        if draft.cfg.vocab_size != lm.cfg.vocab_size:
            raise AttnlabError(f"draft model {spec.path} has a vocabulary of {draft.cfg.vocab_size} tokens, the target "
                               f"{lm.cfg.vocab_size}: a draft must share the target's vocabulary")
        drafts[spec.path] = draft
    return ModelDrafter(drafts[spec.path])


# ---------------------------------------------------------------- how many drafts

class AdaptiveK:
    """Each step's K, 0 .. most, where the expected tokens per second of a step is highest: E(k) / cost(k), with
    E(k) = 1 + a + ... + a^k (a draft kept with probability a given the ones before it: drafts kept over drafts
    kept and first rejections, recent steps weighing more) and cost(k) = t0 + t1 k (the verification row of k + 1
    tokens: a line fitted to this generation's own steps, its slope held towards SLOPE t0 where they do not tell)
    + k d (the drafter's seconds per draft). Where fixed K loses (drafts mostly rejected, or a drafter as slow as
    the target) it falls back to plain steps (k = 0), drafting one token every PROBE steps to notice a change."""
    DECAY, SLOPE, PROBE = 0.9, 0.15, 8

    def __init__(self, most: int):
        self.most, self.kept, self.missed, self.d = most, 1.0, 1.0, 0.0
        self.fit = [0.0] * 5  # decayed sums of w, x, y, x^2, xy over (x = k, y = seconds)
        self.steps = 0

    def choose(self, limit: int) -> int:
        self.steps += 1
        top = min(self.most, limit)
        if top <= 0 or not self.fit[0]:
            return max(0, min(top, 4))
        a = self.kept / (self.kept + self.missed)
        t0, t1 = self._line()
        best = max(range(top + 1), key=lambda k: sum(a ** i for i in range(k + 1)) / (t0 + (t1 + self.d) * k))
        return 1 if best == 0 and self.steps % self.PROBE == 0 else best

    def update(self, drafted: int, kept: int, draft_s: float, k: int, verify_s: float) -> None:
        if drafted:
            self.kept = self.DECAY * self.kept + kept
            self.missed = self.DECAY * self.missed + (kept < drafted)
            self.d = draft_s / drafted if not self.d else self.DECAY * self.d + (1 - self.DECAY) * draft_s / drafted
        self.fit = [self.DECAY * f + g for f, g in zip(self.fit, (1.0, k, verify_s, k * k, k * verify_s))]

    def _line(self) -> tuple[float, float]:
        """(t0, t1) of seconds ~ t0 + t1 k by least squares, plus rho (t1 - SLOPE t0)^2 (rho = one step's weight)."""
        w, x, y, xx, xy = self.fit
        a, b, c = w + self.SLOPE ** 2, x - self.SLOPE, xx + 1.0  # the normal equations' matrix [[a, b], [b, c]]
        det = a * c - b * b
        t0, t1 = (c * y - b * xy) / det, (a * xy - b * y) / det
        return max(t0, 1e-6), max(t1, 0.0)


# ---------------------------------------------------------------- verification

def room(cache) -> int | None:
    """Tokens the cache takes before its policy evicts (None: it never does). A row that fits is cut back freely."""
    policy = cache.policy
    if policy is None or policy.capacity is None:
        return None
    layer = cache.layers[0]
    return policy.tokens + policy.block - 1 - (layer.n - layer.first)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's token comes from: max(0, p - q), normalised (p itself where nothing is left)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def accept(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None, generator) -> tuple[int, int]:
    """Speculative sampling over target probabilities p [k + 1, V] and draft probabilities q [k, V] (None: one-hot
    on the drafts) -> (drafts kept, the token after them), distributed exactly as sampling from p token by token."""
    for i, d in enumerate(drafts):
        qi = torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).to(p.dtype) if q is None else q[i]
        if float(torch.rand((), generator=generator)) * float(qi[d]) < float(p[i, d]):  # u < p/q
            continue
        return i, int(torch.multinomial(residual(p[i], qi), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def verify(logits: torch.Tensor, drafts: list[int], q, sampler) -> tuple[int, int]:
    """Target logits [k + 1, V] of a verification row -> (drafts kept, the target's next token)."""
    if sampler.temperature == 0:
        best = top_token(logits).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return n, best[n]
    return accept(sampler.probs(logits), drafts, q, sampler.generator)


def check_cache(cache) -> None:
    if cache.batch != 1:
        raise AttnlabError("speculative decoding takes one conversation (a cache of batch 1)")
    if cache.needs_probs:
        raise AttnlabError(f"speculative decoding cuts its cache back, which a policy scoring by attention "
                           f"({type(cache.policy).__name__}) refuses; use full or sink")


def decode(lm, cache, context: list[int], logits: torch.Tensor, sampler, max_new_tokens: int, stop_ids=(),
           spec: SpeculativeSpec | None = None, drafter=None, stats: SpecStats | None = None) -> Iterator[int]:
    """`LM.decode`'s contract for one conversation, speculatively: context = the ids the cache holds, logits [1, V]
    after them; yields token ids until the one stop check ends the reply; the last one yielded is not fed."""
    check_cache(cache)
    if cache.seen != len(context):
        raise AttnlabError(f"the cache holds {cache.seen} tokens, the context {len(context)}")
    drafter = drafter or make_drafter(lm, spec)
    stats = stats if stats is not None else SpecStats()
    spec = spec or SpeculativeSpec("ngram", 4, adaptive=False)
    adaptive = AdaptiveK(spec.k) if spec.adaptive else None
    stop, context, start = Stop(max_new_tokens, stop_ids), list(context), len(context)
    new = [int(sampler(logits)[0])] if max_new_tokens else []
    try:
        while new:
            for t in new:
                context.append(t)
                yield t
                stats.tokens += 1
                stop.push(t)
                if stop.reason:
                    return
            k = min(spec.k, stop.max_tokens - stop.count - 1)  # drafts past max_tokens are wasted
            left = room(cache)
            if left is not None:  # the row must not make the policy evict: it could not be cut back
                k = min(k, left - 1)
            k = adaptive.choose(k) if adaptive else k
            t0 = time.perf_counter()
            drafts, q = drafter.propose(context, k, sampler) if k > 0 else ([], None)
            drafts = drafts[:max(k, 0)]
            t1 = time.perf_counter()
            out = lm.step(Batch.one([[context[-1], *drafts]], cache, "all", verify=True))[0][0]
            t2 = time.perf_counter()
            n, nxt = verify(out, drafts, q[:len(drafts)] if q is not None else None, sampler)
            cache.truncate(len(context) + n)
            drafter.accepted(n)
            if adaptive:
                adaptive.update(len(drafts), n, t1 - t0, len(drafts), t2 - t1)
            stats.drafted, stats.accepted, stats.steps = stats.drafted + len(drafts), stats.accepted + n, stats.steps + 1
            new = [*drafts[:n], nxt]
    finally:  # ended, or closed by the caller: accepted drafts past the last token yielded are not fed, nor is it
        if len(context) > start and cache.seen > len(context) - 1:
            cache.truncate(len(context) - 1)
