"""How to run a model: one object, parsed and checked once, shared by the CLI, the server and `attnlab.load`.

Why: the same choices (weight format, compile, RoPE override, Deja Vu sparsity, KV-cache dtype,
eviction policy, Quest attention) reach the engine from three front ends; each used to parse and check them itself,
some more than once. A bad value fails here, before the slow model load, with a one-line error.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from attnlab.errors import AttnlabError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


@dataclass(frozen=True)
class PolicySpec:
    """A KV-cache policy by name and parameters (`attnlab.kv.policies`); `build` makes a fresh one per cache.

    budget: tokens ("1024", 1024) or a fraction of the stream ("0.2", "20%"), resolved by `build(length)`."""
    name: str = "full"
    budget: int | float | str = 1024
    n_sink: int = 4
    positions: str = "cache"
    block: int = 1
    chunk: int = 512

    def __post_init__(self):
        self._make()  # every check of the policy itself, now

    @classmethod
    def parse(cls, text: "str | PolicySpec | None") -> "PolicySpec | None":
        """'sink:1024', 'h2o:0.2', 'snapkv:window_size=32:1024', 'full' or None (= full) -> a spec (the name part is
        `make_policy`'s: a name and the method's fields)."""
        if text is None or isinstance(text, PolicySpec):
            return text
        parts = str(text).strip().split(":")
        budget = parts.pop() if len(parts) > 1 and "=" not in parts[-1] else None
        return cls(":".join(parts), budget or 1024)

    @property
    def fractional(self) -> bool:
        from attnlab.kv.policies import parse_budget
        return isinstance(parse_budget(self.budget), float)

    def _make(self, length: int | None = None):
        from attnlab.kv.policies import make_policy
        if self.name == "full":
            return None
        return make_policy(self.name, self.budget, positions=self.positions, n_sink=self.n_sink, chunk=self.chunk,
                           block=self.block, length=length)

    def build(self, length: int | None = None):
        """A new Policy (None for full); a fractional budget is resolved against the stream's `length` tokens."""
        if self.fractional and self.name != "full" and not length:
            raise AttnlabError(f"policy {self.name} needs a budget in tokens here (e.g. 1024), not {self.budget}")
        return self._make(length)

    def describe(self) -> dict:
        return {"policy": self.name, "budget": None if self.name == "full" else self.budget, "n_sink": self.n_sink,
                "positions": self.positions, "block": self.block}


@dataclass(frozen=True)
class Options:
    """dtype: None (the file's format: a quantized GGUF stays packed, float32 activations), float32 or
    bfloat16 (every weight expanded to it). threads: torch threads (None: leave torch's). quant: 'int8', 'int4:32',
    'kmeans:4', ... (`attnlab.quant.QuantSpec`). compile: the native single-token decode step (None, the default:
    wherever it applies, one warning saying why where it cannot; False: the eager network, the reference).
    rope: a context-extension override ('yarn:4', 'linear:2', 'none'; `attnlab.rope.parse_rope`).
    sparsity: Deja Vu, 'PATH[:MLP[:HEADS]]', 'threshold@PATH:0.5', 'oracle:0.5', 'lowbit:0.5'
    or TEAL 'teal:0.3' (`attnlab.sparsity.plan.parse`). kv_dtype: KV-cache storage float32 | float16 | int8
    (default: float16 under float32 activations, half the memory and bytes read per token; else dtype).
    policy: the default KV-cache policy of generation and serving ('sink:1024' or a PolicySpec; None = full).
    attention: query-aware sparse decode attention, 'quest:BUDGET[:PAGE[:DENSE[:CHANNELS]]]' (`attnlab.kv.pages.QuestSpec`; None = full).
    speculative: decode speculatively, 'ngram[:N[:K]]', 'self:sink:W[:K]', 'self:quest:BUDGET[:K]', 'draft:PATH[:K]'
    (`attnlab.speculative.SpeculativeSpec`; None = plain decoding)."""
    dtype: str | None = None
    threads: int | None = None
    quant: object = None
    compile: bool | None = None
    rope: str | None = None
    sparsity: object = None  # a --sparsity string, parsed once into a SparsitySpec
    kv_dtype: str | None = None
    policy: PolicySpec | None = field(default=None)
    attention: object = None  # a --attention string, parsed once into a QuestSpec
    speculative: object = None  # a --speculative string, parsed once into a SpeculativeSpec

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in DTYPES:
            raise AttnlabError(f"unknown dtype {self.dtype!r}; choose from float32, bfloat16")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise AttnlabError(f"unknown KV-cache dtype {self.kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
        if self.compile not in (None, True, False):
            raise AttnlabError(f"compile must be True, False or None (wherever it applies), got {self.compile!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise AttnlabError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.quant is not None:
            from attnlab.quant import QuantSpec
            object.__setattr__(self, "quant", QuantSpec.parse(self.quant))
        if self.sparsity is not None:
            from attnlab.sparsity.plan import parse
            object.__setattr__(self, "sparsity", parse(self.sparsity))
        if self.rope is not None:
            from attnlab.rope import parse_rope
            parse_rope(self.rope, 2048)
        object.__setattr__(self, "policy", PolicySpec.parse(self.policy))
        from attnlab.kv.pages import QuestSpec
        object.__setattr__(self, "attention", QuestSpec.parse(self.attention))
        from attnlab.speculative import SpeculativeSpec
        object.__setattr__(self, "speculative", SpeculativeSpec.parse(self.speculative))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' dtype (float32 unless bfloat16 is asked for)."""
        return DTYPES[self.dtype or "float32"]

    @property
    def weights_dtype(self) -> torch.dtype | None:
        """What the loader expands weights to: None keeps the file's own format."""
        return DTYPES[self.dtype] if self.dtype else None

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The KV cache's storage: kv_dtype, else float16 under float32 activations, else the activations' dtype."""
        if self.kv_dtype:
            return KV_DTYPES[self.kv_dtype]
        return torch.float16 if self.torch_dtype == torch.float32 else self.torch_dtype

    def new_policy(self, length: int | None = None):
        """A fresh cache policy of `policy` (None = full); a fractional budget needs the stream's `length`."""
        return self.policy.build(length) if self.policy is not None else None

    def but(self, **changes) -> "Options":
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)

    @classmethod
    def from_args(cls, args) -> "Options":
        """The CLI's model options (`attnlab.cli.common.add_model_args` and friends)."""
        policy = None
        if getattr(args, "policy", "full") not in ("full", None) and "," not in args.policy:
            policy = PolicySpec(args.policy, args.budget, args.n_sink, args.positions, args.block)
        return cls(dtype=args.dtype, threads=args.threads, quant=getattr(args, "quant", None),
                   compile=getattr(args, "compile", None), rope=args.rope, sparsity=getattr(args, "sparsity", None),
                   kv_dtype=getattr(args, "kv_dtype", None), policy=policy, attention=getattr(args, "attention", None),
                   speculative=getattr(args, "speculative", None))
