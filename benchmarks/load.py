"""Loading a GGUF file: time to first token and peak RSS of a fresh process, ours beside llama.cpp's.

Each run is a new process (nothing cached in it but the OS's page cache, warm after the first run),
timed from its start to its exit: ours imports attnlab, runs `attnlab.LM.load` (tokenizer included,
as `attnlab generate` does) and one forward step on one token; llama.cpp's `llama-cli`/`llama-simple`
loads the file and generates one token. Peak RSS is the child's own high-water mark (`wait4`'s
ru_maxrss). Runs are interleaved (the order rotates every repeat) and medians are printed with the
ratio of TTFT to llama.cpp's and of peak RSS to the file's size, the goals being 2x and 1.3x. Our TTFT is
the wall time to the child's last line (the token computed), before the interpreter's exit, which torch's
teardown makes ~1 s (llama.cpp's whole process is its TTFT, an upper bound). Beside the
totals, each of ours is split into phases (interpreter start / import torch + attnlab.engine / weights:
`load_model` / tokenizer / first token / exit / other) with the peak RSS reached after import and after the
weights.

    python benchmarks/load.py                                  # the embedded SmolLM2 Q4_1 file
    python benchmarks/load.py --model ~/.cache/attnlab/bench/llama1b-q4_0.gguf --variants default
    python benchmarks/load.py --variants default,float32,int4:32 --repeats 5 --json load.json
    python benchmarks/load.py --attnlab /work/main,. --repeats 5     # two checkouts, interleaved
    python benchmarks/load.py --model qwen2.5-coder-0.5b --variants compiled --repeats 3   # the real 0.5B file

Variants: `default` (the file's own formats), `compiled` (the file's formats, `compile=True,
kv_dtype="float16"`: the native step built at load), `float32` (`--dtype float32`: every weight expanded,
the old default) and any `--quant` spec. `--model` also takes a fetched model's name (`attnlab fetch`). llama.cpp's binaries are looked for under build/llamacpp/*/bin of
this checkout (`make bench-llamacpp`) and ~/.cache/attnlab/llamacpp/build/*/bin, or given by --llamacpp.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, resource, sys, time
started = time.time()
t0 = time.perf_counter()
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
import torch
torch.set_num_threads({threads})
import attnlab.engine as engine
from attnlab.engine import LM
t1 = time.perf_counter()
phases = {{"import_s": t1 - t0, "import_peak_mib": peak()}}
def timed(name, fn):  # the engine's own calls, timed where LM.load makes them
    def run(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        phases[name + "_s"], phases[name + "_peak_mib"] = time.perf_counter() - start, peak()
        return out
    return run
engine.load_model = timed("weights", engine.load_model)
engine.load_tokenizer = timed("tokenizer", engine.load_tokenizer)
lm = LM.load({path!r}, **{options!r})
t2 = time.perf_counter()
with torch.inference_mode():
    bos = lm.cfg.bos_token_id if lm.cfg.bos_token_id is not None else 1
    logits = lm.forward(torch.tensor([[bos]]), lm.new_cache(capacity=16), last_only=True)
    token = int(logits[0, -1].argmax())
t3 = time.perf_counter()
print(json.dumps({{**phases, "load_s": t2 - t1, "token_s": t3 - t2, "token": token, "quant": lm.quant,
                  "transformers": "transformers" in sys.modules, "started": started, "done": time.time()}}))
"""

# Phases of a TTFT, in the order they happen (start: the interpreter up to the child's first line; exit: from
# its last line to the parent's wait4); "other" is the rest of the wall time (the rest of LM.load).
PHASES = ("start_s", "import_s", "weights_s", "tokenizer_s", "token_s", "exit_s")


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and the ISA flags that matter here."""
    from attnlab.kernels.isa import cpu_model, shown_flags
    return cpu_model(), shown_flags()


def spawn_measured(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, float, int, str]:
    """(wall seconds from start to exit, peak RSS in MiB, exit code, stdout) of a fresh process, reaped
    with wait4 so that ru_maxrss is this child's own peak."""
    import tempfile
    with tempfile.TemporaryFile("w+") as out:
        start, spawned = time.perf_counter(), time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall, ended = time.perf_counter() - start, time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        spawn_measured.last = (spawned, ended)
        return wall, usage.ru_maxrss / 1024, proc.returncode, out.read()


def llamacpp_binary(given: str | None) -> Path | None:
    """llama-cli or llama-simple: --llamacpp, else the builds of `make bench-llamacpp`."""
    if given:
        return Path(given)
    roots = [ROOT / "build" / "llamacpp", Path.home() / ".cache" / "attnlab" / "llamacpp" / "build"]
    for root in roots:
        for name in ("llama-cli", "llama-simple"):
            found = sorted(root.glob(f"*/bin/{name}"))
            if found:
                return found[0]
    return None


