"""Decode and prefill speed of every weight format, against transformers and llama.cpp, in one run.

All engines run in one process on the same SmolLM2 GGUF, at the same thread count. For each
thread count and cache depth, every variant decodes `--steps` tokens per run; runs are
interleaved (variant order rotates every repeat) and repeated; medians are printed with the
ratio to our fp32 eager engine and the % of each variant's memory-bandwidth bound (bytes it
must read per token: weights + KV cache at that depth, over the measured read bandwidth).

Variants: ours fp32/bf16/int8/int4:32/kmeans:4 (fused) and kmeans-naive:4 (lookup-then-matmul),
eager and (`--compile`) compiled; transformers fp32; llama.cpp through llama-cpp-python when
installed (`make bench-llamacpp`), flash attention on and off (the faster is the anchor).
A compiled variant gets a fresh step per depth, one static-capacity graph as a process whose cache
keeps one size runs (a server's bounded cache); `--shared-graph` keeps one step across depths, which
dynamo recompiles with the capacity dynamic at the second depth, as a process whose caches change size.

    python benchmarks/decode_speed.py --threads 1,2 --repeats 5 --compile
    python benchmarks/decode_speed.py --variants fp32,int4:32 --lengths 128 --threads 1   # quick
    python benchmarks/decode_speed.py --variants fp32 --compile int4:32 --kv float32,float16,int8 \
        --llamacpp-kv f16,q8_0   # KV-cache formats, ours and llama.cpp's
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

OURS = ["fp32", "bf16", "int8", "int4:32", "kmeans:4", "kmeans-naive:4"]


def bandwidth_gbs(repeats: int = 5) -> float:
    """Read bandwidth seen by a large fp32 matrix-vector product (what decoding does), GB/s."""
    w, v = torch.randn(8192, 16384), torch.randn(16384)
    w @ v
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        w @ v
        times.append(time.perf_counter() - t)
    return w.numel() * 4 / statistics.median(times) / 1e9


def weights_read(model) -> int:
    """Bytes of weights one decode step reads: every linear layer (LM head included) and the norms."""
    from attnlab.quant.linear import QuantLinear, linear_names
    total = 0
    for name in linear_names(model):
        m = model.get_submodule(name)
        total += m.nbytes if isinstance(m, QuantLinear) else m.weight.numel() * m.weight.element_size()
    norms = [model.norm] + [n for layer in model.layers for n in (layer.attn_norm, layer.mlp_norm)]
    return total + sum(n.weight.numel() * n.weight.element_size() for n in norms)


class Ours:
    def __init__(self, spec: str, compile_: bool, kv: str = "float32", fresh_graph: bool = True):
        """fresh_graph (compiled only): a new compiled step for each depth's cache (a static capacity, as in a
        process whose cache keeps one size), not the one compiled for an earlier depth, which dynamo
        recompiles with the capacity dynamic on meeting a second size (`--shared-graph` measures that)."""
        import attnlab
        self.fresh_graph = compile_ and fresh_graph
        self.name = spec + (" compiled" if compile_ else "") + {"float16": " kv16", "int8": " kv8"}.get(kv, "")
        dtype = "bfloat16" if spec == "bf16" else "float32"
        quant = None if spec in ("fp32", "bf16") else spec
        t = time.perf_counter()
        self.lm = attnlab.LM.load("smollm2-135m", dtype=dtype, quant=quant, compile=compile_, tokenizer=False,
                                  kv_dtype=None if dtype == "bfloat16" else kv)
        self.load_s = time.perf_counter() - t
        self.compile_s = None
        self.kv_slot = self.lm.new_cache(capacity=1).nbytes()  # bytes per cached token, scales included
        self.bytes = weights_read(self.lm.model)
        self.caches = {}

    def kv_bytes(self, length):
        return self.kv_slot * length

    @torch.inference_mode()
    def prepare(self, ids, steps):
        cache = self.lm.new_cache(capacity=ids.shape[1] + steps + 1)
        self.lm.prefill(ids, cache)
        self.caches[ids.shape[1]] = cache
        if self.compile_s is not None and self.fresh_graph:
            self.lm.compile_decode()
            self.decode(ids.shape[1], 3)  # compiles: a hit in inductor's on-disk cache after the first depth
        if self.compile_s is None:  # the first step compiles (the write slot a dynamic size)
            t = time.perf_counter()
            self.decode(ids.shape[1], 3)
            self.compile_s = time.perf_counter() - t

    @torch.inference_mode()
    def decode(self, length, steps):
        cache = self.caches[length]
        cache.truncate(length)
        tok = torch.tensor([[7]])
        t = time.perf_counter()
        for _ in range(steps):
            self.lm.forward(tok, cache)
        return steps / (time.perf_counter() - t)

    def release(self, length):
        self.caches.pop(length, None)

    @torch.inference_mode()
    def prefill(self, ids):
        t = time.perf_counter()
        self.lm.prefill(ids, self.lm.new_cache(capacity=ids.shape[1]), chunk=ids.shape[1])
        return ids.shape[1] / (time.perf_counter() - t)


class Transformers:
    def __init__(self, path):
        from transformers import AutoModelForCausalLM
        self.name = "transformers fp32"
        t = time.perf_counter()
        self.hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        self.load_s, self.compile_s = time.perf_counter() - t, None
        self.bytes = sum(p.numel() * 4 for n, p in self.hf.named_parameters() if "embed" not in n) + \
            self.hf.lm_head.weight.numel() * 4 * (not any("lm_head" in n for n, _ in self.hf.named_parameters()))
        self.caches = {}

    def kv_bytes(self, length):
        c = self.hf.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4 * length

    @torch.inference_mode()
    def prepare(self, ids, steps):
        from transformers import DynamicCache
        cache = DynamicCache(config=self.hf.config)
        for s in range(0, ids.shape[1], 512):
            self.hf(ids[:, s:s + 512], past_key_values=cache, use_cache=True)
        self.caches[ids.shape[1]] = cache

    @torch.inference_mode()
    def decode(self, length, steps):
        cache = self.caches[length]
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra)
        tok = torch.tensor([[7]])
        t = time.perf_counter()
        for i in range(steps):
            self.hf(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([length + i]))
        return steps / (time.perf_counter() - t)

    def release(self, length):
        self.caches.pop(length, None)

    @torch.inference_mode()
    def prefill(self, ids):
        t = time.perf_counter()
        self.hf(ids, use_cache=True, logits_to_keep=1)
        return ids.shape[1] / (time.perf_counter() - t)


class LlamaCpp:
    """llama.cpp on the same GGUF file, through llama-cpp-python: f16 KV cache (its default) or q8_0
    (int8 + an f16 scale per 32; llama.cpp quantizes V only under flash attention)."""

    KV_TYPES = {"f16": (1, 2.0), "q8_0": (8, 34 / 32)}  # ggml type id, bytes per number

    def __init__(self, path, threads: int, flash: bool, n_ctx: int, kv: str = "f16"):
        from llama_cpp import Llama
        self.name = f"llama.cpp fa={'on' if flash else 'off'}" + (f" kv={kv}" if kv != "f16" else "")
        ggml_type, self.kv_elem = self.KV_TYPES[kv]
        t = time.perf_counter()
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, flash_attn=flash, type_k=ggml_type, type_v=ggml_type, verbose=False)
        self.load_s, self.compile_s = time.perf_counter() - t, None
        self.bytes = path.stat().st_size  # every tensor of the file is read per token (tied head included)
        self.length = None

    def kv_bytes(self, length):
        return 2 * 30 * 3 * 64 * self.kv_elem * length  # SmolLM2: 30 layers, 3 KV heads of 64

    def _rewind(self, length):
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)
        self.llm.n_tokens = length

    def prepare(self, ids, steps):
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        self.llm.eval(ids[0].tolist())
        self.length = ids.shape[1]

    def decode(self, length, steps):
        assert length == self.length
        self._rewind(length)
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([7])
        return steps / (time.perf_counter() - t)

    def release(self, length):
        pass

    def prefill(self, ids):
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        self.llm.eval(ids[0].tolist())
        return ids.shape[1] / (time.perf_counter() - t)


def interleaved(variants, fn, repeats):
    """{variant name: median of fn(v)} with the order rotated every repeat."""
    res = {v.name: [] for v in variants}
    for r in range(repeats):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            res[v.name].append(fn(v))
    return {k: statistics.median(x) for k, x in res.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1", help="comma list of thread counts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed run")
    p.add_argument("--lengths", default="128,1024,4096")
    p.add_argument("--prefill", type=int, default=512, help="prompt length for the prefill timing")
    p.add_argument("--variants", default=",".join(OURS), help=f"ours (eager) among {','.join(OURS)}")
    p.add_argument("--compile", nargs="?", const="fp32,int4:32", default="", metavar="LIST",
                   help="also the compiled decode step of these (default fp32,int4:32; not limited to --variants)")
    p.add_argument("--kv", default="float32", help="comma list of our KV-cache dtypes (float32, float16, int8); "
                   "every variant of ours runs with each")
    p.add_argument("--compile-kv", default=None, help="KV-cache dtypes of the compiled variants (default: --kv)")
    p.add_argument("--llamacpp-kv", default="f16", help="comma list of llama.cpp KV-cache types (f16, q8_0); "
                   "q8_0 runs with flash attention only (llama.cpp's requirement)")
    p.add_argument("--shared-graph", action="store_true", help="one compiled step per model across depths "
                   "(its capacity turns dynamic at the second depth) instead of a fresh static one per depth")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]

    from attnlab.model.loaders import resolve
    path = resolve("smollm2-135m")
    torch.set_num_threads(threads[0])
    kvs = args.kv.split(",")

    def load_variants():  # per thread count: compiled code and thread pools set up at that count
        vs = [Ours(s, False, kv) for s in args.variants.split(",") if s for kv in kvs if s != "bf16" or kv == kvs[0]]
        compiled_kvs = (args.compile_kv or args.kv).split(",")
        vs += [Ours(s, True, kv, not args.shared_graph) for s in args.compile.split(",") if s for kv in compiled_kvs]
        if not args.no_transformers:
            vs.append(Transformers(path))
        return vs

    try:
        import llama_cpp  # noqa: F401
        have_cpp = not args.no_llamacpp
    except ImportError:
        have_cpp = False
        print("llama-cpp-python not installed (make bench-llamacpp): llama.cpp not measured", file=sys.stderr)
    bw = bandwidth_gbs()
    gen = torch.Generator().manual_seed(0)
    results = {"bandwidth_gbs": bw, "threads": {}, "load_s": {}}
    print(f"measured read bandwidth {bw:.1f} GB/s; steps/run {args.steps}; repeats {args.repeats}")
    for t in threads:
        torch.set_num_threads(t)
        torch._dynamo.reset()
        variants = load_variants()
        results["load_s"].update({v.name: v.load_s for v in variants})
        n_ctx = max(max(lengths) + args.steps, args.prefill) + 8  # room for the decode runs and the prefill test
        cpp = [LlamaCpp(path, t, fa, n_ctx, kv) for kv in args.llamacpp_kv.split(",")
               for fa in ((False, True) if kv == "f16" else (True,))] if have_cpp else []
        allv = variants + cpp
        rows = {}
        for length in lengths:
            ids = torch.randint(0, 49152, (1, length), generator=gen)
            for v in allv:
                v.prepare(ids, args.steps)
            med = interleaved(allv, lambda v: v.decode(length, args.steps), args.repeats)
            for v in allv:
                v.release(length)
                bound = bw * 1e9 / (v.bytes + v.kv_bytes(length))
                rows.setdefault(v.name, {})[f"decode@{length}"] = {"tok_s": med[v.name], "pct_bound": 100 * med[v.name] / bound}
            print(f"threads {t} depth {length}: " + ", ".join(f"{k} {x:.1f}" for k, x in med.items()), file=sys.stderr)
        ids = torch.randint(0, 49152, (1, args.prefill), generator=gen)
        med = interleaved(allv, lambda v: v.prefill(ids), max(3, args.repeats // 2))
        for v in allv:
            rows[v.name][f"prefill{args.prefill}"] = {"tok_s": med[v.name]}
        results["threads"][t] = rows
        cols = [f"decode@{n}" for n in lengths] + [f"prefill{args.prefill}"]
        base_name = "fp32" if "fp32" in rows else next(iter(rows))
        base = rows[base_name]
        print(f"\n### {t} thread{'s' if t > 1 else ''}: tok/s (x our {base_name} eager; % of bandwidth bound)\n")
        print("| variant | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for name, r in rows.items():
            cells = []
            for c in cols:
                x = r[c]
                pct = f"; {x['pct_bound']:.0f}%" if "pct_bound" in x else ""
                cells.append(f"{x['tok_s']:.1f} ({x['tok_s'] / base[c]['tok_s']:.2f}x{pct})")
            print(f"| {name} | " + " | ".join(cells) + " |")
        comp = {v.name: round(v.compile_s, 1) for v in variants if v.compile_s is not None and "compiled" in v.name}
        if comp:
            print(f"\ncompile time (first decode steps, s): {comp}")
            print("compiled steps by path" + ("" if args.shared_graph else " (last depth)") + ": " + ", ".join(
                f"{v.name} {getattr(v.lm.compiled, 'calls', None)}" for v in variants if "compiled" in v.name))
        del cpp, variants, allv
    print("load time (s): " + ", ".join(f"{k} {x:.1f}" for k, x in results["load_s"].items()))
    if args.json:
        from attnlab.io import write_json
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
