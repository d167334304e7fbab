"""What a request may ask, checked against the server's limits before any work for it reaches the model.

Why its own module: the server's endpoints (`app.py`) call these at each stage (the raw request, the rendered
prompt, the conversation a cache must hold) and every refusal is a 4xx with OpenAI's body naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from attnlab.errors import AttnlabError
from attnlab.options import PolicySpec
from attnlab.sampling import Sampler
from attnlab.serve.config import ServeConfig, served_speculative
from attnlab.serve.protocol import APIError, CommonRequest, clip


@dataclass(frozen=True)
class Asked:
    """A checked request: its cache policy, sampler, reply length, stop strings, speculative spec (or None)."""
    spec: PolicySpec
    sampler: Sampler
    limit: int
    stops: list[str]
    speculative: object = None


class Checks:
    def __init__(self, lm, config: ServeConfig, store, text):
        self.lm, self.config, self.store, self.text = lm, config, store, text
        self.model_name, self.spec = config.model_name, config.spec
        self.max_tokens, self.max_tokens_cap = config.max_tokens, config.max_tokens_cap
        self.max_prompt_tokens = config.max_prompt_tokens

    def request(self, req: CommonRequest) -> Asked:
        """What a request asks for, checked; APIError if it is invalid."""
        if req.model != self.model_name:
            raise APIError(404, f"The model {clip(req.model)} does not exist; this server has {self.model_name!r}",
                           param="model", code="model_not_found")
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        spec, policy = self.policy(req)
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            sampler = Sampler(temperature, 0, req.top_p or 1.0, req.seed)
        except (AttnlabError, ValueError, OverflowError) as e:
            raise APIError(400, f"invalid sampling options: {e}", param="seed") from None
        if spec.name == "full":  # the clearer error first: no cap would let this fit a full cache
            self.length(spec, 0, 0, 0, req.limit(self.max_tokens))
        return Asked(spec, sampler, req.limit(self.max_tokens, self.max_tokens_cap), req.stops(),
                     self.speculative(req, policy))

    def speculative(self, req: CommonRequest, policy):
        """The request's attnlab.speculative (ngram[:N[:K]] or none), else the server's --speculative, which a
        request whose policy scores by attention (h2o ...: its cache cannot be cut back) decodes without."""
        text = req.attnlab.speculative if req.attnlab else None
        if text is None:
            return None if policy is not None and policy.needs_probs else self.config.speculative
        try:
            return served_speculative(text, "attnlab.speculative")
        except AttnlabError as e:
            raise APIError(400, str(e), param="attnlab.speculative", code="invalid_value") from None

    def policy(self, req: CommonRequest) -> tuple[PolicySpec, object]:
        """The request's cache policy (attnlab.policy, budget, n_sink, positions over the server's defaults): its spec
        and the policy it builds (None for full), built once here to check it."""
        o, d = req.attnlab, self.spec
        ctx = self.lm.cfg.context_length
        if o and o.budget is not None and not 1 <= o.budget <= ctx:
            raise APIError(400, f"attnlab.budget must be between 1 and the model's context, {ctx} tokens",
                           param="attnlab.budget", code="invalid_value")
        try:  # names, and n_sink below the budget (which is bounded above)
            s = PolicySpec(o.policy or d.name, o.budget or d.budget, d.n_sink if o.n_sink is None else o.n_sink,
                           o.positions or d.positions, d.block) if o else d
            policy = self.store.policy(s)
        except ValueError as e:
            raise APIError(400, str(e), param="attnlab") from None
        return s, policy

    def prompt(self, chars: int = 0, tokens: int = 0, param: str = "messages") -> None:
        """400 for a prompt over max_prompt_tokens; on raw text (chars) before tokenising, when it surely is."""
        if tokens > self.max_prompt_tokens or chars > self.max_prompt_tokens * self.text.max_token_chars:
            size = f"{tokens} tokens" if tokens else f"{chars} characters"
            raise APIError(400, f"the prompt has {size}; this server takes at most {self.max_prompt_tokens} tokens "
                                f"per request", param=param, code="context_length_exceeded")

    def length(self, s: PolicySpec, held_seen: int, prompt: int, new: int, limit: int) -> None:
        """400 for a prompt over max_prompt_tokens, or a conversation a full cache cannot hold."""
        self.prompt(tokens=prompt)
        ctx = self.lm.cfg.context_length
        if s.name == "full" and held_seen + new + limit > ctx:
            raise APIError(400, f"this conversation needs {held_seen + new + limit} tokens of cache (prompt + "
                                f"max_tokens) but policy 'full' holds at most {ctx}; use a bounded policy "
                                f"(attnlab.policy 'sink') to go on", param="messages", code="context_length_exceeded")
