"""A prompt's float matmuls: the weight dequantised into a reused buffer in one pass (`QuantLinear._float_weight`)
against torch's dequantisation into new tensors (what it replaced), and the integer kernel, per layer and rows;
then a whole prompt's prefill with each dequantisation.

Past `QuantLinear.fused_rows()` rows a layer multiplies its dequantised weight in float; how fast that weight is made
decides both a long prompt's prefill and where the integer kernel should stop (`BATCHED_MAX_ROWS`). Paths interleave
within every repeat (medians); one decoder layer's matmuls (its weights from cache, as in a prefill chunk). Prints the
CPU model and ISA flags; writes JSON + Markdown atomically.

    python benchmarks/prefill_dequant.py --model qwen2.5-coder-0.5b --rows 16,64,128,256,512 --threads 1,2
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

import attnlab  # noqa: E402
from attnlab.data import corpus  # noqa: E402
from attnlab.io import provenance, write_json, write_text  # noqa: E402
from attnlab.quant.linear import QuantLinear  # noqa: E402

PATHS = ("int", "buffer", "torch")  # integer kernel; float matmul of the buffer's weight; of torch's new tensor


def _leaves(mod: QuantLinear) -> list[QuantLinear]:
    return list(mod.parts) if mod.parts is not None else [mod]


def use(mods: list[QuantLinear], path: str | None) -> None:
    """Route every layer (each part of a layer of parts) along path; None restores the default rule and dequantisation."""
    for m in (leaf for mod in mods for leaf in _leaves(mod)):
        for name in ("max_rows", "_float_weight"):
            m.__dict__.pop(name, None)
        if path == "int":
            m.max_rows = 1 << 30
        elif path in ("buffer", "torch"):
            m.max_rows = 0
        if path in ("torch", "torch-default"):
            m._float_weight = lambda keep, m=m: m.dequantize()


def timed(fn, repeats: int = 1) -> float:
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return min(best)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default="16,64,128,256,512")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--layer", type=int, default=1, help="which decoder layer's matmuls")
    p.add_argument("--prompt", type=int, default=1024, help="prefill tokens (0: skip the whole prefill)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("docs/figures/quant/prefill-dequant"))
    args = p.parse_args(argv)
    print(llamacpp.header(), flush=True)
    lm = attnlab.load(args.model)
    net = lm.model
    layer = net.layers[args.layer]
    mats = {"wqkv": layer.attn.wqkv, "wo": layer.attn.wo, "w13": layer.mlp.w13, "w2": layer.mlp.w2}
    every = [m for m in net.modules() if isinstance(m, QuantLinear)]
    rows = [int(r) for r in args.rows.split(",")]
    record = {**provenance(None), "command": "python " + shlex.join(["benchmarks/prefill_dequant.py", *sys.argv[1:]]),
              "seed": 0, "cpu": llamacpp.header(), "model": args.model, "quant": lm.quant, "layers": [], "prefill": []}
    g = torch.Generator().manual_seed(0)
    lines = [f"# {args.model}: ms per call (medians of {args.repeats}), paths {', '.join(PATHS)}", ""]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for name, mod in mats.items():
            paths = ("int",) if any(leaf.repacked for leaf in _leaves(mod)) else PATHS  # repacked: the kernel at any M
            for m in rows:
                x = torch.randn(m, mod.in_features, generator=g)
                times = {path: [] for path in paths}
                for r in range(args.repeats):
                    for path in (paths if r % 2 == 0 else paths[::-1]):
                        use([mod], path)
                        mod(x)  # warm: the buffer grown, the weight in cache
                        times[path].append(timed(lambda: mod(x), 3) * 1e3)
                use([mod], None)
                cell = {"threads": threads, "matrix": name, "shape": [mod.out_features, mod.in_features], "rows": m,
                        "kind": f"{mod.kind}:{mod.group}", **{p_: statistics.median(t) for p_, t in times.items()}}
                record["layers"].append(cell)
                line = f"{threads}t {name} {cell['shape']} {cell['kind']} rows {m}: " + ", ".join(
                    f"{p_} {cell[p_]:.2f}" for p_ in paths)
                print(line, flush=True)
                lines.append("- " + line)
        if args.prompt:
            ids = torch.tensor([lm.encode(corpus("shakespeare:test"))[:args.prompt]])
            times = {"buffer": [], "torch": []}
            for r in range(args.repeats):
                for path in (("buffer", "torch") if r % 2 == 0 else ("torch", "buffer")):
                    use(every, None if path == "buffer" else "torch-default")
                    cache = lm.new_cache(capacity=args.prompt + 8)
                    times[path].append(timed(lambda: lm.prefill(ids, cache)))
            use(every, None)
            cell = {"threads": threads, "tokens": args.prompt,
                    **{f"{p_}_tok_s": args.prompt / statistics.median(t) for p_, t in times.items()}}
            record["prefill"].append(cell)
            line = (f"{threads}t prefill {args.prompt} tokens: buffer {cell['buffer_tok_s']:.1f} tok/s, torch "
                    f"{cell['torch_tok_s']:.1f} ({cell['buffer_tok_s'] / cell['torch_tok_s']:.2f}x)")
            print(line, flush=True)
            lines.append("- " + line)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "prefill_dequant.json", record)
    write_text(args.out / "prefill_dequant.md", "\n".join(lines + ["", f"`{record['command']}`", record["cpu"], ""]))


if __name__ == "__main__":
    main()
