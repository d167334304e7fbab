"""`attnlab ruler`: RULER's synthetic long-context tasks under every KV policy at several compression
ratios (the kvpress table and figure), resumable: rerun the same command to continue."""
from __future__ import annotations

import json
from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, add_sparsity_arg, load_lm, nonneg_int, positive_int
from attnlab.cli.stream import _slug, policy_list, run_identity
from attnlab.io import finish_record, progress, run_record, write_json, write_text


def _list(text: str, kind, what: str) -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{what} must be a comma list, got {text!r}") from None
    if not values:
        raise UserError(f"--{what} is empty")
    return values


def _command(args, tasks, lengths, policies, ratios) -> str:
    """The command line that reproduces this run (every option that changes the numbers spelled out)."""
    parts = ["attnlab ruler", str(args.model), "--tasks", ",".join(tasks), "--lengths", ",".join(map(str, lengths)),
             "--policies", ",".join(policies), "--ratios", ",".join(f"{r:g}" for r in ratios), "--samples",
             str(args.samples), "--seed", str(args.seed), "--haystack", args.haystack, "--chunk", str(args.chunk),
             "--positions", args.positions, "--n-sink", str(args.n_sink)]
    if args.presses:
        parts += ["--presses", args.presses, "--question", args.question]
    for opt in ("quant", "kv_dtype", "rope", "sparsity", "attention"):
        if getattr(args, opt, None) is not None:
            parts += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    if args.dtype is not None:
        parts += ["--dtype", args.dtype]
    return " ".join(parts)


