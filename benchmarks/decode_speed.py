"""Decode and prefill speed of every weight format, against transformers and llama.cpp, in one run.

All engines run in one process on the same SmolLM2 GGUF, at the same thread count. For each
thread count and cache depth, every variant decodes `--steps` tokens per run; runs are
interleaved (variant order rotates every repeat) and repeated; medians are printed with the
ratio to our fp32 eager engine and the % of each variant's memory-bandwidth bound (bytes it
must read per token: weights + KV cache at that depth, over the measured read bandwidth: a float32 sum over 1 GiB,
printed at 1 and 2 threads before anything else).

Variants: ours fp32/bf16/int8/int4:32/kmeans:4 (fused) and kmeans-naive:4 (lookup-then-matmul),
eager and (`--compile`) compiled; transformers fp32; llama.cpp's own `llama-bench` (`make bench-llamacpp`:
a native and a generic build, `-ub 1` where the native one needs it), flash attention on and off, one
repetition per interleaved round; the ratio table compares ours with llama.cpp's fastest build per cell.
The run starts with the CPU model, its ISA flags and attnlab's kernel variant. `--model` times another
GGUF (benchmarks/make_gguf.py makes a Q4_K_M SmolLM2 and a Llama-3.2-1B-shaped file).
A compiled variant runs the native single-token step (`--compile`, `attnlab/kernels/step.cpp`).

    python benchmarks/decode_speed.py --threads 1,2 --repeats 5 --compile
    python benchmarks/decode_speed.py --variants int4:32 --no-transformers --steps 32 --repeats 3 \
        --model ~/.cache/attnlab/bench/llama1b-q4_0.gguf --lengths 128,4096 --threads 1,2   # at 1B size
    python benchmarks/decode_speed.py --variants fp32,int4:32 --lengths 128 --threads 1   # quick
    python benchmarks/decode_speed.py --variants default,file --compile file --compile-kv float16 --lengths 128 \
        --threads 1 --no-transformers --no-llamacpp   # no flags against the fastest flags and the old default
    python benchmarks/decode_speed.py --variants fp32 --compile int4:32 --kv float32,float16,int8 \
        --llamacpp-kv f16,q8_0   # KV-cache formats, ours and llama.cpp's
    python benchmarks/decode_speed.py --model qwen2.5-coder-0.5b --variants '' --compile file --kv float16 \
        --no-transformers --threads 1 --repeats 3   # the real Qwen2.5-0.5B Q4_K_M file (attnlab fetch), own formats
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import llamacpp  # noqa: E402

OURS = ["fp32", "bf16", "int8", "int4:32", "kmeans:4", "kmeans-naive:4"]


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
    def __init__(self, spec: str, compile_: bool, kv: str = "float32", model: str = "smollm2-135m"):
        """spec: fp32, bf16, a --quant format, "file" (a GGUF in its own formats), or "default" (`attnlab.load`
        with no options at all: what a user gets without flags; compile_ and kv are ignored)."""
        import attnlab
        self.name = spec + (" compiled" if compile_ else "") + {"float16": " kv16", "int8": " kv8"}.get(kv, "")
        dtype = {"bf16": "bfloat16", "file": None}.get(spec, "float32")
        quant = None if spec in ("fp32", "bf16", "file") else spec
        t = time.perf_counter()
        if spec == "default":
            self.name, self.lm = "default (no flags)", attnlab.LM.load(model, tokenizer=False)
        else:
            self.lm = attnlab.LM.load(model, dtype=dtype, quant=quant, compile=compile_, tokenizer=False,
                                      kv_dtype=None if dtype == "bfloat16" else kv)
        self.load_s = time.perf_counter() - t
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
        self.decode(ids.shape[1], 3)  # warm-up: caches, thread pools

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

    def phases(self, length, steps):
        """The native step's per-phase times at this depth, ms per step ({phase: [wall, busy per thread]})."""
        if getattr(self.lm, "compiled", None) is None:
            return None
        self.lm.compiled.step.profile(True)
        self.decode(length, steps)
        return {k: [x * 1e3 for x in v] for k, v in self.lm.compiled.step.profile(False).items()}

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
        self.load_s = time.perf_counter() - t
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


class LlamaBench:
    """llama.cpp's own `llama-bench` on the same GGUF file, one repetition per call (so its runs interleave
    with ours): decode `-p 0 -n steps -d depth`, prefill `-p N -n 0`; f16 KV cache (its default) or q8_0.
    Each call loads the file (mmap) and fills the depth first; only the timed part is reported."""

    KV_ELEM = {"f16": 2.0, "q8_0": 34 / 32}  # bytes per cached number

    def __init__(self, build: str, meta: dict, path, threads: int, flash: bool, kv: str = "f16"):
        self.meta, self.path, self.threads, self.flash, self.kv = meta, path, threads, flash, kv
        self.name = f"llama.cpp {build}{' -ub 1' if meta.get('ub1') else ''} fa={'on' if flash else 'off'}" \
            + (f" kv={kv}" if kv != "f16" else "")
        self.load_s = None
        self.bytes = llamacpp.token_bytes(path)  # every tensor but an untied head's token table
        self.kv_slot = kv_slot_elems(path) * self.KV_ELEM[kv]

    def kv_bytes(self, length):
        return self.kv_slot * length

    def _run(self, args):
        args = ["-t", str(self.threads), "-fa", "1" if self.flash else "0", "-r", "1", "-ctk", self.kv,
                "-ctv", self.kv, *args]
        return llamacpp.run_bench(self.meta, self.path, args)[0]["tps"]

    def prepare(self, ids, steps):
        self.steps = steps

    def decode(self, length, steps):
        return self._run(["-p", "0", "-n", str(steps), "-d", str(length)])

    def release(self, length):
        pass

    def prefill(self, ids):
        return self._run(["-p", str(ids.shape[1]), "-n", "0"])


