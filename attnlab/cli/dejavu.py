"""`attnlab dejavu collect|train|eval|bench`: Deja Vu contextual sparsity on a real model.

    attnlab dejavu collect --out runs/dejavu          # activity on the training plays + concentration plot
    attnlab dejavu train --out runs/dejavu            # predictors (+ --lookahead) and gate thresholds
    attnlab dejavu calibrate --out runs/dejavu        # TEAL: input thresholds + greedy allocation (also cached)
    attnlab dejavu eval --out runs/dejavu             # perplexity vs sparsity on the test plays, recall
    attnlab dejavu bench --out runs/dejavu            # decode tok/s dense vs sparse, interleaved
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, load_lm, positive_int
from attnlab.eval.dejavu import SPARSITIES


def _ids(lm, text: str, tokens: int, what: str) -> list[int]:
    from attnlab.data import corpus
    ids = lm.encode(corpus(text))
    if len(ids) < tokens:
        raise UserError(f"{what}: {text!r} has only {len(ids)} tokens, {tokens} asked")
    return ids[:tokens]


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what} must be a comma list of numbers, got {text!r}") from None


def _activity(out: Path, name: str):
    from safetensors.torch import load_file
    path = out / f"{name}.safetensors"
    if not path.exists():
        raise UserError(f"no {path}: run `attnlab dejavu collect --out {out}` first")
    return load_file(str(path))


def _predictors(out: Path, required: bool = True) -> dict:
    from attnlab.sparsity.predictors import Predictors
    found = {}
    for name, file in (("predictor", "predictors.safetensors"), ("lookahead", "predictors-lookahead.safetensors")):
        if (out / file).exists():
            found[name] = Predictors.load(out / file)
    if not found and required:
        raise UserError(f"no predictors in {out}: run `attnlab dejavu train --out {out}` first")
    return found


def _teal(out: Path, lm, required: bool = False):
    """The TEAL calibration in out (from `calibrate`), else the model's cached one, else None (or an error)."""
    from attnlab.sparsity import teal
    if (out / "teal.safetensors").exists():
        return teal.Calibration.load(out / "teal.safetensors")
    path = teal.CACHE / f"{teal.fingerprint(lm.model)}.safetensors"
    if path.exists():
        return teal.Calibration.load(path)
    if required:
        raise UserError(f"no TEAL calibration in {out}: run `attnlab dejavu calibrate --out {out}` first")
    return None


