"""Our eviction policies and presses inside `transformers`: a Cache for `model.generate(...)`.

Why: kvpress's users run any Hugging Face causal LM through `transformers`; our policies (sink, h2o,
...) and presses existed only inside our engine. `PolicyCache(model, policy=...)` or
`PolicyCache(model, press=...)` is a transformers 5.x `Cache` whose layers store their slots in our
own `LayerKV` (positions, compaction, per-slot policy state), so the policy and press code is the
engine's, unchanged: only the transformers glue lives here.

How: each attention module gets a forward hook (installed once per model, as kvpress does) that,
after the layer's attention, hands the cache what it saw: the attention probabilities (returned by
`attn_implementation="eager"`; needed by h2o, sink_h2o, tova, snapkv policies and the h2o presses)
and, for a press, the layer's queries; then the cache counts the new tokens and evicts (a policy,
at every step, exactly when our engine's `KVCache.advance` would) or compresses once (a press, at
the first forward: the prompt). Keys keep their absolute rotation (our `original` positions), so
`generate` keeps counting positions from the prompt's length.

Keys arrive in transformers' half-split rotary layout; the scorers that read keys or queries get them
turned into adjacent pairs (dot products and norms are the same in either layout).
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from attnlab.errors import AttnlabError
from attnlab.kv.slots import LayerKV, Step
from attnlab.kv.press import Press, PressRecorder, compress_layer, observed
from attnlab.kv.policies import Policy
from attnlab.rope import Rope

_HOOKED = "_attnlab_hooks"


def _rope(config) -> Rope:
    """Our RoPE tables for a transformers config (what a press rotates its window queries with)."""
    from attnlab.model.metadata import _hf_scaling
    hf = config.to_dict()
    params = hf.get("rope_parameters") or {}
    base = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    raw = hf.get("rope_scaling") or params or None
    scaling = _hf_scaling(Path("config.json"), raw, hf.get("max_position_embeddings") or 2048)
    return Rope(head_dim, float(base), scaling)


def to_pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., D] in transformers' half-split rotary layout -> adjacent pairs (2i, 2i + 1), ours."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


class PolicyLayer(CacheLayerMixin):
    """One layer's slots: an attnlab `LayerKV` (original positions, grows by doubling)."""
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, rope: Rope):
        super().__init__()
        self.rope, self.kv, self.seen, self.pending = rope, None, 0, 0

    def lazy_initialization(self, key_states, value_states=None) -> None:
        B, H, _, D = key_states.shape
        self.kv = LayerKV(B, H, D, 64, key_states.dtype, self.rope, "original")
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kv, T = self.kv, key_states.shape[2]
        self.finish()
        if T > 1 and not kv.natural:
            raise AttnlabError("after an eviction this cache takes one token per forward (transformers' mask "
                               "would not match the kept slots)")
        kv._reserve(kv.n + T)
        pos = (self.seen + torch.arange(T))[None].expand(key_states.shape[0], T)
        K, V, _ = kv.update(key_states, value_states, Step(pos, pos, None, False, kv.n))
        self.seen, self.pending = self.seen + T, T
        self.keys, self.values = K, V
        return K, V

    def finish(self) -> None:
        """Count the tokens of the last update (the hook does it after attention; again here is a no-op)."""
        if self.pending:
            self.kv.n += self.pending
            self.pending = 0

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        T = query if isinstance(query, int) else query.shape[0]
        n = 0 if self.kv is None else self.kv.n + self.pending
        return n + T, 0

    def get_seq_length(self) -> int:
        return self.seen  # tokens seen: generate counts positions from it (keys keep their own)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv, self.seen, self.pending, self.is_initialized = None, 0, 0, False


class PolicyCache(Cache):
    """A transformers Cache run by an attnlab policy (evicts at every step) or press (compresses the
    first forward, the prompt, once). policy: a `Policy` with an integer budget and `original` positions."""

    def __init__(self, model, policy: Policy | None = None, press: Press | None = None):
        if policy is not None and press is not None:
            raise AttnlabError("give a policy or a press, not both")
        if policy is not None:
            if policy.positions != "original":
                raise AttnlabError("inside transformers a policy keeps original positions (positions='original')")
            policy.tokens  # a fractional budget must be resolved first
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.policy, self.press, self.n_layers = policy, press, config.num_hidden_layers
        rope = _rope(config)
        super().__init__(layers=[PolicyLayer(rope) for _ in range(self.n_layers)])
        self.recorder = PressRecorder(press, [None] * self.n_layers) if press is not None else None
        self.pressed = False
        install(model)

    @property
    def needs_probs(self) -> bool:
        p = self.press if self.press is not None else self.policy
        return bool(p is not None and p.needs_probs)

    def after_attention(self, module, hidden: torch.Tensor, probs: torch.Tensor | None) -> None:
        """Called by the hook after layer module.layer_idx's attention: observe, count, evict or press."""
        i = module.layer_idx
        layer = self.layers[i]
        kv = layer.kv
        if kv is None:
            return
        if self.needs_probs and probs is None:
            raise AttnlabError("this policy scores by attention: load the model with attn_implementation='eager'")
        press_now = self.press is not None and not self.pressed and kv.natural
        if press_now:
            self.recorder.layers[i] = kv
            B, T, _ = hidden.shape
            q = module.q_proj(hidden).view(B, T, -1, kv.k.shape[-1]).transpose(1, 2)
            self.recorder.record(i, "q", to_pairs(q))
            if probs is not None:
                self.recorder.record(i, "probs", probs)
        elif self.policy is not None and self.policy.needs_probs:
            self.policy.observe(kv, probs)
        layer.finish()
        if press_now:
            if self.press.ratio > 0:
                compress_layer(self.press, kv, observed(self.press, kv, self.recorder, i, hf_layout=True))
            if i == self.n_layers - 1:
                self.pressed = True
        elif self.policy is not None and self.policy.due(kv):
            kv.keep(self.policy.to_keep(kv))
        layer.keys, layer.values = kv.k[:, :, :kv.n], kv.v[:, :, :kv.n]


def _hook(module, args, kwargs, output):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PolicyCache):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cache.after_attention(module, hidden, output[1] if isinstance(output, tuple) and len(output) > 1 else None)


def install(model) -> None:
    """Hook every attention module of model (once): what lets a PolicyCache see each layer's attention."""
    if getattr(model, _HOOKED, None):
        return
    hooks = [m.register_forward_hook(_hook, with_kwargs=True) for m in model.modules()
             if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if not hooks:
        raise AttnlabError(f"no attention modules with q_proj found in {type(model).__name__}")
    setattr(model, _HOOKED, hooks)