def kv_slot_elems(path) -> int:
    """Numbers one cached token holds (K and V, every layer), from the GGUF's metadata."""
    import gguf
    f = gguf.GGUFReader(str(path)).fields
    arch = f["general.architecture"].contents()  # llama, qwen2: the keys are prefixed by it
    get = lambda k: int(f[f"{arch}.{k}"].contents())  # noqa: E731
    return 2 * get("block_count") * get("attention.head_count_kv") * (get("embedding_length") // get("attention.head_count"))


def peer_table(rows: dict, cols: list[str], cpp_names: list[str], threads: int) -> dict:
    """Print and return each of our variants against llama.cpp's fastest build (and flash mode) per cell."""
    best = {c: max(cpp_names, key=lambda n: rows[n][c]["tok_s"]) for c in cols}
    print(f"\n### {threads} thread{'s' if threads > 1 else ''}: x llama.cpp's fastest working build per cell\n")
    print("| variant | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    print("| llama.cpp best (tok/s) | " + " | ".join(f"{rows[best[c]][c]['tok_s']:.1f} ({best[c][len('llama.cpp '):]})"
                                                     for c in cols) + " |")
    out = {"best": {c: {"name": best[c], "tok_s": rows[best[c]][c]["tok_s"]} for c in cols}, "ratio": {}}
    for name, r in rows.items():
        if name in cpp_names:
            continue
        ratio = {c: r[c]["tok_s"] / rows[best[c]][c]["tok_s"] for c in cols}
        out["ratio"][name] = ratio
        print(f"| {name} | " + " | ".join(f"{ratio[c]:.2f}x" for c in cols) + " |")
    return out