def cmd_calibrate(args) -> int:
    from attnlab.io import progress, write_json
    from attnlab.sparsity import teal
    from attnlab.sparsity.plan import make_plan

    out = Path(args.out)
    lm = load_lm(args)
    ids = _ids(lm, args.text, args.tokens, "--text")
    with progress(-(-len(ids) // 1024) + lm.cfg.n_layers, "teal calibrate", unit="step") as bar:
        calib = teal.calibrate(lm, ids, greedy_tokens=args.greedy_tokens, max_sparsity=args.max_sparsity,
                               step=args.step, progress=bar.update)
    calib.save(out / "teal.safetensors")
    calib.save(teal.CACHE / f"{teal.fingerprint(lm.model)}.safetensors")  # what `--sparsity teal:S` finds
    held = _ids(lm, args.heldout, args.heldout_tokens, "--heldout")
    rows = []
    print(f"{'target':>6} {'held-out':>8}  " + "  ".join(f"{p:>5}" for p in teal.PROJ) + "  (mean allocation)")
    for s in _floats(args.check, "--check"):
        plan = make_plan("teal", s, 0.0, calib, sparse_exec=False).bind(lm.model)
        plan.prefill_sparse = True
        m = teal.measure(lm, plan, held)
        alloc = [sum(calib.allocation(i, s)[p] for i in range(lm.cfg.n_layers)) / lm.cfg.n_layers
                 for p in range(len(teal.PROJ))]
        rows.append({"target": s, "heldout": m, "mean_allocation": dict(zip(teal.PROJ, alloc))})
        print(f"{s:>6.0%} {m['model_wide']:>8.1%}  " + "  ".join(f"{a:>5.0%}" for a in alloc))
    write_json(out / "teal-check.json", {"text": args.text, "heldout": args.heldout, "tokens": len(held), "rows": rows})
    print(f"wrote {out / 'teal.safetensors'} (also cached for this model) and {out / 'teal-check.json'}")
    return 0


def cmd_collect(args) -> int:
    from safetensors.torch import save_file

    from attnlab.io import progress, write_atomic, write_json
    from attnlab.sparsity.collect import collect, concentration
    from attnlab.eval.dejavu import plot_concentration

    out = Path(args.out)
    lm = load_lm(args)
    for name, text, n in (("activity", args.text, args.tokens), ("heldout", args.heldout, args.heldout_tokens)):
        ids = _ids(lm, text, n, f"--{'text' if name == 'activity' else 'heldout'}")
        with progress(len(ids), f"collect {name}") as bar:
            data = collect(lm, ids, progress=bar.update)
        write_atomic(out / f"{name}.safetensors",
                     lambda tmp: save_file(data, tmp, metadata={"model": str(args.model), "text": text}))
        print(f"wrote {out / f'{name}.safetensors'} ({len(ids)} tokens of {text})")
    stats = concentration(lm, _ids(lm, args.text, min(args.tokens, 1024), "--text"))
    write_json(out / "concentration.json", stats)
    fig = plot_concentration(stats, out / "concentration.png",
                             f"How concentrated {Path(str(args.model)).name} is ({stats['tokens']} tokens of {args.text})")
    for r in stats["layers"]:
        print(f"layer {r['layer']:>2}: MLP output error keeping top 30% neurons {r['mlp'][0.3]:.3f}, "
              f"top 50% {r['mlp'][0.5]:.3f}")
    print(f"wrote {out / 'concentration.json'} and {fig}")
    return 0


def cmd_train(args) -> int:
    from attnlab.io import progress
    from attnlab.sparsity.predictors import train

    out = Path(args.out)
    data = _activity(out, "activity")
    lm = load_lm(args, tokenizer=False)
    for ahead in ((False, True) if args.lookahead else (False,)):
        with progress(lm.cfg.n_layers, "train" + (" look-ahead" if ahead else ""), unit="layer") as bar:
            pred = train(lm, data, rank=args.rank, lookahead=ahead, label_keep=args.label_keep, epochs=args.epochs,
                         seed=args.seed, progress=bar.update)
        path = out / ("predictors-lookahead.safetensors" if ahead else "predictors.safetensors")
        pred.save(path)
        print(f"wrote {path} (rank {args.rank}, {pred.nbytes / 2**10:.0f} KiB read per layer and token)")
    return 0


def cmd_eval(args) -> int:
    import sys

    from attnlab.io import finish_record, progress, run_record, write_json
    from attnlab.eval.dejavu import plot, predictor_quality, summary_line, sweep

    record = run_record(sys.argv[1:], None)  # nothing is sampled: no seed
    out = Path(args.out)
    lm = load_lm(args)
    calib = _teal(out, lm)
    preds = _predictors(out, required=calib is None)
    ids = _ids(lm, args.text, args.tokens, "--text")
    sparsities, heads = _floats(args.sparsities, "--sparsities"), [int(h) for h in _floats(args.heads, "--heads")]
    if any(not 0 < s < 1 for s in sparsities):
        raise UserError(f"--sparsities must be in (0, 1), got {args.sparsities}")
    quality = predictor_quality(lm, preds, _activity(out, "heldout")) if preds else None
    if quality:
        write_json(out / "quality.json", quality)
    n = 1 + len(sparsities) * (1 + (not args.quant) + (len(preds) + 1 if preds else 0) + (calib is not None)) \
        + len(heads) * (1 + len(preds))
    with progress(n, "dejavu eval", unit="run") as bar:
        rows = sweep(lm, preds, ids, out, sparsities=sparsities, head_keep=heads, window=args.window,
                     progress=bar.update, teal=calib,
                     key={"model": str(args.model), "quant": str(args.quant), "text": args.text})
    write_json(out / "eval.json", {**finish_record(record), **json.loads((out / "eval.json").read_text())})
    fig = plot(rows, quality, out / "ppl_vs_sparsity.png",
               f"{Path(str(args.model)).name}{' ' + str(args.quant) if args.quant else ''} on {args.text}, "
               f"{len(ids) - 1} tokens")
    print(f"{'method':<10} {'MLP':>5} {'heads':>6} {'ppl':>9}")
    for r in rows:
        print(f"{r['method']:<10} {r['sparsity']:>5.0%} {r['head_sparsity']:>6.0%} {r['ppl']:>9.3f}")
    for line in summary_line(rows):
        print(line)
    if calib is not None and args.decode_tokens:
        from attnlab.eval.dejavu import decode_quality
        from attnlab.sparsity.plan import make_plan
        plans = {"dense": None, **{f"teal {s:.0%}": make_plan("teal", s, 0.0, calib).bind(lm.model)
                                   for s in _floats(args.decode_sparsities, "--decode-sparsities")}}
        n = args.decode_tokens * (2 * len(plans) - 1)
        with progress(n, "decode quality") as bar:
            drows = decode_quality(lm, plans, ids[:512 + args.decode_tokens], prompt=512, progress=bar.update)
        write_json(out / "teal-decode.json", {**finish_record(record), "text": args.text, "prompt": 512, "rows": drows})
        print(f"decode path, {args.decode_tokens} tokens after a 512-token prompt (prefill dense vs sparse):")
        for r in drows:
            print(f"  {r['variant']:<10} prefill {r['prefill']:<6} ppl {r['ppl']:.3f}")
    for name, rec in (quality or {}).get("recall", {}).items():
        print(f"{name} recall at {quality['sparsity']:.0%}: mean {sum(rec) / len(rec):.3f}, "
              f"min {min(rec):.3f} (layer {rec.index(min(rec))})")
    if quality:
        ts = quality["threshold_sparsity"]
        print(f"threshold calibrated for {quality['sparsity']:.0%}: held-out {sum(ts) / len(ts):.1%} "
              f"(layers {min(ts):.1%}-{max(ts):.1%})")
    print(f"wrote {out / 'eval.json'}{', ' + str(out / 'quality.json') if quality else ''} and {fig}")
    return 0


def cmd_bench(args) -> int:
    import sys

    from attnlab.io import finish_record, progress, run_record, write_json
    from attnlab.sparsity.plan import make_plan, methods as all_methods
    from attnlab.sparsity.speed import decode_speed

    out = Path(args.out)
    record = run_record(sys.argv[1:], None)  # the command, commit and dirty flag (seed: none, nothing is sampled)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in all_methods()]
    if bad:
        raise UserError(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(all_methods())}")
    pred = None
    if {"threshold", "predictor"} & set(methods):
        preds = _predictors(out)
        pred = preds.get("predictor") or next(iter(preds.values()))
    lm = load_lm(args)
    calib = _teal(out, lm, required=True) if "teal" in methods else None
    ids = _ids(lm, args.text, args.depth + args.steps, "--text")
    if args.quant and "lowbit" in methods:
        methods.remove("lowbit")  # it scores with a 4-bit copy of float weights
    plans = {"dense": None}
    for s in _floats(args.sparsities, "--sparsities"):
        for m in methods:
            plans[f"{m} {s:.0%}"] = make_plan(m, s, 0.0, calib if m == "teal" else pred)
    with progress((args.repeats + 1) * len(plans), "dejavu bench", unit="run") as bar:
        rows = decode_speed(lm, plans, ids, depth=args.depth, steps=args.steps, repeats=args.repeats,
                            clock=args.clock, progress=bar.update)
    import torch
    weights = str(args.quant) if args.quant else "file" if args.dtype is None else {"float32": "fp32"}.get(args.dtype, args.dtype)
    meta = {"model": str(args.model), "quant": weights,
            "threads": torch.get_num_threads(), "depth": args.depth, "steps": args.steps, "repeats": args.repeats,
            "clock": args.clock, "load_average": os.getloadavg()[0]}
    name = f"bench-{meta['quant'].replace(':', '_')}{args.tag}.json"
    write_json(out / name, {**finish_record(record), **meta, "rows": rows})
    print(f"decode tok/s, batch 1, {meta['threads']} thread(s), {meta['quant']}, depth {args.depth}, "
          f"median of {args.repeats} interleaved runs of {args.steps} tokens ({args.clock} clock, "
          f"load average {meta['load_average']:.1f})")
    print(f"{'variant':<16} {'tok/s':>7} {'speedup':>8} {'MLP MiB/token':>14} {'proj MiB/token':>15}")
    for r in rows:
        print(f"{r['variant']:<16} {r['tok_s']:>7.1f} {r.get('speedup', 1):>7.2f}x {r['mlp_mib_per_token']:>14.1f} "
              f"{r['proj_mib_per_token']:>15.1f}")
    print(f"wrote {out / name}")
    print(json.dumps({**meta, "rows": rows}) if args.json else "", end="\n" if args.json else "")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("dejavu", help="Deja Vu contextual sparsity: collect, train, eval, bench")
    dv = p.add_subparsers(dest="dejavu_command", required=True, parser_class=type(p))

    def common(q, text="shakespeare:train", tokens=4096):
        add_model_args(q)
        q.set_defaults(dtype="float32")  # without --quant: the float model the method is about, not the file's packing
        q.add_argument("--out", default="runs/dejavu", help="folder for activity, predictors and results (default: %(default)s)")
        q.add_argument("--text", default=text, help="text (default: %(default)s)")
        if tokens:
            q.add_argument("--tokens", type=positive_int, default=tokens, help="tokens (default: %(default)s)")

    q = dv.add_parser("collect", help="per-token neuron and head activity of the dense model, and how concentrated it is")
    common(q)
    q.add_argument("--heldout", default="shakespeare:validation", help="held-out text for recall (default: %(default)s)")
    q.add_argument("--heldout-tokens", type=positive_int, default=1024, help="held-out tokens (default: %(default)s)")
    q.set_defaults(func=cmd_collect)

    q = dv.add_parser("train", help="low-rank neuron and head predictors per layer, and the gate thresholds")
    common(q)
    q.add_argument("--rank", type=positive_int, default=64, help="predictor rank (default: %(default)s)")
    q.add_argument("--label-keep", type=float, default=0.3, help="oracle share labelled active (default: %(default)s)")
    q.add_argument("--epochs", type=positive_int, default=8, help="passes over the collected tokens (default: %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="seed of the initialisation and batch order (default: %(default)s)")
    q.add_argument("--lookahead", action="store_true", help="also the look-ahead predictors (layer l-1's input)")
    q.set_defaults(func=cmd_train)

    q = dv.add_parser("calibrate", help="TEAL: thresholds of every projection input and the greedy allocation")
    common(q, tokens=4096)
    q.add_argument("--greedy-tokens", type=positive_int, default=64,
                   help="tokens each block's greedy allocation is scored on (default: %(default)s)")
    q.add_argument("--max-sparsity", type=float, default=0.8, help="highest model-wide target (default: %(default)s)")
    q.add_argument("--step", type=float, default=0.2, help="TEAL's base step (wo's; default: %(default)s)")
    q.add_argument("--heldout", default="shakespeare:validation", help="held-out text for the check (default: %(default)s)")
    q.add_argument("--heldout-tokens", type=positive_int, default=2048, help="held-out tokens (default: %(default)s)")
    q.add_argument("--check", default="0.3,0.4,0.5,0.6,0.7", help="targets checked on held-out text (default: %(default)s)")
    q.set_defaults(func=cmd_calibrate)

    q = dv.add_parser("eval", help="perplexity against MLP and head sparsity; predictor recall per layer")
    common(q, text="shakespeare:test", tokens=2048)
    q.add_argument("--window", type=positive_int, default=1024, help="evaluation window (default: %(default)s)")
    q.add_argument("--sparsities", default=",".join(str(s) for s in SPARSITIES[1:]),
                   help="MLP sparsities (default: %(default)s)")
    q.add_argument("--heads", default="8,6,4", help="query heads kept in the head-sparsity runs (default: %(default)s)")
    q.add_argument("--decode-tokens", type=int, default=256,
                   help="teal: tokens scored through the real decode step after a 512-token prompt, prefill dense "
                        "vs sparse (0: skip; default: %(default)s)")
    q.add_argument("--decode-sparsities", default="0.4,0.5", help="teal sparsities of that check (default: %(default)s)")
    q.set_defaults(func=cmd_eval)

    q = dv.add_parser("bench", help="batch-1 decode tok/s, dense vs sparse, interleaved runs")
    common(q, text="shakespeare:test", tokens=0)
    q.add_argument("--sparsities", default="0.3,0.5,0.7,0.9", help="MLP sparsities (default: %(default)s)")
    q.add_argument("--methods", default="lowbit,threshold,predictor",
                   help="comma list of oracle, lowbit, threshold, predictor, teal (default: %(default)s; lowbit only "
                        "on float weights)")
    q.add_argument("--tag", default="", help="suffix of the result file's name (bench-QUANT[TAG].json)")
    q.add_argument("--depth", type=positive_int, default=128, help="cache depth (default: %(default)s)")
    q.add_argument("--steps", type=positive_int, default=32, help="tokens per run (default: %(default)s)")
    q.add_argument("--repeats", type=positive_int, default=5, help="interleaved runs per variant (default: %(default)s)")
    q.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall time, or this thread's CPU time (steadier on a loaded machine)")
    q.add_argument("--json", action="store_true", help="also print the result as JSON")
    q.set_defaults(func=cmd_bench)