def cmd_ruler(args) -> int:
    from attnlab.eval.ruler import TASKS
    from attnlab.eval.ruler_run import (PRESS, build_cell_policy, build_cell_press, cells, full_by_task, plan, plot,
                                        run_ruler, table)

    tasks = list(TASKS) if args.tasks == "all" else _list(args.tasks, str, "tasks")
    for t in tasks:
        if t not in TASKS:
            raise UserError(f"unknown RULER task {t!r}; choose from {', '.join(TASKS)} or all")
    lengths = _list(args.lengths, int, "lengths")
    if any(n < 512 for n in lengths):
        raise UserError("--lengths must be at least 512 tokens each (the list tasks need room)")
    ratios = _list(args.ratios, float, "ratios")
    if any(not 0 < r < 1 for r in ratios):
        raise UserError("--ratios must be in (0, 1): the share of the prompt's KV pairs dropped")
    policies = [p for p in policy_list(args.policies) if p != "full"] if args.policies else []
    presses = _list(args.presses, str, "presses") if args.presses else []
    for p in presses:
        build_cell_press(PRESS + p, ratios[0])  # unknown names fail before the model load
    policies += [PRESS + p for p in presses]
    for p in policies:  # every budget is valid before the model load
        for n in lengths:
            for r in ratios:
                build_cell_policy(p, n, r, args.chunk, args.positions, args.n_sink)
    if args.haystack not in ("plays", "noise"):
        raise UserError(f"--haystack must be plays or noise, got {args.haystack!r}")
    out = Path(args.out) if args.out else Path("runs") / "ruler" / _slug(Path(str(args.model)).name)
    args.tokens, args.streams, args.offset, args.text = 0, 0, 0, "ruler"
    identity = run_identity(args, "")
    record = run_record(None, args.seed, command=_command(args, tasks, lengths, policies, ratios))  # this session's code
    with progress(len(plan(lengths, policies, ratios, args.samples)), "ruler", unit="unit") as bar:
        units = run_ruler(lambda: load_lm(args), tasks, lengths, policies, ratios, args.samples, out, identity, args.seed, args.haystack,
                          args.chunk, args.positions, args.n_sink, args.force, bar.update, compute=not args.table_only,
                          question=args.question)
    if not units:
        raise UserError(f"no finished units in {out} for these options")
    rows = cells(units)
    seconds = sum(u["seconds"] for u in units)
    record = finish_record(record)  # units resumed from an earlier session ran that session's code: see each unit
    summary = {**{k: record[k] for k in ("command", "commit", "dirty", "started", "wall_s")},
               "model": str(args.model), "tasks": tasks,
               "units_done": len(units), "units_planned": len(plan(lengths, policies, ratios, args.samples)),
               "lengths": lengths, "policies": ["full"] + policies, "ratios": ratios, "samples": args.samples,
               "seed": args.seed, "haystack": args.haystack, "chunk": args.chunk, "positions": args.positions,
               "question": args.question if presses else None,
               "unit_wall_seconds": seconds, "cells": rows}
    write_json(out / "summary.json", summary)
    cut = "" if len(units) == summary["units_planned"] else \
        f"; cut short: {len(units)} of {summary['units_planned']} units done, a cell's sample count is its own"
    text = (f"RULER on {args.model}: {len(tasks)} tasks x {len(lengths)} lengths, {args.samples} sample(s) per cell "
            f"(seed {args.seed}), haystack {args.haystack}, score = % of expected answers found (RULER's "
            f"string_match_all); RULER's QA tasks are left out (they need downloaded datasets){cut}\n\n"
            f"{table(rows)}\n\nfull cache (the control) per task and length:\n{full_by_task(rows)}\n")
    write_text(out / "table.txt", text)
    plot(rows, out / "ruler.png", title=f"RULER on {Path(str(args.model)).name}, {args.samples} sample(s) per cell")
    if args.json:
        print(json.dumps(summary))
    else:
        print(text + f"\nwrote {out}/summary.json, table.txt, ruler.png ({seconds / 60:.1f} min in units, wall clock)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("ruler", help="RULER's synthetic long-context tasks for every KV policy and compression ratio")
    add_model_args(p)
    add_sparsity_arg(p)
    p.add_argument("--tasks", default="all", help="comma list of niah_single, niah_multikey, niah_multivalue, "
                                                  "niah_multiquery, vt, cwe, fwe (default: all)")
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens, comma list")
    p.add_argument("--policies", default="window,sink,h2o,sink_h2o,snapkv",
                   help="KV policies scored beside the full cache (the control); '' for none")
    p.add_argument("--presses", "--press", default="",
                   help="presses scored too, each compressing once after the prompt (knorm, streaming_llm, snapkv, "
                        "tova, expected_attention, h2o, sink_h2o; comma list; NAME:field=value... sets a field, "
                        "e.g. snapkv:window_size=32:page=16 keeps whole 16-token pages); table rows press:NAME")
    p.add_argument("--question", default="out", choices=["out", "in"],
                   help="out: a press compresses the context only, the question is fed after (kvpress's protocol); "
                        "in: the prompt but its last token (fed after), question included")
    p.add_argument("--ratios", "--ratio", default="0.5,0.75",
                   help="compression ratios: share of the prompt's KV pairs dropped")
    p.add_argument("--samples", type=positive_int, default=2, help="samples per (task, length, policy, ratio)")
    p.add_argument("--seed", type=int, default=0, help="seed of every sample")
    p.add_argument("--haystack", default="plays", help="NIAH haystack: plays (held-out test plays) or noise")
    p.add_argument("--chunk", type=positive_int, default=128, help="prefill chunk (a policy evicts between chunks)")
    p.add_argument("--positions", default="original", choices=["cache", "original"],
                   help="original: keys keep their absolute positions (kvpress); cache: rotated at their slot")
    p.add_argument("--n-sink", type=nonneg_int, default=4, help="attention-sink tokens kept by sink and sink_h2o")
    p.add_argument("--out", default=None, help="run folder (default runs/ruler/MODEL)")
    p.add_argument("--force", action="store_true", help="recompute finished units")
    p.add_argument("--table-only", action="store_true",
                   help="compute nothing: table and plot the units already finished (a run cut short)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_ruler, resume_hint="rerun the same command to continue: finished units are kept")