def print_phases(phases: dict, bandwidth: dict) -> None:
    """Per phase of the native step, ms per step at each thread count and the speed-up over the first; the
    memory's own speed-up (streaming read bandwidth) beside it is the ceiling of a bandwidth-bound phase."""
    counts = sorted(bandwidth)
    if len(counts) > 1:
        print(f"\nread bandwidth {' / '.join(f'{bandwidth[t]:.1f}' for t in counts)} GB/s at {counts} threads: "
              f"{bandwidth[counts[-1]] / bandwidth[counts[0]]:.2f}x, the ceiling for a step that streams its weights")
    for name, by_length in phases.items():
        for length, by_threads in by_length.items():
            ts = [t for t in counts if t in by_threads]
            print(f"\n{name}, depth {length}: ms per step by phase (wall; busy per thread)\n")
            print("| phase | " + " | ".join(f"{t} thr" for t in ts) + (f" | {ts[-1]} vs {ts[0]} |" if len(ts) > 1 else " |"))
            print("|---|" + "---|" * (len(ts) + (len(ts) > 1)))
            for ph in by_threads[ts[0]]:
                cells = [f"{by_threads[t][ph][0]:.2f} ({', '.join(f'{x:.2f}' for x in by_threads[t][ph][1:])})" for t in ts]
                ratio = [f"{by_threads[ts[0]][ph][0] / max(by_threads[ts[-1]][ph][0], 1e-9):.2f}x"] if len(ts) > 1 else []
                print(f"| {ph} | " + " | ".join(cells + ratio) + " |")
            total = {t: sum(v[0] for v in by_threads[t].values()) for t in ts}
            print("| total | " + " | ".join(f"{total[t]:.2f}" for t in ts)
                  + (f" | {total[ts[0]] / total[ts[-1]]:.2f}x |" if len(ts) > 1 else " |"))


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
    p.add_argument("--prefill", type=int, default=512, help="prompt length for the prefill timing (0: none)")
    p.add_argument("--variants", default=",".join(OURS), help=f"ours (eager) among {','.join(OURS)}")
    p.add_argument("--compile", nargs="?", const="fp32,int4:32", default="", metavar="LIST",
                   help="also the compiled decode step of these (default fp32,int4:32; not limited to --variants)")
    p.add_argument("--kv", default="float32", help="comma list of our KV-cache dtypes (float32, float16, int8); "
                   "every variant of ours runs with each")
    p.add_argument("--compile-kv", default=None, help="KV-cache dtypes of the compiled variants (default: --kv)")
    p.add_argument("--llamacpp-kv", default="f16", help="comma list of llama.cpp KV-cache types (f16, q8_0); "
                   "q8_0 runs with flash attention only (llama.cpp's requirement)")
    p.add_argument("--llamacpp-fa", default="off,on", metavar="off,on",
                   help="llama.cpp's flash-attention settings to time with an f16 cache (its fastest counts)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--llamacpp-builds", default="native,generic", help="which of llama.cpp's builds to time "
                   "(build/llamacpp of this checkout, else of /work/main)")
    p.add_argument("--model", default="smollm2-135m", help="the GGUF file (or embedded name) every engine runs")
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args(argv)
    if not set(args.llamacpp_fa.split(",")) <= {"off", "on"}:
        p.error(f"--llamacpp-fa takes off, on or both, got {args.llamacpp_fa!r}")
    threads = [int(t) for t in args.threads.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]

    from attnlab.model.loaders import resolve
    print(llamacpp.header())
    bandwidth = llamacpp.bandwidths(sorted({1, 2, *threads}))
    print(llamacpp.bandwidth_line(bandwidth))
    path = resolve(args.model)
    torch.set_num_threads(threads[0])
    kvs = args.kv.split(",")

    def load_variants():  # per thread count: compiled code and thread pools set up at that count
        vs = [Ours(s, False, kv, model=args.model) for s in args.variants.split(",") if s for kv in kvs
              if s not in ("bf16", "default") or kv == kvs[0]]
        compiled_kvs = (args.compile_kv or args.kv).split(",")
        vs += [Ours(s, True, kv, model=args.model) for s in args.compile.split(",") if s for kv in compiled_kvs]
        if not args.no_transformers:
            vs.append(Transformers(path))
        return vs

    builds = {} if args.no_llamacpp else {k: v for k, v in llamacpp.find_builds().items()
                                           if k in args.llamacpp_builds.split(",")}
    if not builds and not args.no_llamacpp:
        print("llama.cpp is not built (make bench-llamacpp): llama.cpp not measured", file=sys.stderr)
    for name, meta in builds.items():
        print(f"llama.cpp {name}: {meta['bin']} ({meta.get('version', '?')}; {meta.get('note', '')})")
    gen = torch.Generator().manual_seed(0)
    from attnlab.io import provenance
    results = {**provenance(None), "command": "python " + shlex.join(["benchmarks/decode_speed.py", *sys.argv[1:]]),
               "seed": 0, "cpu": llamacpp.header(), "bandwidth_gbs": {}, "threads": {}, "load_s": {}, "phases": {}}
    print(f"steps/run {args.steps}; repeats {args.repeats}")
    for t in threads:
        torch.set_num_threads(t)
        bw = results["bandwidth_gbs"][t] = bandwidth[t]
        variants = load_variants()
        results["load_s"].update({v.name: v.load_s for v in variants})
        fas = [{"off": False, "on": True}[f] for f in args.llamacpp_fa.split(",")]
        cpp = [LlamaBench(b, meta, path, t, fa, kv) for b, meta in builds.items() for kv in args.llamacpp_kv.split(",")
               for fa in (fas if kv == "f16" else (True,))]
        allv = variants + cpp
        rows = {}
        for length in lengths:
            ids = torch.randint(0, 49152, (1, length), generator=gen)
            for v in allv:
                v.prepare(ids, args.steps)
            med = interleaved(allv, lambda v: v.decode(length, args.steps), args.repeats)
            for v in variants:
                prof = v.phases(length, args.steps)
                if prof:
                    results["phases"].setdefault(v.name, {}).setdefault(length, {})[t] = prof
            for v in allv:
                v.release(length)
                bound = bw * 1e9 / (v.bytes + v.kv_bytes(length))
                rows.setdefault(v.name, {})[f"decode@{length}"] = {"tok_s": med[v.name], "pct_bound": 100 * med[v.name] / bound}
            print(f"threads {t} depth {length}: " + ", ".join(f"{k} {x:.1f}" for k, x in med.items()), file=sys.stderr)
        if args.prefill > 0:
            ids = torch.randint(0, 49152, (1, args.prefill), generator=gen)
            med = interleaved(allv, lambda v: v.prefill(ids), max(3, args.repeats // 2))
            for v in allv:
                rows[v.name][f"prefill{args.prefill}"] = {"tok_s": med[v.name]}
        results["threads"][t] = rows
        cols = [f"decode@{n}" for n in lengths] + ([f"prefill{args.prefill}"] if args.prefill > 0 else [])
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
        if any("compiled" in v.name for v in variants):
            print("\ncompiled steps by path: " + ", ".join(
                f"{v.name} {getattr(v.lm.compiled, 'calls', None)}" for v in variants if "compiled" in v.name))
        if cpp:
            results.setdefault("vs_llamacpp", {})[t] = peer_table(rows, cols, [v.name for v in cpp], t)
        del cpp, variants, allv
    print_phases(results["phases"], results["bandwidth_gbs"])
    print("load time (s): " + ", ".join(f"{k} {x:.1f}" for k, x in results["load_s"].items()))
    if args.json:
        from attnlab.io import write_json
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
