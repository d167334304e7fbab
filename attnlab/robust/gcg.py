"""Greedy coordinate gradient (GCG, Zou et al. 2023): a suffix of L tokens that makes the reply begin with a target.

Each step: the gradient of the target's cross-entropy with respect to the one-hot suffix, taken through the
embedding on the eager float network (`grad_model`, float32 weights: the only path with a backward); per
position the top-k tokens by negative gradient; B candidates, each the current suffix with one position swapped
to one of its top-k at random; all B scored in one batched pass on the fast engine (`engine`, the packed weights
and C++ kernels: the prompt's prefix prefilled once into a batch cache, each chunk of candidates fed after it and
the cache truncated back); the best candidate becomes the suffix. Candidates whose text does not tokenise back to
the same ids are dropped (a suffix is sent as text).

The "subtler" variants of the talk restrict the candidate tokens: `punct` to whitespace and punctuation,
`fluent` at each position to the model's own top `fluent_top` next tokens there (low perplexity by construction).

Resumable: the whole state (suffix, losses, the generator's state) is written atomically after every step, and a
rerun with the same settings continues from it and ends where an uninterrupted run would.
"""
from __future__ import annotations

import base64
import json
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.io import write_json
from attnlab.model.llama import Pass
from attnlab.robust.scoring import FloatScorer, run_layers, shared
from attnlab.sampling import Sampler

TOKEN_SETS = ("all", "punct", "fluent")


@dataclass(frozen=True)
class GCGConfig:
    """length L: suffix tokens; batch B: candidates a step; topk: tokens kept per position; tokens: the
    candidate set (all printable ASCII tokens, punct, fluent); chunk: candidate rows per engine pass."""
    length: int = 20
    steps: int = 50
    batch: int = 128
    topk: int = 64
    tokens: str = "all"
    fluent_top: int = 100
    seed: int = 0
    chunk: int = 32
    check: bool = True  # greedy-decode after every step (success by step); False: only at the end

    def __post_init__(self):
        for name in ("length", "steps", "batch", "topk", "fluent_top", "chunk"):
            if getattr(self, name) < 1:
                raise AttnlabError(f"GCG {name} must be >= 1, got {getattr(self, name)}")
        if self.tokens not in TOKEN_SETS:
            raise AttnlabError(f"GCG tokens must be one of {', '.join(TOKEN_SETS)}, got {self.tokens!r}")


@dataclass
class Case:
    """A prompt's token layout: before + suffix + after is the chat-rendered user turn (the suffix at the end of the
    user's message), target the reply's first tokens."""
    before: list[int]
    after: list[int]
    target: list[int]
    target_text: str
    prompt_start: int = 0  # where the user's prompt begins in before (the template's tokens precede it)


def make_case(lm, prompt: str, target: str) -> Case:
    mark, start = "\x00SUFFIX\x00", "\x00PROMPT\x00"
    text = lm.render_chat([{"role": "user", "content": start + prompt + mark}])
    lead, rest = text.split(start)
    head, tail = rest.split(mark)
    return Case(lm.encode_rendered(lead + head), lm.encode_rendered(tail), lm.encode_rendered(target), target,
                len(lm.encode_rendered(lead)))


def initial_suffix(tokenizer, length: int) -> list[int]:
    """Zou et al.'s start: "! ! ! ...", L tokens."""
    ids = tokenizer.encode(" !" * length, add_special_tokens=False)
    if len(ids) != length:
        raise AttnlabError(f"this tokenizer does not write ' !' as one token; cannot start a {length}-token suffix")
    return ids


def allowed_tokens(tokenizer, vocab: int, which: str) -> torch.Tensor:
    """[vocab] bool: tokens a candidate may use: printable ASCII, not special (`punct`: whitespace/punctuation only)."""
    special = set(tokenizer.all_special_ids)
    keep = torch.zeros(vocab, dtype=torch.bool)
    marks = set(string.punctuation + " \n\t")
    for t in range(min(vocab, len(tokenizer))):
        s = tokenizer.decode([t])
        if t in special or not s or not s.isascii() or not (s.isprintable() or s.isspace()):
            continue
        keep[t] = set(s) <= marks if which == "punct" else True
    return keep


def hidden_states(model, x: torch.Tensor) -> torch.Tensor:
    """The blocks from input embeddings x [B, T, dim] (not ids) -> the last block's output [B, T, dim]: what takes a
    gradient with respect to a one-hot token choice. Eager and differentiable (the C++ ops step aside under autograd)."""
    ctx = Pass.full(model.rope, torch.zeros(x.shape[:2], dtype=torch.long))
    for i, layer in enumerate(model.layers):
        x = layer(x, ctx, i)
    return x


def _head(model, h: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.norm(h)).float()


def forward_embeds(model, x: torch.Tensor) -> torch.Tensor:
    """hidden_states, then the norm and head at every position -> logits [B, T, vocab] float32."""
    return _head(model, hidden_states(model, x))


