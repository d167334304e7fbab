"""Deja Vu and TEAL decode speed: dense vs sparse plans, interleaved, plus the profile that says where a step goes.

1. `attnlab dejavu bench` for fp32 and int4:32 (batch 1, 1 thread, depth 128; tok/s medians of interleaved
   runs, MLP bytes read per token beside them).
2. A torch.profiler breakdown of one dense and one sparse step: time in the MLP (dense matmuls or the
   row-sparse ops + scoring + selection) against everything else (attention, LM head, norms, glue), which
   bounds what any MLP sparsity can gain (Amdahl).
With --teal: the TEAL grid instead, each cell one interleaved run of dense and teal at 30/40/50%: fp32 and
int4:32 x 1 and 2 threads x cache depth 128 and 1024, then the profile of dense and teal 40% per format.

    python benchmarks/dejavu.py --out runs/dejavu            # after `attnlab dejavu collect` and `train`
    python benchmarks/dejavu.py --out runs/dejavu --teal     # after `attnlab dejavu calibrate`
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch


def _label(module, name: str) -> None:
    """Mark module's forward as `name` in the profile (forward hooks: the model itself is untouched)."""
    spans = []
    module.register_forward_pre_hook(lambda m, a: spans.append(torch.profiler.record_function(name).__enter__()))
    module.register_forward_hook(lambda m, a, out: spans.pop().__exit__(None, None, None))


