"""The inference engine: a loaded network, its tokenizer, and the decoding loop.

Data flows one way: text -> token ids -> `LM` (network + KV cache + policy) ->
logits -> a `Sampler` (generation) or an evaluator (perplexity, analysis).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from attnlab.errors import AttnlabError
from attnlab.kv.cache import KVCache
from attnlab.model.llama import ModelConfig, Transformer
from attnlab.model.loaders import load_model
from attnlab.model.tokenizer import load_tokenizer
from attnlab.sampling import Sampler

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}
DEFAULT_MODEL = "smollm2-135m"


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise AttnlabError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


class LM:
    """A causal LM ready for inference. `model` is a plain `Transformer`; `tokenizer` a transformers tokenizer."""

    def __init__(self, model: Transformer, tokenizer=None, source: Path | None = None, tokenizer_error: str = "",
                 kv_dtype: torch.dtype | None = None):
        self.model, self.cfg, self.tokenizer, self.source = model, model.cfg, tokenizer, source
        self.tokenizer_error = tokenizer_error
        self.kv_dtype = kv_dtype  # KV-cache storage; None = the model's dtype

    @classmethod
    def load(cls, spec: str | Path = DEFAULT_MODEL, dtype: str = "float32", threads: int | None = None,
             tokenizer: bool = True, quant=None, compile: bool = False, rope: str | None = None,
             sparsity: str | None = None, kv_dtype: str | None = None) -> "LM":
        """quant: 'int8', 'int4:32', 'kmeans:4', ... (see attnlab.quant.QuantSpec); compile: compile the
        single-token decode step with torch.compile (tens of seconds on first use; eager otherwise);
        rope: a context-extension override, e.g. "yarn:4" or "linear:2" (see `attnlab.rope.parse_rope`);
        sparsity: Deja Vu contextual sparsity, 'PATH[:MLP[:HEADS]]' with predictors from
        `attnlab dejavu train`, 'threshold@PATH:0.5' or 'oracle:0.5' (see `attnlab.sparsity.plan.parse`);
        kv_dtype: 'float16' stores the KV cache in half the bytes (llama.cpp's default; decode attention
        reads it at that size), 'int8' in 1.125 bytes a number (a scale per 32, llama.cpp's q8_0 cache),
        default: the model's dtype."""
        if dtype not in DTYPES:
            raise AttnlabError(f"unknown dtype {dtype!r}; choose from float32, bfloat16")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise AttnlabError(f"unknown KV-cache dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
        if quant is not None:
            from attnlab.quant import QuantSpec
            quant = QuantSpec.parse(quant)  # a bad spec fails before the slow load
        if sparsity is not None:
            from attnlab.sparsity.plan import parse as parse_sparsity
            parse_sparsity(sparsity)  # a bad spec fails before the slow load
        set_threads(threads)
        model, _, path = load_model(spec, DTYPES[dtype], quant, rope=rope)
        if sparsity is not None:
            from attnlab.sparsity.plan import plan_from_spec
            plan_from_spec(sparsity, model)
        if DTYPES[dtype] == torch.float32:
            from attnlab.quant import kernels
            kernels.available()  # fused decode attention: built once per machine, before any forward or trace
        if compile:
            model.compile_decode()
        tok, why = None, "tokenizer not loaded"
        if tokenizer:
            try:
                tok = load_tokenizer(path)
                why = "" if tok is not None else "the folder has no tokenizer files"
            except Exception as e:  # e.g. a GGUF without tokenizer metadata: the weights still work
                why = f"transformers could not build its tokenizer ({type(e).__name__}: {e})"
        return cls(model, tok, path, why, KV_DTYPES[kv_dtype] if kv_dtype else None)

    @property
    def config(self) -> ModelConfig:
        return self.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def quant(self) -> str | None:
        return getattr(self.model, "quant", None)

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---------------------------------------------------------------- forward passes

    def new_cache(self, batch: int = 1, capacity: int = 256, policy=None, positions: str = "original",
                  max_capacity: int | None = None) -> KVCache:
        """An empty cache; unless a policy bounds it, it grows (amortised doubling) up to max_capacity."""
        if getattr(policy, "capacity", None):
            capacity = max_capacity = policy.capacity
            positions = getattr(policy, "positions", positions)
        cfg = self.cfg
        return KVCache(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, self.model.rope, self.kv_dtype or self.dtype,
                       capacity, positions, max_capacity, policy, window=cfg.sliding_window)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab]: one full causal forward from position 0, no cache."""
        return self.model(_as_ids(ids))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Append ids [B, T] to the cache and return their logits [B, T (or 1), vocab]."""
        return self.model(_as_ids(ids), cache=cache, last_only=last_only)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, cache: KVCache, chunk: int = 512, all_logits: bool = False,
                progress=None) -> torch.Tensor:
        """Feed ids [B, T] in chunks (bounded activation memory; a policy may evict between chunks).

        Returns the last position's logits [B, vocab], or all logits [B, T, vocab] if all_logits.
        """
        ids = _as_ids(ids)
        if chunk < 1:
            raise AttnlabError(f"chunk must be >= 1, got {chunk}")
        policy = cache.policy
        if policy is not None and getattr(policy, "capacity", None):
            chunk = min(chunk, policy.chunk)  # a bounded cache has room for only policy.chunk new tokens per step
        outs = []
        for start in range(0, ids.shape[1], chunk):
            part = ids[:, start:start + chunk]
            outs.append(self.model(part, cache=cache, last_only=not all_logits))
            if progress is not None:
                progress(part.shape[1])
        if not outs:
            raise AttnlabError("prefill needs at least one token")
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]

    # ---------------------------------------------------------------- text in, text out

    def encode(self, text: str) -> list[int]:
        self._need_tokenizer()
        return self.tokenizer.encode(text, add_special_tokens=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the checkpoint's chat template, ready for the reply."""
        return self.encode_rendered(self.render_chat(messages))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        self._need_tokenizer()
        if not getattr(self.tokenizer, "chat_template", None):
            raise AttnlabError(f"the tokenizer of {self.source} has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of template-rendered text: its special tokens are already written out."""
        self._need_tokenizer()
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise AttnlabError(f"no tokenizer for {self.source}: {self.tokenizer_error}; pass token ids instead of text")

    def stream(self, ids: list[int] | torch.Tensor, cache: KVCache, sampler: Sampler, max_new_tokens: int,
               chunk: int = 512, stop_at_eos: bool = True) -> Iterator[int]:
        """Yield sampled token ids one by one (batch 1) after prefilling ids into cache.

        The last sampled token is not fed to the cache, so a caller can continue a conversation
        by feeding it (e.g. the EOS that closes a chat turn) with the next prompt (see `Session`).
        """
        from attnlab.session import Session
        if max_new_tokens < 0:
            raise AttnlabError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        session = Session(self, cache, chunk)
        session.feed(_as_ids(ids))
        return session.generate(sampler, max_new_tokens, stop_at_eos)

    def generate(self, prompt: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
                 policy=None) -> str | list[str]:
        """Complete one prompt (returns str) or a batch (returns list[str], left-padded together)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise AttnlabError("no prompt given")
        enc = [self.chat_ids([{"role": "user", "content": p}]) if chat else self.encode(p) for p in prompts]
        if any(len(e) == 0 for e in enc):
            raise AttnlabError("empty prompt: give at least one token of text")
        out = self.generate_ids(enc, max_new_tokens, Sampler(temperature, top_k, top_p, seed), policy)
        texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in out]
        return texts[0] if isinstance(prompt, str) else texts

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler, policy=None) -> list[list[int]]:
        """Batched decoding of left-padded prompts; each row stops at its own EOS."""
        if max_new_tokens < 0:
            raise AttnlabError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        width = max(len(p) for p in prompts)
        pad_id = self.cfg.eos_token_ids[0] if self.cfg.eos_token_ids else 0
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
        cache = self.new_cache(len(prompts), capacity=width + max_new_tokens, policy=policy)
        cache.pad = torch.tensor([width - len(p) for p in prompts])
        out: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)
        logits = self.prefill(ids, cache)
        eos = torch.tensor(sorted(self.eos_ids)) if self.eos_ids else torch.tensor([], dtype=torch.long)
        for step in range(max_new_tokens):
            token = sampler(logits)
            for b in range(len(prompts)):
                if not done[b]:
                    out[b].append(int(token[b]))
            done |= torch.isin(token, eos)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = self.model(token[:, None], cache=cache)[:, -1]
        return out


def _as_ids(ids) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise AttnlabError(f"token ids must be [batch, tokens], got shape {tuple(ids.shape)}")
    return ids


def load(spec: str | Path = DEFAULT_MODEL, dtype: str = "float32", threads: int | None = None,
         quant=None, compile: bool = False, rope: str | None = None, sparsity: str | None = None,
         kv_dtype: str | None = None) -> LM:
    """Load a model: the embedded name 'smollm2-135m', a .gguf file, or a Hugging Face folder
    (or a quantized folder written by `attnlab quantize`). See `LM.load` for quant, compile,
    rope ("yarn:4", linear/ntk/dynamic/llama3:F, or "none" to remove the checkpoint's scaling)
    and sparsity (Deja Vu: "runs/dejavu:0.5", "threshold@runs/dejavu:0.3", "lowbit:0.5")."""
    return LM.load(spec, dtype=dtype, threads=threads, quant=quant, compile=compile, rope=rope, sparsity=sparsity,
                   kv_dtype=kv_dtype)