def gradient_prefix(model, case: Case) -> tuple[list, torch.Tensor]:
    """The prompt's prefix through `model` once per attack (keys/values, last block's output): the gradient pass then
    runs only the suffix and what follows it, as nanogcg's prefix cache does."""
    with torch.no_grad():
        return shared(model, case.before, 0)


def token_gradient(model, case: Case, suffix: torch.Tensor, prefix=None) -> tuple[torch.Tensor, float, torch.Tensor]:
    """The target loss's gradient w.r.t. the one-hot suffix [L, vocab], the loss, and the model's next-token
    logits at each suffix position [L, vocab] (what the fluent variant ranks by). prefix: `gradient_prefix`'s
    (None: the whole prompt is run)."""
    W = model.embed.weight
    onehot = F.one_hot(suffix, W.shape[0]).to(W.dtype).requires_grad_(True)
    n, L, nt = len(case.before), len(suffix), len(case.target)
    with torch.enable_grad():
        rest = torch.tensor(case.after + case.target)
        if prefix is None:
            h = hidden_states(model, torch.cat([W[torch.tensor(case.before)], onehot @ W, W[rest]])[None])[0]
            before = h[n - 1:n]
        else:
            h = run_layers(model, torch.cat([onehot @ W, W[rest]])[None], n, prefix[0])[0]
            before = prefix[1][-1:]
        loss = F.cross_entropy(_head(model, h[-nt - 1:-1]), torch.tensor(case.target))  # the head: read rows only
        loss.backward()
    with torch.no_grad():
        nxt = _head(model, torch.cat([before, h[-nt - len(case.after) - L:-nt - len(case.after) - 1]]).detach())
    return onehot.grad.detach(), loss.item(), nxt


class Scorer:
    """Target losses of many candidate suffixes on the fast engine: the prefix prefilled once per batch size into
    a batch cache, each chunk of candidates fed after it, the cache truncated back to the prefix."""

    def __init__(self, engine, case: Case, chunk: int):
        self.engine, self.case, self.chunk = engine, case, chunk
        self.caches: dict[tuple[int, int], object] = {}  # by (rows, suffix length)

    def set_current(self, suffix: torch.Tensor) -> None:
        """(`scoring.FloatScorer` shares the current suffix's keys; the engine's batch cache does not.)"""

    def _cache(self, rows: int, length: int):
        if (rows, length) not in self.caches:
            c = self.case
            cache = self.engine.new_cache(rows, capacity=len(c.before) + length + len(c.after) + len(c.target))
            self.engine.prefill(torch.tensor([self.case.before] * rows), cache)
            self.caches[rows, length] = cache
        return self.caches[rows, length]

    @torch.inference_mode()
    def losses(self, suffixes: torch.Tensor) -> torch.Tensor:
        """suffixes [B, L] -> the target's mean cross-entropy per candidate [B]."""
        c = self.case
        tail = torch.tensor(c.after + c.target)
        target = torch.tensor(c.target)
        out = []
        for part in suffixes.split(self.chunk):
            cache = self._cache(*part.shape)
            ids = torch.cat([part, tail.expand(part.shape[0], -1)], 1)
            logits = self.engine.forward(ids, cache)[:, -len(target) - 1:-1]
            cache.truncate(len(c.before))
            out.append(F.cross_entropy(logits.transpose(1, 2), target.expand(part.shape[0], -1),
                                       reduction="none").mean(1))
        return torch.cat(out)


def greedy_reply(engine, case: Case, suffix, extra: int = 2) -> str:
    """The fast engine's greedy reply to the prompt with this suffix, as long as the target plus `extra` tokens."""
    ids = case.before + list(map(int, suffix)) + case.after
    out = engine.generate_ids([ids], len(case.target) + extra, Sampler(0.0))[0]
    return engine.tokenizer.decode(out, skip_special_tokens=True)


def succeeded(reply: str, target: str) -> bool:
    return reply.strip().startswith(target.strip())


def _state_blob(g: torch.Generator) -> str:
    return base64.b64encode(g.get_state().numpy().tobytes()).decode()


def _load_blob(g: torch.Generator, blob: str) -> None:
    g.set_state(torch.frombuffer(bytearray(base64.b64decode(blob)), dtype=torch.uint8))