def profile(quant: str | None, spec: str, out: Path, steps: int = 10) -> dict:
    """Self CPU time per step: dense vs the sparse plan `spec`, split into MLP and the rest."""
    import torch.profiler
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import attnlab
    from attnlab.sparsity.plan import plan_from_spec
    torch.set_num_threads(1)
    lm = attnlab.LM.load("smollm2-135m", quant=quant, tokenizer=True)
    ids = torch.tensor(lm.encode(open(__file__).read()))[:128 + steps + 3]
    plan = plan_from_spec(spec.replace("PATH", str(out)), lm.model)
    for layer in lm.model.layers:  # label the MLP (dense or sparse, selection included) in the profile
        _label(layer.mlp, "mlp")
        _label(layer.attn, "attn")
    res = {}
    for name, p in (("dense", None), (spec, plan)):
        lm = lm.with_sparsity(p)
        cache = lm.new_cache(capacity=len(ids) + 1)
        with torch.inference_mode():
            lm.prefill(ids[None, :128], cache)
            for j in range(3):
                lm.forward(ids[None, 128 + j:129 + j], cache)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for j in range(3, 3 + steps):
                    lm.forward(ids[None, 128 + j:129 + j], cache)
        ops = {e.key: e.self_cpu_time_total / steps / 1e3 for e in prof.key_averages()}
        total = sum(v for k, v in ops.items() if k not in ("mlp", "attn"))
        mlp = next(e.cpu_time_total for e in prof.key_averages() if e.key == "mlp") / steps / 1e3
        attn = next(e.cpu_time_total for e in prof.key_averages() if e.key == "attn") / steps / 1e3
        res[name] = {"ms_per_token": total, "mlp_ms": mlp, "attn_ms": attn,
                     "top_ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])}
    return res


def teal_grid(out: Path, repeats: int, clock: str) -> None:
    """Dense vs teal 30/40/50% per (format, threads, depth): one interleaved `dejavu bench` run per cell."""
    cells = []
    for quant in (None, "int4:32"):
        for threads in (1, 2):
            for depth in (128, 1024):
                tag = f"-teal-t{threads}-d{depth}"
                cmd = [sys.executable, "-m", "attnlab", "dejavu", "bench", "--out", str(out), "--threads", str(threads),
                       "--methods", "teal", "--sparsities", "0.3,0.4,0.5", "--depth", str(depth), "--repeats",
                       str(repeats), "--clock", clock, f"--tag={tag}"]
                subprocess.run(cmd + (["--quant", quant] if quant else []), check=True)
                fmt = (quant or "fp32").replace(":", "_")
                cells.append(json.loads((out / f"bench-{fmt}{tag}.json").read_text()))
    print(f"\n{'format':<8} {'threads':>7} {'depth':>5} {'dense tok/s':>11}   teal 30% / 40% / 50% (speedup)   load")
    for c in cells:
        r = {row["variant"]: row for row in c["rows"]}
        sp = " / ".join(f"{r[f'teal {s}%']['speedup']:.2f}x" for s in (30, 40, 50))
        print(f"{c['quant']:<8} {c['threads']:>7} {c['depth']:>5} {r['dense']['tok_s']:>11.1f}   {sp:<31} "
              f"{c['load_average']:.1f}")
    (out / "bench-teal.json").write_text(json.dumps(cells, indent=2) + "\n")


def ops_bench(threads: int = 1) -> list[dict]:
    """Per projection of SmolLM2 (batch 1): dense fp32 (F.linear) and int4 (q4_mm) against the column-sparse
    ops at 0/30/40/50% of the channels dropped. This thread's CPU time, best of 5 x 200 calls (steady on a
    loaded machine; weights warm in cache, so this is the arithmetic, not DRAM)."""
    import time

    import torch.nn.functional as F

    from attnlab.kernels import ops
    from attnlab.quant import QuantSpec
    from attnlab.quant.kinds import FLOAT32
    from attnlab.quant.linear import QuantLinear
    from attnlab.sparsity.columns import _own
    ops.load()
    torch.set_num_threads(threads)

    def t(f, n=200):
        f()
        best = 1e9
        for _ in range(5):
            s = time.thread_time()
            for _ in range(n):
                f()
            best = min(best, (time.thread_time() - s) / n)
        return best * 1e6
    rows = []
    for name, K, N in (("wqkv", 576, 960), ("wo", 576, 576), ("w13", 576, 3072), ("w2", 1536, 576)):
        g = torch.Generator().manual_seed(K + N)
        W, x = torch.randn(N, K, generator=g), torch.randn(1, K, generator=g)
        p = QuantSpec.parse("int4:32").quantize(W)
        WT, piece = W.T.contiguous(), _own(p, 0)  # the column layout in the weight's own groups
        op, operands = QuantLinear(p).kernel()  # the dense kernel the native step calls (repacked where it repacks)
        dense = getattr(torch.ops.attnlab, op)
        row = {"proj": name, "K": K, "N": N, "f32_dense_us": t(lambda: F.linear(x, W)),
               "q4_dense_us": t(lambda: dense(x, *operands)), "q4_dense_op": op}
        for sp in (0.0, 0.3, 0.4, 0.5):
            tau = float(x.abs().quantile(sp)) if sp else -1.0
            row[f"f32_cols_{sp:.0%}_us"] = t(lambda: ops.cols_mv(FLOAT32, x[0], tau, (WT,)))
            row[f"q4_cols_{sp:.0%}_us"] = t(lambda: piece.mv(x[0], tau))
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/dejavu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--teal", action="store_true", help="the TEAL grid (formats x threads x depths) and its profile")
    p.add_argument("--ops", action="store_true", help="TEAL's column ops against dense matmuls, per projection")
    args = p.parse_args()
    out = Path(args.out)
    if args.ops:
        out.mkdir(parents=True, exist_ok=True)
        from attnlab.io import finish_record, run_record, write_json
        record = run_record(None, None, "python " + " ".join(["benchmarks/dejavu.py", *sys.argv[1:]]))
        write_json(out / "ops-teal.json", {**finish_record(record), "rows": ops_bench()})
        return 0
    if args.teal:
        if not args.skip_bench:
            teal_grid(out, args.repeats, args.clock)
        prof = {}
        for quant in (None, "int4:32"):
            r = profile(quant, "teal@PATH:0.4", out)
            prof[f"{quant or 'fp32'} teal 40%"] = r
            for name, v in r.items():
                print(f"{quant or 'fp32':<8} {name:<16} {v['ms_per_token']:6.1f} ms/token (profiled CPU time), "
                      f"attention block {v['attn_ms']:5.1f} ms, MLP {v['mlp_ms']:5.1f} ms; top ops "
                      + ", ".join(f"{k} {t:.2f}" for k, t in list(v["top_ops_ms"].items())[:5]))
        (out / "profile-teal.json").write_text(json.dumps(prof, indent=2) + "\n")
        print(f"wrote {out / 'profile-teal.json'}")
        return 0
    if not args.skip_bench:
        for quant, sparsities in ((None, "0.3,0.5,0.55,0.7,0.9"), ("int4:32", "0.3,0.5,0.7,0.9")):
            cmd = [sys.executable, "-m", "attnlab", "dejavu", "bench", "--out", str(out), "--threads", "1",
                   "--sparsities", sparsities, "--repeats", str(args.repeats), "--clock", args.clock]
            subprocess.run(cmd + (["--quant", quant] if quant else []), check=True)
    prof = {}
    for quant, spec in ((None, "lowbit:0.5"), (None, "PATH:0.9"), ("int4:32", "threshold@PATH:0.5")):
        r = profile(quant, spec, out)
        prof[f"{quant or 'fp32'} {spec}"] = r
        for name, v in r.items():
            share = v["mlp_ms"] / v["ms_per_token"]
            print(f"{quant or 'fp32':<8} {name:<20} {v['ms_per_token']:6.1f} ms/token (profiled CPU time), "
                  f"MLP {v['mlp_ms']:5.1f} ms ({share:.0%})")
    (out / "profile.json").write_text(json.dumps(prof, indent=2) + "\n")
    print(f"wrote {out / 'profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
