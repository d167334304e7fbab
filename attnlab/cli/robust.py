"""`attnlab attack` (GCG adversarial suffixes on the shipped benign pairs) and `attnlab guard` (the perplexity
filter on a file of prompts; `--calibrate`: its threshold, false positives, detection rate and SmoothLLM; its cost
beside a reply is benchmarks/guard_cost.py's).

`attnlab guard` exits 0 when no prompt is flagged, 1 when some are (as grep does), 2 on a user error."""
from __future__ import annotations

import json
from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, load_lm, positive_int
from attnlab.io import progress, provenance, write_json


def _float_models(args):
    """The eager float networks of the same file: the gradient's (packed weights have no backward) and the
    candidates' scorer's (None: the file's engine scores); one load where the two dtypes agree."""
    from attnlab.engine import LM
    from attnlab.io import status
    from attnlab.options import Options
    loaded = {}
    for dtype in {args.grad_dtype, args.score_dtype} - {"file"}:
        with status(f"loading {args.model} as {dtype}"):
            lm = LM.load(args.model, Options(dtype=dtype, compile=False, threads=args.threads),
                         tokenizer=False)
        lm.model.requires_grad_(False)
        loaded[dtype] = lm.model
    return loaded[args.grad_dtype], loaded.get(args.score_dtype)


def cmd_attack(args) -> int:
    from attnlab.robust import attention_share as share
    from attnlab.robust.gcg import GCG, GCGConfig, allowed_tokens, initial_suffix, make_case
    from attnlab.robust.pairs import pairs

    record = provenance(args.argv)
    cfg = GCGConfig(args.length, args.steps, args.batch, args.topk, args.tokens, args.fluent_top, args.seed,
                    args.chunk)
    chosen = pairs(args.pairs)
    out = Path(args.out)
    args.resume_hint = f"run the same command again to continue from {out}"
    engine = load_lm(args)
    model, scorer = _float_models(args)
    allowed = allowed_tokens(engine.tokenizer, engine.cfg.vocab_size, "punct" if cfg.tokens == "punct" else "all")
    init = initial_suffix(engine.tokenizer, cfg.length)
    results = []
    with progress(len(chosen) * cfg.steps, "attack", unit="step") as bar:
        for i, prompt, target in chosen:
            case = make_case(engine, prompt, target)
            ident = {"model": str(args.model), "quant": engine.quant}
            if scorer is not None:
                ident["score_dtype"] = args.score_dtype
            if args.grad_dtype != "float32":
                ident["grad_dtype"] = args.grad_dtype
            attack = GCG(engine, model, case, cfg, allowed, init, ident, scorer)
            res = attack.run(out / f"pair-{i:02d}.state.json", bar)
            rand = share.random_suffix(allowed, cfg.length, cfg.seed + i)
            res.update(pair=i, prompt=prompt, target=target, tokens=cfg.tokens,
                       share=share.suffix_share(engine, case, res["suffix_ids"]),
                       random_share=share.suffix_share(engine, case, rand))
            results.append(res)
    n = len(results)
    summary = {"pairs": n, "success": sum(r["success"] for r in results) / n,
               "success_by_step": [sum(r["success_by_step"][s] for r in results) / n for s in range(cfg.steps)],
               "seconds_per_step": sum(r["seconds_per_step"] for r in results) / n}
    write_json(out / "attack.json", {**record, "seed": cfg.seed, "model": str(args.model), "quant": engine.quant,
                                     "score_dtype": args.score_dtype, "grad_dtype": args.grad_dtype,
                                     "threads": args.threads, "config": cfg.__dict__, "summary": summary,
                                     "results": results})
    _plots(results, out, f"GCG on {args.model} ({cfg.tokens} tokens, L={cfg.length}, B={cfg.batch}, k={cfg.topk})")
    if args.json:
        print(json.dumps({"summary": summary, "results": results}))
        return 0
    print(f"{'pair':>4} {'loss0':>6} {'loss':>6} {'ok':>3} {'first':>5}  suffix")
    for r in results:
        print(f"{r['pair']:>4} {r['initial_loss']:>6.2f} {r['loss']:>6.2f} {'yes' if r['success'] else 'no':>3} "
              f"{r['first_success'] or '-':>5}  {r['suffix']!r}")
    print(f"success {summary['success']:.0%} of {n} pairs after {cfg.steps} steps; "
          f"{summary['seconds_per_step']:.2f} s a step; wrote {out}/attack.json, loss.png, attention.png")
    return 0