class GCG:
    """One attack on one case; `run` steps it to cfg.steps, writing `state_path` after every step."""

    def __init__(self, engine, grad_model, case: Case, cfg: GCGConfig, allowed: torch.Tensor, init: list[int],
                 ident: dict | None = None, scorer_model=None):
        """engine: the greedy success check (and the candidates' scoring unless scorer_model, an eager float network
        of the same file, e.g. bfloat16: AMX tiles score a [B, T] batch faster than packed weights, which expand to
        float32; see `scoring.FloatScorer`)."""
        if len(init) != cfg.length:
            raise AttnlabError(f"the initial suffix has {len(init)} tokens, the attack asks for {cfg.length}")
        self.engine, self.grad_model, self.case, self.cfg, self.allowed = engine, grad_model, case, cfg, allowed
        self.scorer = Scorer(engine, case, cfg.chunk) if scorer_model is None else \
            FloatScorer(scorer_model, case, cfg.chunk)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.grad_prefix = gradient_prefix(grad_model, case)
        settings = {k: v for k, v in asdict(cfg).items() if k not in ("steps", "check")}  # a rerun may ask more
        self.ident = {"config": settings, "before": case.before, "after": case.after, "target": case.target,
                      "init": init, **(ident or {})}
        self.suffix = torch.tensor(init)
        self.tokenizer = engine.tokenizer
        self.history: list[dict] = []  # per step: loss, success, seconds, suffix
        self.best = (float(self.scorer.losses(self.suffix[None])[0]), init)
        self.initial_loss = self.best[0]

    # ---------------------------------------------------------------- one step

    def candidates(self, grad: torch.Tensor, next_logits: torch.Tensor) -> torch.Tensor:
        """B candidate suffixes [B', L] (B' <= B after the retokenisation filter): single-token swaps among each
        position's top-k tokens by -gradient."""
        cfg, L = self.cfg, self.cfg.length
        score = -grad.clone()
        score[:, ~self.allowed] = float("-inf")
        if cfg.tokens == "fluent":  # only the model's own likeliest next tokens at each position
            fluent = next_logits.masked_fill(~self.allowed, float("-inf")).topk(cfg.fluent_top, dim=1).indices
            keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, fluent, True)
            score[~keep] = float("-inf")
        top = score.topk(cfg.topk, dim=1)
        pos = torch.randint(L, (cfg.batch,), generator=self.gen)
        pick = torch.randint(cfg.topk, (cfg.batch,), generator=self.gen)
        tok = top.indices[pos, pick]
        ok = torch.isfinite(top.values[pos, pick])
        cands = self.suffix.repeat(cfg.batch, 1)
        cands[torch.arange(cfg.batch), pos] = tok
        cands = cands[ok]
        return cands[[self.retokenises(c) for c in cands]] if len(cands) else cands

    def retokenises(self, ids: torch.Tensor) -> bool:
        text = self.tokenizer.decode(ids.tolist())
        return self.tokenizer.encode(text, add_special_tokens=False) == ids.tolist()

    def step(self) -> dict:
        start, cpu = time.perf_counter(), time.process_time()
        grad, _, next_logits = token_gradient(self.grad_model, self.case, self.suffix, self.grad_prefix)
        grad = grad / grad.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cands = self.candidates(grad, next_logits)
        if not len(cands):
            raise AttnlabError("no candidate suffix survived the token filters; raise topk or batch")
        self.scorer.set_current(self.suffix)
        losses = self.scorer.losses(cands)
        i = int(losses.argmin())
        self.suffix = cands[i].clone()
        loss = float(losses[i])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # CPU: steadier on a loaded machine
        if loss < self.best[0]:
            self.best = (loss, self.suffix.tolist())
        ok = succeeded(greedy_reply(self.engine, self.case, self.suffix), self.case.target_text) if self.cfg.check \
            else None
        row = {"step": len(self.history) + 1, "loss": loss, "success": ok,
               "seconds": seconds, "cpu_seconds": cpu, "candidates": len(cands), "suffix": self.suffix.tolist()}
        self.history.append(row)
        return row

    # ---------------------------------------------------------------- resumable run

    def state(self) -> dict:
        return {"ident": self.ident, "history": self.history, "suffix": self.suffix.tolist(), "best": list(self.best),
                "initial_loss": self.initial_loss, "generator": _state_blob(self.gen)}

    def restore(self, state: dict) -> None:
        if json.loads(json.dumps(self.ident)) != state.get("ident"):
            raise AttnlabError("the saved attack state was made with other settings, prompt or model; "
                               "use another --out or delete it")
        self.history, self.suffix = state["history"], torch.tensor(state["suffix"])
        self.best, self.initial_loss = (state["best"][0], state["best"][1]), state["initial_loss"]
        _load_blob(self.gen, state["generator"])

    def run(self, state_path: str | Path | None = None, bar=None) -> dict:
        """Step until cfg.steps are done (continuing a saved state), then the result: the best suffix, its text,
        the loss curve and whether the greedy reply now begins with the target."""
        path = Path(state_path) if state_path else None
        if path is not None and path.exists():
            self.restore(json.loads(path.read_text()))
            if bar is not None:
                bar.update(len(self.history))
        while len(self.history) < self.cfg.steps:
            row = self.step()
            if path is not None:
                write_json(path, self.state())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", ok=row["success"])
        return self.result()

    def result(self) -> dict:
        best = self.best[1]
        reply = greedy_reply(self.engine, self.case, best, extra=8)
        steps = [r["step"] for r in self.history if r["success"]]
        return {"suffix_ids": best, "suffix": self.tokenizer.decode(best), "loss": self.best[0],
                "initial_loss": self.initial_loss, "losses": [r["loss"] for r in self.history],
                "success_by_step": [r["success"] for r in self.history], "first_success": steps[0] if steps else None,
                "reply": reply, "success": succeeded(reply, self.case.target_text),
                "seconds_per_step": sum(r["seconds"] for r in self.history) / max(1, len(self.history))}
