"""The inference engine: a loaded network, its tokenizer, its options, and the decoding loop.

Data flows one way: text -> token ids -> `LM` (network + KV cache/policy + options) -> logits ->
a `Sampler` (generation) or an evaluator (perplexity, analysis). The network (`Transformer`) is
pure tensor work; the engine's one step (`LM.step`, a `Batch` of rows in, each row's logits out) owns what
happens around it: the cache's bookkeeping before and after, and the choice of the native or the eager path.
Prefill (`prefill`: chunks), one conversation's decoding (`decode`, `stream`, `generate`), the server's batched
steps and a row of draft tokens all go through it.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from attnlab.batch import Batch, Row, as_ids
from attnlab.errors import AttnlabError
from attnlab.kv.cache import KVCache
from attnlab.model.llama import ModelConfig, Pass, Transformer
from attnlab.model.loaders import load_model
from attnlab.model.tokenizer import load_tokenizer
from attnlab.options import Options
from attnlab.sampling import Sampler
from attnlab.stop import Stop

DEFAULT_MODEL = "smollm2-135m"


class LM:
    """A causal LM ready for inference. `model` is a plain `Transformer`; `tokenizer` a transformers tokenizer.

    sparsity: the Deja Vu plan every pass runs with (None = dense); `with_sparsity` gives a view of the
    same weights under another plan. compiled: the native single-token step (`compile_decode`), if asked for.
    threads: the native step's team of threads, set once (options.threads, else torch's count when built); torch's
    own count (the eager path's ops) is the command line's to set (`attnlab.cli`), never the engine's."""

    def __init__(self, model: Transformer, tokenizer=None, source: Path | None = None, tokenizer_error: str = "",
                 kv_dtype: torch.dtype | None = None, options: Options | None = None, sparsity=None):
        self.model, self.cfg, self.tokenizer, self.source = model, model.cfg, tokenizer, source
        self.tokenizer_error = tokenizer_error
        self.kv_dtype = kv_dtype  # KV-cache storage; None = the model's dtype
        self.options = options or Options()
        self.sparsity = sparsity
        self.threads = self.options.threads or torch.get_num_threads()  # the native step's team, fixed at load
        self.compiled = None

    @classmethod
    def load(cls, spec: str | Path = DEFAULT_MODEL, options: Options | None = None, tokenizer: bool = True,
             **fields) -> "LM":
        """Load a model under `options` (or the same fields as keywords: dtype, threads, quant, compile, rope,
        sparsity, kv_dtype, policy, attention; see `attnlab.options.Options`). Bad options fail before the slow load."""
        opts = Options(**fields) if options is None else options.but(**fields) if fields else options
        model, _, path = load_model(spec, opts.weights_dtype, opts.quant, rope=opts.rope)
        from attnlab.kernels import ops
        ops.load()  # the C++ kernels the install built, loaded before any forward or trace
        tok, why = None, "tokenizer not loaded"
        if tokenizer:
            try:
                tok = load_tokenizer(path)
                why = "" if tok is not None else "the folder has no tokenizer files"
            except Exception as e:  # e.g. a GGUF without tokenizer metadata: the weights still work
                why = f"transformers could not build its tokenizer ({type(e).__name__}: {e})"
        plan = None
        if opts.sparsity is not None:  # a TEAL spec reads its calibration: a load never calibrates
            from attnlab.sparsity.plan import plan_from_spec
            plan = plan_from_spec(opts.sparsity, model)
        lm = cls(model, tok, path, why, opts.torch_kv_dtype, opts, plan)
        lm._check_attention()
        if opts.compile is not False:  # the default wherever it applies
            lm.compile_decode()
        return lm

    def compile_decode(self) -> None:
        """Run single-token decode steps as one native call (`attnlab.model.native`; eager stays the
        reference and the fallback). Takes milliseconds: the step is C++ in the kernels' per-machine build.
        Build it again after swapping a module of the network. Where the network is one the native step
        cannot run (bfloat16, unfused quantized layers, no C++ kernels) it warns once and decodes eagerly."""
        from attnlab.model.native import NativeStep
        try:
            self.compiled = NativeStep(self.model, self.threads, self.sparsity if self._native_plan() else None)
        except ValueError as e:
            self.compiled = None
            warnings.warn(f"attnlab: the native decode step cannot run {e}; decoding eagerly (--eager / compile=False "
                          "asks for that without this warning)")

    def with_threads(self, threads: int) -> "LM":
        """The same weights under a native step built for another team of threads (milliseconds; a benchmark's
        thread sweep). torch's own count stays the caller's to set."""
        if threads < 1:
            raise AttnlabError(f"threads must be >= 1, got {threads}")
        view = copy.copy(self)
        view.threads = threads
        if self.compiled is not None:
            view.compile_decode()
        return view

    def with_attention(self, attention) -> "LM":
        """The same weights, native step and tokenizer under another decode attention (a QuestSpec, its text
        "quest:..." or None: full); caches made by either serve both (prefill is exact under Quest)."""
        view = copy.copy(self)
        view.options = self.options.but(attention=attention)
        view._check_attention()
        return view

    def _check_attention(self) -> None:
        quest = self.options.attention
        if quest is not None and quest.channels > self.cfg.head_dim:
            raise AttnlabError(f"quest channels {quest.channels} > the model's head size {self.cfg.head_dim}")

    def with_sparsity(self, plan) -> "LM":
        """The same weights, cache settings and tokenizer under another sparsity plan (None = dense)."""
        view = copy.copy(self)
        view.sparsity = plan
        if self.compiled is not None and (self._native_plan() or view._native_plan()):
            view.compile_decode()  # the native step runs the plan's projections (TEAL)
        return view

    def _native_plan(self) -> bool:
        """Whether the native step runs this engine's sparsity plan (TEAL's columns) rather than leaving it eager."""
        return self.sparsity is not None and self.sparsity.native_step()

    @property
    def config(self) -> ModelConfig:
        return self.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def quant(self) -> str | None:
        return self.model.quant

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---------------------------------------------------------------- forward passes

    def new_cache(self, batch: int = 1, capacity: int = 256, policy=None, positions: str = "original",
                  max_capacity: int | None = None, pad: list[int] | None = None) -> KVCache:
        """An empty cache; a policy with a budget sets its size, otherwise it grows up to max_capacity."""
        cfg, quest = self.cfg, self.options.attention
        return KVCache(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, self.model.rope, self.kv_dtype or self.dtype,
                       capacity, positions, max_capacity, policy, window=cfg.sliding_window, pad=pad,
                       page=quest.page if quest is not None else None,
                       channel_keys=quest is not None and quest.channels > 0)

    def default_policy(self, length: int | None = None):
        """A fresh policy of the options' default (None = full); a fractional budget needs `length`."""
        return self.options.new_policy(length)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, observers=(), mask: torch.Tensor | None = None,
               pos: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab]: one full causal pass from position 0 (or at positions pos [B, T],
        or under mask [T, T] bool), no cache. observers: recorders called inside the pass (see `Pass`)."""
        ids = as_ids(ids)
        return self.model(ids, Pass.full(self.model.rope, ids, mask, observers, self.sparsity, pos))

    @torch.inference_mode()
    def step(self, batch: Batch) -> list[torch.Tensor | None]:
        """The engine's one step: every row's tokens appended to its cache; each row's logits as it asked
        ([b, 1, vocab] "last", [b, T, vocab] "all", None "none"), in the batch's order.

        Positions and room first (`cache.begin`), then the network, then counting and eviction (`cache.advance`).
        The native step (`compile_decode`) runs the single-token rows it covers in one call, each weight read once
        for all of them (Quest included: each row its own pages); eager runs the rest: several single-token rows in
        one pass (`Pass.rows`: attention per row over its own cache), any other row (a prompt's chunk, a padded
        batch, a sparsity plan's rows) in a pass of its own. A verification row (`Row.verify`) is its tokens as
        single-token rows of one cache, in order (`units`): each token's arithmetic is a decode step's, bit for bit,
        with each weight still read once for all of them. The kernels compute an activation row alike whatever rows
        it shares a call with, so a row's logits do not depend on its neighbours."""
        quest, rope = self.options.attention, self.model.rope
        fitted = [self._fit(r) for r in batch.rows]
        rows = [r for r, _ in fitted]
        plain = [self.compiled is not None and (r.tokens == 1 or r.verify) and not r.prompt and not r.observers
                 and not r.cache.observers and (self.sparsity is None or self._native_plan() and r.tokens == 1)
                 for r in rows]  # what the native step may cover
        fast = [p and (r.single or r.verify) for p, r in zip(plain, rows)]
        steps = [r.cache.begin(r.tokens, rope, real=f) for r, f in zip(rows, fast)]
        units = [u for i, r in enumerate(rows) for u in r.units(i, steps[i], r.verify and self.sparsity is None)]
        out: list[torch.Tensor | None] = [None] * len(units)
        native = self._native(rows, units, fast, quest, out)
        if any(plain[i] and u not in native for u, (i, *_) in enumerate(units)):
            self.compiled.calls["eager"] += 1  # a step it does not cover (a padded batch, a window that slid)
        single = [u for u, (i, ids, _) in enumerate(units) if u not in native and ids.shape == (1, 1)
                  and not rows[i].prompt and self.sparsity is None]
        if len(single) > 1:  # several single tokens (conversations', a verification row's): one read of each weight
            passes = [Pass(units[u][2].rot, units[u][2], rows[units[u][0]].cache.layers, quest=quest,
                           observers=(*rows[units[u][0]].observers, *rows[units[u][0]].cache.observers)) for u in single]
            tokens = torch.cat([units[u][1] for u in single])
            logits = self.model(tokens, Pass(None, rows=passes), keep=slice(-1, None))
            for j, u in enumerate(single):
                out[u] = logits[j:j + 1]
        for u, (i, ids, st) in enumerate(units):
            if u not in native and (u not in single or len(single) == 1):
                r = rows[i]
                ctx = Pass(st.rot, st, r.cache.layers, observers=(*r.observers, *r.cache.observers),
                           sparsity=self.sparsity, quest=quest, prompt=r.prompt)
                out[u] = self.model(ids, ctx, keep=r.keep)
        for r in rows:
            r.cache.advance(r.tokens)
        mine = [[o for (j, *_), o in zip(units, out) if j == i and o is not None] for i in range(len(rows))]
        return [None if r.logits == "none" else torch.cat([*head, *(m if r.logits != "last" else [m[-1][:, -1:]])], 1)
                for r, m, (_, head) in zip(rows, mine, fitted)]  # each row's units' logits, in order

    def _fit(self, row: Row) -> tuple[Row, list]:
        """A row longer than its cache has room for in one pass (a bounded cache: one policy chunk) goes in parts,
        its policy evicting between them as between a prompt's chunks: all but the last here (their logits if the
        row wants them), the last in the batch."""
        room = row.cache.max_chunk
        if not room or row.tokens <= room:
            return row, []
        cut = (row.tokens - 1) // room * room
        head = [self.step(Batch.one(row.ids[:, a:a + room], row.cache, row.part(a, a + room), row.observers, row.prompt,
                                    row.verify))[0] for a in range(0, cut, room)]
        last = row.part(cut, row.tokens) if isinstance(row.logits, range) else row.logits
        return dataclasses.replace(row, ids=row.ids[:, cut:], logits=last), [h for h in head if h is not None]

    def _native(self, rows, units, fast, quest, out) -> set[int]:
        """Run the units the native step covers (their logits into out); returns their indices. A verification
        row's tokens go in together or not at all (with a team and Quest, eager)."""
        cand = [u for u, (i, ids, _) in enumerate(units) if fast[i] and ids.shape == (1, 1)]
        if not cand:
            return set()
        firsts = {u: self.compiled.first(units[u][2], rows[units[u][0]].cache.layers, quest) for u in cand}
        bad = {units[u][0] for u, first in firsts.items() if first is None or units[u][2].padded}
        if self.compiled.threads > 1 and quest is not None:  # a team writes a row's slots before any attends: Quest's
            bad |= {i for i, r in enumerate(rows) if r.verify and r.tokens > 1}  # page bounds would see later tokens
        native = [u for u in cand if units[u][0] not in bad]
        if not native:
            return set()
        last = {units[u][0]: u for u in native}  # each row's last unit
        outs = [j for j, u in enumerate(native) if rows[units[u][0]].logits == "all"
                or rows[units[u][0]].logits == "last" and last[units[u][0]] == u]
        logits = self.compiled.batch(torch.cat([units[u][1] for u in native]), [units[u][2] for u in native],
                                     [rows[units[u][0]].cache.layers for u in native], quest, [firsts[u] for u in native],
                                     outs)
        for k, j in enumerate(outs):
            out[native[j]] = logits[k:k + 1]
        return set(native)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, last_only: bool = False, observers=()) -> torch.Tensor:
        """One row through `step`: ids [B, T] appended to the cache -> their logits [B, T (or 1), vocab]."""
        return self.step(Batch.one(ids, cache, "last" if last_only else "all", observers))[0]

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, cache: KVCache, chunk: int = 512, all_logits: bool = False,
                progress=None, observers=(), press=None) -> torch.Tensor:
        """Feed ids [B, T] in chunks (bounded activation memory; a policy may evict between chunks).

        press: compress the cache once the whole of ids is in (`attnlab.kv.press`; the cache must have no
        policy). Returns the last position's logits [B, vocab], or all logits [B, T, vocab] if all_logits.
        """
        ids = as_ids(ids)
        if chunk < 1:
            raise AttnlabError(f"chunk must be >= 1, got {chunk}")
        if press is not None:
            from attnlab.kv.press import PressRecorder, check_cache, compress
            check_cache(cache)
            recorder = PressRecorder(press, cache.layers)
            logits = self.prefill(ids, cache, chunk, all_logits, progress, (*observers, recorder))
            compress(cache, press, recorder)
            return logits
        chunk = min(chunk, cache.max_chunk or chunk)  # a bounded cache's room (else `step` would cut each chunk)
        outs = []
        for start in range(0, ids.shape[1], chunk):
            part = ids[:, start:start + chunk]
            outs.append(self.step(Batch.one(part, cache, "all" if all_logits else "last", observers, prompt=True))[0])
            if progress is not None:
                progress(part.shape[1])
        if not outs:
            raise AttnlabError("prefill needs at least one token")
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]

    def decode(self, cache: KVCache, logits: torch.Tensor, sampler: Sampler, max_new_tokens: int,
               stop_ids=()) -> Iterator[torch.Tensor]:
        """The one decoding loop of a cache: sample from logits [B, vocab], yield the tokens [B], feed them, repeat.

        Each row ends by the one stop check (`attnlab.stop.Stop`: a stop id, or max_new_tokens); the loop ends
        once every row has (a row that ended keeps being fed; its later tokens are the caller's to drop). The last
        token yielded is not fed, so a caller can continue a conversation by feeding it with its next prompt
        (see `Session`)."""
        if max_new_tokens < 0:
            raise AttnlabError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        stops = [Stop(max_new_tokens, stop_ids) for _ in range(logits.shape[0])] if max_new_tokens else []
        while stops:
            token = sampler(logits)
            yield token
            for stop, t in zip(stops, token.tolist()):
                stop.push(t)
            if all(stop.reason for stop in stops):
                return
            logits = self.step(Batch.one(token[:, None], cache))[0][:, -1]

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
               chunk: int = 512, stop_at_eos: bool = True, speculative=None, stats=None) -> Iterator[int]:
        """Yield sampled token ids one by one (batch 1) after prefilling ids into cache (see `decode`).
        speculative: a drafter's spec (default: the options'; `attnlab.speculative`), the same tokens faster;
        stats: a `SpecStats` it fills (drafted, accepted, verification steps)."""
        if max_new_tokens < 0:
            raise AttnlabError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids = as_ids(ids)
        if ids.shape[0] != 1:
            raise AttnlabError(f"stream takes one row of token ids, got shape {tuple(ids.shape)}")
        logits = self.prefill(ids, cache, chunk)
        stop_ids = self.eos_ids if stop_at_eos else ()
        from attnlab.speculative import SpeculativeSpec, decode
        spec = SpeculativeSpec.parse(speculative) or self.options.speculative
        if spec is not None:
            yield from decode(self, cache, ids[0].tolist(), logits, sampler, max_new_tokens, stop_ids, spec, stats=stats)
            return
        for token in self.decode(cache, logits, sampler, max_new_tokens, stop_ids):
            yield int(token[0])

    def generate(self, prompt: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
                 policy=None, speculative=None, stats=None) -> str | list[str]:
        """Complete one prompt (returns str) or a batch (returns list[str], left-padded together).
        policy: a KV-cache policy (default: the options' policy, full if none). speculative, stats: see `stream`
        (one prompt at a time)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise AttnlabError("no prompt given")
        enc = [self.chat_ids([{"role": "user", "content": p}]) if chat else self.encode(p) for p in prompts]
        if any(len(e) == 0 for e in enc):
            raise AttnlabError("empty prompt: give at least one token of text")
        if policy is None:
            policy = self.default_policy(max(map(len, enc)) + max_new_tokens)
        sampler = Sampler(temperature, top_k, top_p, seed)
        if speculative is not None or self.options.speculative is not None:
            if len(enc) != 1:
                raise AttnlabError("speculative decoding takes one prompt at a time")
            cache = self.new_cache(capacity=len(enc[0]) + max_new_tokens + 64, policy=policy)
            out = [list(self.stream(enc[0], cache, sampler, max_new_tokens, speculative=speculative, stats=stats))]
        else:
            out = self.generate_ids(enc, max_new_tokens, sampler, policy)
        texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in out]
        return texts[0] if isinstance(prompt, str) else texts

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler, policy=None) -> list[list[int]]:
        """Batched decoding of left-padded prompts in one cache (`decode`); each row's reply ends at its own EOS."""
        if max_new_tokens < 0:
            raise AttnlabError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        width = max(len(p) for p in prompts)
        pad_id = self.cfg.eos_token_ids[0] if self.cfg.eos_token_ids else 0
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts])
        cache = self.new_cache(len(prompts), capacity=width + max_new_tokens, policy=policy,
                               pad=[width - len(p) for p in prompts])
        out: list[list[int]] = [[] for _ in prompts]
        stops = [Stop(max_new_tokens, self.eos_ids) for _ in prompts]
        for token in self.decode(cache, self.prefill(ids, cache), sampler, max_new_tokens, self.eos_ids):
            for b, t in enumerate(token.tolist()):
                if stops[b].reason is None:
                    out[b].append(t)
                    stops[b].push(t)
        return out


def load(spec: str | Path = DEFAULT_MODEL, options: Options | None = None, **fields) -> LM:
    """Load a model: the embedded name 'smollm2-135m', a .gguf file, or a Hugging Face folder (or a
    quantized folder written by `attnlab quantize`), under `options` or the same fields as keywords:
    dtype, threads, quant ('int4:32'), compile, rope ('yarn:4'), sparsity ('runs/dejavu:0.5',
    'lowbit:0.5'), kv_dtype ('float16'), policy ('sink:1024'), attention ('quest:1024'). See `attnlab.options.Options`."""
    return LM.load(spec, options, **fields)
