"""Decode tok/s of one model under three decode steps in one process: eager, the native step, and a
git revision's torch.compile step (`attnlab/model/compiled.py` before it was removed), side by side.

One model, one process: every variant runs the same weights on its own cache per depth (prefilled
once, rolled back to the depth before each timed run); runs are interleaved (the order rotates every
repeat) and repeated, and medians are printed per thread count, with the CPU model and ISA flags.
The old step is imported from the revision's file and driven as that revision's engine did
(`cache.begin` with real RoPE tables, the network through it, `cache.advance`).

    python benchmarks/native_step.py --baseline 17d1d47 --lengths 128,1024 --threads 1,2 --repeats 5
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return f"{model}; {' '.join(isa)}"


def old_step(rev: str, model):
    """The revision's compiled DecodeStep class, built for model (None if the file is not there)."""
    src = subprocess.run(["git", "show", f"{rev}:attnlab/model/compiled.py"], cwd=ROOT, capture_output=True, text=True)
    if src.returncode:
        return None
    path = Path(tempfile.mkdtemp()) / "compiled_old.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location("compiled_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DecodeStep(model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="int4:32")
    p.add_argument("--kv", default="float16")
    p.add_argument("--baseline", default=None, help="git revision whose compiled step runs beside (e.g. 17d1d47)")
    p.add_argument("--lengths", default="128,1024")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import attnlab
    from attnlab.model.llama import Pass
    print(f"cpu: {cpu()}")
    lm = attnlab.load("smollm2-135m", quant=args.quant, kv_dtype=args.kv, tokenizer=False)
    thread_counts = [int(t) for t in args.threads.split(",")]
    natives = {t: lm.with_threads(t).compiled for t in thread_counts}  # the native step's team is the engine's
    old = old_step(args.baseline, lm.model) if args.baseline else None
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = torch.randint(0, lm.cfg.vocab_size, (1, max(lengths)), generator=torch.Generator().manual_seed(0))
    tok = torch.tensor([[7]])

    @torch.inference_mode()
    def old_forward(ids, cache):  # the revision's engine step around its compiled network
        step = cache.begin(1, lm.model.rope, real=True)
        old(ids, Pass(step.rot, step, cache.layers), False)
        cache.advance(1)

    def forward_with(step):
        def fwd(ids, cache):
            lm.compiled = step
            lm.forward(ids, cache)
        return fwd
    for threads in thread_counts:
        torch.set_num_threads(threads)  # the eager path's ops (a command line's edge)
        variants = {"eager": forward_with(None), "native": forward_with(natives[threads])}
        if old is not None:
            variants[f"compiled {args.baseline}"] = old_forward
        caches = {}
        for name, fwd in variants.items():
            for n in lengths:
                cache = caches[name, n] = lm.new_cache(capacity=n + args.steps + 1)
                lm.prefill(ids[:, :n], cache)
                t = time.perf_counter()
                for _ in range(3):  # warm-up (the old step compiles here)
                    fwd(tok, cache)
                if name.startswith("compiled") and threads == int(args.threads.split(",")[0]):
                    print(f"{name}: first steps at depth {n} {time.perf_counter() - t:.1f} s", flush=True)
        times: dict = {(name, n): [] for name in variants for n in lengths}
        order = list(variants)
        for r in range(args.repeats):
            order = order[1:] + order[:1]
            for n in lengths:
                for name in order:
                    cache = caches[name, n]
                    cache.truncate(n)
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        variants[name](tok, cache)
                    times[name, n].append(args.steps / (time.perf_counter() - t))
        print(f"\n### {threads} thread{'s' if threads > 1 else ''}: decode tok/s, median of {args.repeats} "
              f"(x eager; min-max)\n")
        print("| step | " + " | ".join(f"depth {n}" for n in lengths) + " |")
        print("|---|" + "---|" * len(lengths))
        for name in variants:
            cells = []
            for n in lengths:
                m, e = statistics.median(times[name, n]), statistics.median(times["eager", n])
                cells.append(f"{m:.1f} ({m / e:.2f}x; {min(times[name, n]):.1f}-{max(times[name, n]):.1f})")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
