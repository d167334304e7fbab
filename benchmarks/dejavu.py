"""Deja Vu decode speed: dense vs sparse plans, interleaved, plus the profile that says where a step goes.

1. `attnlab dejavu bench` for fp32 and int4:32 (batch 1, 1 thread, depth 128; tok/s medians of interleaved
   runs, MLP bytes read per token beside them).
2. A torch.profiler breakdown of one dense and one sparse step: time in the MLP (dense matmuls or the
   row-sparse ops + scoring + selection) against everything else (attention, LM head, norms, glue), which
   bounds what any MLP sparsity can gain (Amdahl).

    python benchmarks/dejavu.py --out runs/dejavu            # after `attnlab dejavu collect` and `train`
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
        total = sum(v for k, v in ops.items() if k != "mlp")
        mlp = next(e.cpu_time_total for e in prof.key_averages() if e.key == "mlp") / steps / 1e3
        res[name] = {"ms_per_token": total, "mlp_ms": mlp,
                     "top_ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10])}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/dejavu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
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