def llamacpp_cmd(binary: Path, model: Path, threads: int) -> list[str]:
    if binary.name == "llama-simple":  # no thread option: ggml's default count
        return [str(binary), "-m", str(model), "-n", "1", "Hello"]
    return [str(binary), "-m", str(model), "-t", str(threads), "-n", "1", "-p", "Hello", "-no-cnv",
            "--no-warmup", "-c", "512"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a .gguf file or the embedded model's name")
    p.add_argument("--variants", default="default,float32", help="comma list: default, float32, a --quant spec")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--llamacpp", default=None, help="path of llama-cli or llama-simple")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--attnlab", default=str(ROOT), help="comma list of checkouts whose attnlab is timed, "
                   "interleaved (default: this one; main's worktree beside this one gives a before/after)")
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    import shlex
    from attnlab.io import finish_record, run_record
    record = run_record(None, None, command="python " + shlex.join(["benchmarks/load.py", *sys.argv[1:]]))
    from attnlab.model.files import resolve
    path = resolve(args.model)
    size = path.stat().st_size / 2**20
    name, flags = cpu()
    print(f"CPU: {name}; flags: {' '.join(flags)}; {os.cpu_count()} CPUs; threads: {args.threads}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine: see the spread)")
    print(f"file: {path} ({size:.1f} MiB)")

    checkouts = [c.strip() for c in args.attnlab.split(",") if c.strip()]
    cmds, envs = {}, {}
    for checkout in checkouts:
        tag = "" if len(checkouts) == 1 else f" [{Path(checkout).name}]"
        print(f"attnlab{tag} from {checkout}")
        for v in [v.strip() for v in args.variants.split(",") if v.strip()]:
            options = ({} if v == "default" else {"dtype": v} if v in ("float32", "bfloat16")
                       else {"compile": True, "kv_dtype": "float16"} if v == "compiled" else {"quant": v})
            k = f"attnlab {v}{tag}"
            cmds[k] = [sys.executable, "-c", CHILD.format(threads=args.threads, path=str(path), options=options)]
            envs[k] = (dict(os.environ, PYTHONPATH=checkout + os.pathsep + os.environ.get("PYTHONPATH", "")), checkout)
    binary = None if args.no_llamacpp else llamacpp_binary(args.llamacpp)
    if binary is not None and binary.exists():
        cmds[f"llama.cpp {binary.name}"] = llamacpp_cmd(binary, path, args.threads)
    elif not args.no_llamacpp:
        print("llama.cpp: missing (no llama-cli/llama-simple under build/llamacpp/*/bin; run `make bench-llamacpp` "
              "or pass --llamacpp)")

    runs = {k: [] for k in cmds}
    names = list(cmds)
    for r in range(args.repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            env, cwd = envs.get(k, (None, None))
            wall, peak, rc, out = spawn_measured(cmds[k], env, cwd=cwd)  # `python -c` imports from its cwd
            if rc != 0:
                print(f"{k}: exit status {rc}; output tail: {out[-400:]!r}")
                runs.pop(k, None)
                names.remove(k)
                break
            inner = json.loads(out.strip().splitlines()[-1]) if k.startswith("attnlab") else {}
            if "started" in inner:  # wall clock: the interpreter's start (to the child's first line) and exit
                spawned, ended = spawn_measured.last
                inner["start_s"], inner["exit_s"] = inner.pop("started") - spawned, ended - inner.pop("done")
            runs[k].append({"ttft_s": wall, "peak_rss_mib": peak, **inner})
            print(f"  run {r + 1} {k}: {wall:.2f} s, peak RSS {peak:.0f} MiB", file=sys.stderr)

    peer = {key: statistics.median(x[key] for x in v) for k, v in runs.items() if k.startswith("llama") and v
            for key in ("ttft_s", "peak_rss_mib")}
    print(f"\n| engine | first token s (median of {args.repeats}) | process s (start to exit) | "
          f"start / import / weights / tokenizer / first token / exit / other s | "
          f"peak RSS MiB (after import / weights) | RSS / file | TTFT / llama.cpp | RSS / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for k, v in runs.items():
        if not v:
            continue
        for x in v:  # ours: the first token is out before the interpreter's exit (torch's teardown, ~1 s)
            x["first_token_s"] = x["ttft_s"] - x.get("exit_s", 0.0)
        med = {key: statistics.median(x[key] for x in v) for key in v[0] if key.endswith(("_s", "_mib"))}
        parts = "-"
        if "weights_s" in med:
            other = med["ttft_s"] - sum(med.get(x, 0.0) for x in PHASES)
            parts = " / ".join(f"{med.get(x, 0.0):.2f}" for x in PHASES) + f" / {other:.2f}"
        rss = f"{med['peak_rss_mib']:.0f}" + (f" ({med['import_peak_mib']:.0f} / {med['weights_peak_mib']:.0f})"
                                              if "weights_peak_mib" in med else "")
        vs = [f"{med[x] / peer[y]:.2f}x" if y in peer else "-" for x, y in (("first_token_s", "ttft_s"),
                                                                              ("peak_rss_mib", "peak_rss_mib"))]
        print(f"| {k} | {med['first_token_s']:.2f} | {med['ttft_s']:.2f} | {parts} | {rss} | "
              f"{med['peak_rss_mib'] / size:.2f}x | {vs[0]} | {vs[1]} |")
        summary[k] = med
    print("goals (issue 28): TTFT <= 2x llama.cpp's, peak RSS <= 1.3x the file. TTFT / llama.cpp: our first token "
          "against llama.cpp's whole process (its exit is quick); 'other' = the rest of LM.load")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        from attnlab.io import write_json
        write_json(args.json, {**finish_record(record), "cpu": name, "flags": flags, "threads": args.threads, "file": str(path),
                               "file_mib": size, "runs": runs, "medians": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
