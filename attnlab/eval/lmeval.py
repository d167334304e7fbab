"""An lm-evaluation-harness backend (`lm-eval`, EleutherAI) registered as `attnlab`.

Why: the KV-cache papers (H2O among them) report task suites through lm-eval; with this
backend any lm-eval task runs on our engine, under any KV policy, quantization, RoPE
scaling or Deja Vu sparsity, e.g. `--model-args policy=sink,budget=256`.

How each request type is scored:
* full cache (no policy): contexts + continuations go through `LM.logits` in right-padded
  batches (a causal model's logits at a position do not depend on later tokens, so
  padding at the end is exact); `loglikelihood_rolling` uses lm-eval's own disjoint
  windows of `max_length` tokens, which are `attnlab ppl`'s windows on [prefix] + tokens;
* with a policy: each request streams through a cache that the policy bounds, `chunk`
  tokens a step (1 = token by token), evicting between steps -- the protocol of
  `attnlab stream` (`attnlab.eval.streaming.stream_nll`); a document is never windowed,
  the policy is what bounds the context;
* `generate_until`: greedy (or sampled, if the task asks) decoding through `LM.stream`,
  cut at the first stop string.

`import attnlab.eval.lmeval` registers the model; then `lm_eval.simple_evaluate(model="attnlab",
model_args="policy=sink,budget=256", tasks=[...])` works as well as `attnlab lm-eval`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from attnlab.errors import AttnlabError
from attnlab.options import Options, PolicySpec
from attnlab.sampling import Sampler

TRUE = {"1", "true", "yes", "on"}


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in TRUE


def _opt(value):
    """lm-eval passes model args as strings; 'none' and '' mean unset."""
    return None if value is None or str(value).lower() in ("", "none") else value


@register_model("attnlab")
class AttnlabLM(TemplateLM):
    """Model args: model (embedded name, .gguf or HF folder), dtype, quant, compile, kv_dtype, rope,
    sparsity, threads; policy, budget (tokens or a fraction of each request), n_sink, block,
    positions, chunk; max_length (default: the trained context, at most 2048); batch_size."""

    def __init__(self, model: str = "smollm2-135m", pretrained: str | None = None, dtype: str = "float32",
                 quant=None, compile=None, kv_dtype=None, rope=None, sparsity=None, threads=1, policy="full",
                 budget="256", n_sink=4, block=1, positions="cache", chunk=64, max_length=None, batch_size=8,
                 lm=None, **_ignored):
        super().__init__()
        self.chunk = int(chunk)
        spec = None if str(policy) == "full" else PolicySpec(str(policy), str(budget), int(n_sink), str(positions),
                                                             int(block), max(self.chunk, 1))
        opts = Options(dtype=dtype, threads=int(threads), quant=_opt(quant), compile=None if _opt(compile) is None else _flag(compile), rope=_opt(rope),
                       sparsity=_opt(sparsity), kv_dtype=_opt(kv_dtype), policy=spec)
        if lm is None:
            from attnlab.engine import LM
            lm = LM.load(pretrained or model, opts)
        self.lm, self.tokenizer = lm, lm.tokenizer
        if self.tokenizer is None:
            raise AttnlabError(f"lm-eval needs text: {lm.source} has no tokenizer")
        self.spec = spec  # a fresh policy per request, a fractional budget resolved against its length
        self._max_length = int(max_length) if _opt(max_length) else min(lm.cfg.context_length, 2048)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8

    # ---------------------------------------------------------------- what TemplateLM asks for

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else self.lm.cfg.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.lm.source)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---------------------------------------------------------------- scoring

    def _policy_for(self, n: int):
        return self.spec.build(n) if self.spec is not None else None

    @torch.inference_mode()
    def _stream_scores(self, ids: list[int], n_scored: int) -> tuple[float, bool]:
        """Log-probability of the last n_scored tokens of ids (and whether each was the argmax), fed
        through a policy-bounded cache `chunk` tokens a step, as `stream_nll` does."""
        policy = self._policy_for(len(ids))
        x = torch.tensor(ids)
        cache = self.lm.new_cache(1, capacity=min(len(ids), 4096), policy=policy)
        total, greedy, first = 0.0, True, len(ids) - 1 - n_scored  # index of the first scoring input
        t = 0
        while t < len(ids) - 1:
            T = min(self.chunk, len(ids) - 1 - t)
            logits = self.lm.forward(x[None, t:t + T], cache)[0]
            lo = max(first - t, 0)
            if lo < T:
                logp = F.log_softmax(logits[lo:].float(), -1)
                target = x[t + 1 + lo:t + 1 + T]
                total += float(logp.gather(-1, target[:, None]).sum())
                greedy = greedy and bool((logp.argmax(-1) == target).all())
            t += T
        return total, greedy

    @torch.inference_mode()
    def _full_scores(self, batch: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """[(ids, n_scored)] -> scores from one right-padded `LM.logits` call (ids at most max_length + 1)."""
        width = max(len(ids) - 1 for ids, _ in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        for b, (ids, _) in enumerate(batch):
            x[b, :len(ids) - 1] = torch.tensor(ids[:-1])
        logits = self.lm.logits(x)
        out = []
        for b, (ids, n) in enumerate(batch):
            end = len(ids) - 1
            logp = F.log_softmax(logits[b, end - n:end].float(), -1)
            target = torch.tensor(ids[-n:])
            out.append((float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
        return out

    def _score(self, items: list[tuple[list[int], int]], what: str = "loglikelihood") -> list[tuple[float, bool]]:
        """Score [(ids, n_scored)], longest first in batches (full cache) or one by one (policy)."""
        from attnlab.io import progress
        with progress(sum(len(ids) for ids, _ in items), what) as bar:
            if self.spec is not None:
                scores = []
                for ids, n in items:
                    scores.append(self._stream_scores(ids, n))
                    bar.update(len(ids))
                return scores
            order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
            out: list = [None] * len(items)
            for s in range(0, len(order), self.batch_size):
                idx = order[s:s + self.batch_size]
                for i, r in zip(idx, self._full_scores([items[i] for i in idx])):
                    out[i] = r
                bar.update(sum(len(items[i][0]) for i in idx))
            return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        items = []
        for _, ctx, cont in requests:
            if not cont:
                raise AttnlabError("lm-eval asked for the likelihood of an empty continuation")
            ids = ctx + cont
            if self.spec is None:
                ids = ids[-(self.max_length + 1):]  # the full cache sees at most max_length tokens
            items.append((ids, len(cont)))
        results = self._score(items)
        for (key, _, _), r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in [r.args for r in requests]:
            tokens = self.tok_encode(string)
            if not tokens:
                out.append(0.0)
                continue
            if self.spec is not None:  # the policy bounds the context: stream the document whole
                total = self._stream_scores([self.prefix_token_id] + tokens, len(tokens))[0]
            else:
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    tokens, self.prefix_token_id, self.max_length, context_len=1)]
                total = sum(s for s, _ in self._score([(ctx + cont, len(cont)) for ctx, cont in windows], "rolling"))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    @torch.inference_mode()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.pop("max_gen_toks", 256))
            temperature = float(kw.pop("temperature", 0.0)) if _flag(kw.pop("do_sample", False)) else 0.0
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):] or [self.prefix_token_id]
            policy = self._policy_for(len(ids) + max_new)
            cache = self.lm.new_cache(1, capacity=min(len(ids) + max_new, 4096), policy=policy)
            sampler = Sampler(temperature, seed=int(kw.pop("seed", 0) or 0)) if temperature > 0 else Sampler()
            tokens, text = [], ""
            for token in self.lm.stream(ids, cache, sampler, max_new, chunk=max(self.chunk, 1) if policy else 512):
                tokens.append(token)
                text = self.tok_decode(tokens)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