def _plots(results: list[dict], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnlab.io import save_figure
    from attnlab.robust.attention_share import plot
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for r in results:
        ax.plot(range(len(r["losses"]) + 1), [r["initial_loss"], *r["losses"]], lw=1, alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("target loss (nats/token)")
    ax.set_title(title, fontsize=10)
    save_figure(fig, out / "loss.png")
    plot([r["share"] for r in results], [r["random_share"] for r in results], out / "attention.png",
         "attention at the reply's first position: suffix share")


def _read_prompts(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no such prompts file: {path}")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        try:
            rows = [json.loads(line) for line in lines]
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not JSON lines: {e}") from None
        lines = [r if isinstance(r, str) else r.get("text", r.get("prompt")) if isinstance(r, dict) else None
                 for r in rows]
        if any(not isinstance(t, str) for t in lines):
            raise UserError(f"{path}: each line must be a JSON string or an object with a 'text' field")
    if not lines:
        raise UserError(f"{path} holds no prompt")
    return lines


def cmd_guard(args) -> int:
    from attnlab.robust.defenses import Guard
    if args.calibrate:
        return _calibrate(args)
    if not args.prompts:
        raise UserError("give --prompts FILE (one prompt a line, or .jsonl), or --calibrate")
    prompts = _read_prompts(args.prompts)
    spec = Guard.parse(args.guard)
    filt = spec.build(load_lm(args), args.context)
    rows = [{"index": i, "text": t, **filt.check(t).as_dict()} for i, t in enumerate(prompts)]
    flagged = sum(r["flagged"] for r in rows)
    if args.json:
        print(json.dumps({**provenance(args.argv), "threshold": filt.threshold, "window": filt.window,
                          "context": filt.context,
                          "flagged": flagged, "prompts": rows}))
    else:
        for r in rows:
            print(f"{'FLAG' if r['flagged'] else 'ok  '} {r['score']:6.2f}  {r['text'][:100]!r}")
        print(f"{flagged} of {len(rows)} flagged (windowed NLL > {filt.threshold:g} nats/token)")
    return 1 if flagged else 0


def _calibrate(args) -> int:
    from attnlab.robust import evaluate as ev
    from attnlab.robust.defenses import WINDOW, PerplexityFilter
    from attnlab.robust.pairs import ordinary_prompts

    record = provenance(args.argv)
    lm = load_lm(args)
    rows = ordinary_prompts(lm.encode, seed=args.seed)
    filt = PerplexityFilter(lm, 0.0, WINDOW, args.context)
    with progress(len(rows), "ordinary prompts", unit="prompt") as bar:
        cal = ev.calibrate(filt, rows, args.quantile, args.seed, bar)
    result = {**record, "seed": args.seed, "model": str(args.model), "window": WINDOW, "context": args.context,
              "calibration": cal}
    print(f"threshold {cal['threshold']:g} nats/token ({WINDOW}-token windows, quantile {args.quantile} of "
          f"{cal['fit_prompts']} prompts); false positives {cal['false_positive_rate']:.2%} of {cal['held_out']} held out")
    attacked, runs = [], []
    for path in args.attacks or []:
        data = json.loads(Path(path).read_text())
        peer = "nanogcg" in data  # the peer's JSON: final suffixes only, no state files
        attacked += ev.attacked_prompts(data["results"], "nanogcg" if peer else None)
        runs += [] if peer else [path]
    if attacked:
        result["detection"] = {v: ev.detection(filt, [p for p in attacked if p["variant"] == v])
                               for v in sorted({p["variant"] for p in attacked})}
        steps = [p for path in runs for p in ev.step_prompts(path, lm.tokenizer.decode)]
        result["detection_by_step"] = {f"{v}@{n}": ev.detection(filt, [p for p in steps if p["variant"] == v
                                                                       and p["step"] == n])
                                       for v, n in sorted({(p["variant"], p["step"]) for p in steps})}
        for v, d in {**result["detection"], **result["detection_by_step"]}.items():
            print(f"{v} suffixes: {d['flagged']} of {d['prompts']} flagged ({d['rate']:.0%}); of the successful "
                  f"ones {d['successful_flagged']} of {d['successful']}")
        if args.smoothllm:
            copies, _, rate = args.smoothllm.partition(":")
            result["smoothllm"] = ev.smooth_eval(lm, attacked, int(copies), float(rate or 0.1), args.seed)
            s = result["smoothllm"]
            print(f"SmoothLLM N={s['copies']} q={s['rate']:g}: attack success {s['success_without']:.0%} -> "
                  f"{s['success_after']:.0%} over {s['prompts']} found suffixes, "
                  f"{s['model_calls_per_prompt']:.0f} model calls a prompt")
    if args.out:
        write_json(args.out, result)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("attack", help="GCG adversarial suffixes on the shipped benign prompt/target pairs")
    add_model_args(p)
    p.add_argument("--pairs", default="all", help="'all', N (the first N) or A-B of the 20 shipped pairs")
    p.add_argument("--steps", type=positive_int, default=50, help="GCG steps per pair")
    p.add_argument("--batch", type=positive_int, default=128, help="candidates a step (B)")
    p.add_argument("--topk", type=positive_int, default=64, help="tokens kept per suffix position (k)")
    p.add_argument("--length", type=positive_int, default=20, help="suffix tokens (L)")
    p.add_argument("--tokens", default="all", choices=["all", "punct", "fluent"],
                   help="candidate tokens: printable ASCII, whitespace/punctuation only, or the model's own top "
                        "--fluent-top next tokens at each position (the subtler variants)")
    p.add_argument("--fluent-top", type=positive_int, default=100, help="fluent: next tokens kept per position")
    p.add_argument("--chunk", type=positive_int, default=32, help="candidate rows per engine pass")
    p.add_argument("--score-dtype", default="bfloat16", choices=["bfloat16", "float32", "file"],
                   help="weights that score the candidates: bfloat16 (AMX tiles where the CPU has them), float32, or "
                        "the file's engine (packed; a [B, T] batch expands them to float32); the success check "
                        "always runs on the file's engine")
    p.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights of the gradient pass (the eager network)")
    p.add_argument("--seed", type=int, default=0, help="seed of the candidate draws")
    p.add_argument("--out", default="runs/attack", help="folder: a state file per pair (resumable), attack.json, "
                                                         "loss.png, attention.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_attack)

    g = sub.add_parser("guard", help="flag prompts carrying adversarial suffixes (perplexity filter)")
    add_model_args(g)
    g.add_argument("--prompts", default=None, metavar="FILE", help="one prompt a line, or .jsonl (strings or "
                                                                    "objects with 'text')")
    g.add_argument("--guard", default="ppl", metavar="ppl[:THRESHOLD[:TEXT_THRESHOLD]]",
                   help="the filter: windowed NLL in nats/token (ppl: the model's calibrated threshold)")
    g.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    g.add_argument("--calibrate", action="store_true",
                   help="measure instead: the threshold on ordinary prompts (plays, chat, RULER) and its "
                        "false positives; with --attacks, detection and SmoothLLM")
    g.add_argument("--attacks", nargs="*", metavar="ATTACK_JSON", help="`attnlab attack` results (or a nanogcg.json of benchmarks/nanogcg_anchor.py) to detect")
    g.add_argument("--context", default="chat", choices=("chat", "text"), help="where the prompt is scored: as a user "
                   "message in the chat template (chat requests) or alone (raw completion prompts)")
    g.add_argument("--quantile", type=float, default=0.995, help="calibration: the threshold's quantile")
    g.add_argument("--smoothllm", default=None, metavar="N[:Q]", help="calibration: SmoothLLM with N copies, Q "
                                                                     "of the characters swapped (default 0.1)")
    g.add_argument("--seed", type=int, default=0, help="seed of the calibration split and SmoothLLM")
    g.add_argument("--out", default=None, help="calibration: write the JSON result here")
    g.set_defaults(func=cmd_guard)
