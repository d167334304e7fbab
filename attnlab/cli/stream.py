"""`attnlab stream`: streaming perplexity of KV-cache policies on a long text.

Every (policy, budget) run scores the same tokens, token by token, and is saved
as `<out>/<key>.json` (summary + per-token NLL); a run interrupted midway resumes
from `<out>/<key>.ckpt.pt`, a finished one is read back instead of rerun. The key
ends in a hash of everything that changes the numbers (model file identity, dtype,
quantization, text name and content, every policy field, positions, chunk, tokens,
streams, offset), so a rerun with anything changed recomputes instead of reusing.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, add_sparsity_arg, load_lm, nonneg_int, positive_int
from attnlab.io import keyed_name, progress, write_json

DEFAULT_POLICIES = "full,window,sink,h2o,sink_h2o"


def policy_list(text: str) -> list[str]:
    from attnlab.kv.policies import POLICIES
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n.split(":")[0] not in POLICIES:  # a name, or a spec NAME:field=value (make_policy)
            raise UserError(f"unknown policy {n!r}; choose from {', '.join(POLICIES)}")
    if not names:
        raise UserError("no policy given")
    return names


def add_policy_args(p: argparse.ArgumentParser, budget_default: str | None = "256", policy_default: str = "full",
                    positions_default: str = "cache") -> None:
    """--policy/--budget/--positions/--n-sink, shared by stream, generate and chat."""
    p.add_argument("--policy", default=policy_default,
                   help="KV-cache policy: full, window, sink, h2o, sink_h2o, tova, snapkv (comma list for stream)")
    p.add_argument("--budget", default=budget_default,
                   help="KV budget per layer and KV head: tokens (256) or a fraction of the stream (0.2, 20%%)")
    p.add_argument("--positions", default=positions_default, choices=["cache", "original"],
                   help="cache: keys stored before RoPE, rotated at their slot (StreamingLLM); original: absolute")
    p.add_argument("--n-sink", type=nonneg_int, default=4, help="attention-sink tokens kept by sink and sink_h2o")
    p.add_argument("--block", type=positive_int, default=1,
                   help="block eviction: evict once every BLOCK tokens (cache holds up to budget + BLOCK - 1); "
                        "1 = exact per-token eviction")


def build_policy(name: str, budget: str, positions: str, n_sink: int, length: int | None = None,
                 chunk: int = 512, block: int = 1):
    """One policy from CLI options; a fractional budget is resolved against `length` tokens."""
    from attnlab.kv.policies import make_policy
    try:
        return make_policy(name, budget, positions=positions, n_sink=n_sink, chunk=chunk, block=block, length=length)
    except ValueError as e:
        raise UserError(str(e)) from None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_")[:60]


def run_identity(args, text: str) -> dict:
    """What every run of this invocation shares and its numbers depend on (the policy is added per run)."""
    from attnlab.model.loaders import resolve
    src = resolve(args.model)
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.suffix in (".json", ".safetensors"))
    return {"model": str(src.absolute()), "model_files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
            "dtype": args.dtype, "quant": str(args.quant) if getattr(args, "quant", None) else None, "text": args.text,
            "text_sha256": hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(),
            "tokens": args.tokens, "streams": args.streams, "offset": args.offset, "chunk": args.chunk,
            # settings that change the numbers, named only when set (older runs' keys stay valid)
            **{k: str(v) for k in ("rope", "kv_dtype", "sparsity", "attention") if (v := getattr(args, k, None)) is not None}}


def run_key(identity: dict, name: str, policy, mode: str) -> tuple[str, dict]:
    """-> (file stem: readable part + hash of everything, the full identity of this run)."""
    ident = {**identity, "policy": name, "policy_fields": dataclasses.asdict(policy), "mode": mode}
    readable = _slug(f"{name}-{policy.budget if name != 'full' else 'all'}-{policy.positions}-"
                     f"{identity['tokens']}x{identity['streams']}")
    return keyed_name(readable, ident), ident


class RunStore:
    """`<out>/<key>.json` as stream has always written them (the run dict, identity inside)."""

    def __init__(self, out: Path, force: bool = False):
        self.out, self.force = out, force

    def load(self, cell) -> dict | None:
        path = self.out / f"{cell.params['key']}.json"
        if self.force:
            (self.out / f"{cell.params['key']}.ckpt.pt").unlink(missing_ok=True)
            return None
        if not path.exists():
            return None
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"result file {path} is unreadable ({e}); rerun with --force to recompute") from None
        # a hash collision or a hand-edited file: recompute
        return {"result": run} if run.get("identity") == json.loads(json.dumps(cell.params["ident"])) else None

    def save(self, cell, payload: dict) -> dict:
        write_json(self.out / f"{cell.params['key']}.json", payload["result"])
        (self.out / f"{cell.params['key']}.ckpt.pt").unlink(missing_ok=True)
        return payload


def score_run(lm, ids, args, name: str, policy, mode: str, key: str, ident: dict, out: Path) -> dict:
    """One (policy, budget) run: per-token NLL of every stream, resumable from its checkpoint."""
    from attnlab.eval.streaming import stream_nll, summarize
    ckpt = out / f"{key}.ckpt.pt"
    with progress(args.streams * (args.tokens - 1), f"{name} {policy.budget}") as bar:
        r = stream_nll(lm, ids, policy, mode=mode, chunk=args.chunk if mode == "chunk" else 256,
                       progress=bar.update, checkpoint=ckpt, save_every=args.save_every)
    s = summarize(r["nll"])
    budget = args.tokens if name == "full" else policy.tokens
    return {"policy": name, "budget": budget, "budget_fraction": budget / args.tokens,
            "positions": args.positions if name != "full" else "original", "n_sink": args.n_sink,
            "tokens": int(r["nll"].numel()), "streams": args.streams, "stream_tokens": args.tokens,
            "offset": args.offset, "ppl": s["ppl"], "nll": s["nll"], "kv_bytes": r["kv_bytes"],
            "peak_tokens": r["peak_tokens"], "seconds": r["seconds"],
            "tokens_per_s": r["nll"].numel() / r["seconds"], "mode": mode, "chunk": args.chunk, "model": str(args.model),
            "text": args.text, "identity": ident,
            "nll_tokens": [[round(v, 5) for v in row] for row in r["nll"].tolist()]}


def cmd_stream(args) -> int:
    import torch

    from attnlab.data import corpus
    from attnlab.eval.streaming import bins, plot_budgets, plot_positions

    names = policy_list(args.policy)
    budgets = [b.strip() for b in args.budget.split(",") if b.strip()]
    if not budgets:
        raise UserError("no budget given")
    if args.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {args.tokens}")
    # validate every combination before the (slow) model load
    plan = []
    for name in names:
        for b in (budgets if name != "full" else budgets[:1]):
            plan.append((name, build_policy(name, b, args.positions, args.n_sink, args.tokens, chunk=args.chunk,
                                            block=args.block)))
    text = corpus(args.text)
    from attnlab.cli import check_tokens_fit
    check_tokens_fit(args.offset + args.tokens * args.streams, text, "--offset + --tokens x --streams")
    lm = load_lm(args)
    ids = lm.encode(text)
    need = args.tokens * args.streams
    if args.offset < 0 or len(ids) < args.offset + need:
        raise UserError(f"text {args.text!r} has {len(ids)} tokens; --offset {args.offset} + --tokens "
                        f"{args.tokens} x --streams {args.streams} needs {args.offset + need}")
    ids = torch.tensor(ids[args.offset:args.offset + need])
    ids = ids.view(args.streams, args.tokens)
    out = Path(args.out) if args.out else Path("runs") / "stream" / _slug(f"{Path(str(args.model)).name}-{args.text}")
    identity = run_identity(args, text)
    # every (policy, budget) run is one cell of attnlab.scale: keyed, skipped when finished, written atomically
    from attnlab.scale import Cell, run_cells
    cells = []
    for name, policy in plan:
        # Quest acts on single-token steps only: under --attention the full cache is scored token by token too
        exact = args.full_decode or getattr(args, "attention", None) is not None
        mode = "prefill" if name == "full" and not exact else "decode" if args.chunk == 1 else "chunk"
        key, ident = run_key(identity, name, policy, mode)
        cells.append(Cell("attnlab.cli.stream:score_run", dict(lm=lm, ids=ids, args=args, name=name, policy=policy,
                                                               mode=mode, key=key, ident=ident, out=out),
                          keyed=json.loads(json.dumps(ident, default=str)), readable=key))
    report = run_cells(cells, RunStore(out, args.force), desc="stream", threads=0)
    runs = [r["result"] for r in report.records]
    results = [{k: run[k] for k in ("policy", "budget", "positions", "tokens", "ppl", "kv_bytes", "tokens_per_s",
                                    "mode", "budget_fraction")} for run in runs]
    if args.plot:
        plot_positions(runs, args.plot, width=min(256, max(2, args.tokens // 8)),
                       trained=lm.cfg.context_length if args.tokens > lm.cfg.context_length else None,
                       title=f"{Path(str(args.model)).name} on {args.text}: streaming NLL")
    if args.sweep_plot:
        plot_budgets(runs, args.sweep_plot, title=f"{Path(str(args.model)).name} on {args.text}, "
                                                  f"{args.tokens} tokens x {args.streams}")
    if args.json:
        print(json.dumps({"results": results}))
        return 0
    full = next((r for r in results if r["policy"] == "full"), None)
    attention = getattr(args, "attention", None)
    under = f"+{attention}" if attention is not None else ""  # every row decodes under it
    print(f"{args.streams} x {args.tokens} tokens of {args.text}, positions {args.positions}; ppl: perplexity "
          f"(lower is better), vs full: ppl / full's ppl, KV MiB: cache memory" +
          (f"; every decode step attends with {attention}" if under else ""))
    width = max(10, *(len(r["policy"] + under) for r in results))
    print(f"{'policy':<{width}} {'budget':>7} {'ppl':>9} {'vs full':>8} {'KV MiB':>8} {'tok/s':>7}")
    for r in results:
        rel = f"{r['ppl'] / full['ppl']:.3f}x" if full else "-"
        print(f"{r['policy'] + under:<{width}} {r['budget']:>7} {r['ppl']:>9.2f} {rel:>8} {r['kv_bytes'] / 2**20:>8.1f} "
              f"{r['tokens_per_s']:>7.1f}{'  (' + r['mode'] + ')' if r['mode'] != 'decode' else ''}")
    if args.paired and full is not None:
        from attnlab.eval.streaming import paired
        ref = torch.tensor(next(r for r in runs if r["policy"] == "full")["nll_tokens"])
        cut = min(args.paired, ref.shape[1])
        print("\npaired per-token NLL against full (mean difference +- standard error over 256-token blocks):")
        for r in runs:
            if r["policy"] == "full":
                continue
            nll = torch.tensor(r["nll_tokens"])
            for lo, hi in ((0, cut), (cut, ref.shape[1])):
                if hi - lo < 2:
                    continue
                d = paired(nll, ref, lo, hi)
                print(f"  {r['policy']}@{r['budget']} tokens {lo + 1}-{hi}: {d['mean_diff']:+.4f} +- {d['se']:.4f} nats "
                      f"(ppl x{d['ppl_ratio']:.3f})")
    if args.bins:
        print(f"\nperplexity per {args.bins}-token bin:")
        table = {r["policy"] + f"@{r['budget']}": bins(torch.tensor(r["nll_tokens"]), args.bins) for r in runs}
        print(f"{'tokens':>13} " + " ".join(f"{k:>14}" for k in table))
        for i, b in enumerate(next(iter(table.values()))):
            print(f"{b['start']:>6}-{b['end']:<6} " + " ".join(f"{t[i]['ppl']:>14.2f}" for t in table.values()))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("stream", help="streaming perplexity of KV-cache policies (StreamingLLM, H2O, ...)")
    add_model_args(p)
    add_sparsity_arg(p)
    p.add_argument("--text", default="shakespeare:test", help="shakespeare[:split|:play] or a file path")
    add_policy_args(p, policy_default=DEFAULT_POLICIES)
    p.add_argument("--tokens", type=positive_int, default=2048,
                   help="tokens per stream (token-by-token scoring: a few minutes per policy on SmolLM2)")
    p.add_argument("--streams", type=positive_int, default=1,
                   help="parallel passages (consecutive slices of the text, one cache row each)")
    p.add_argument("--offset", type=nonneg_int, default=0, help="first token of the text to use")
    p.add_argument("--out", default=None, help="run folder (default runs/stream/MODEL-TEXT)")
    p.add_argument("--plot", default=None, help="write the NLL-by-position figure here")
    p.add_argument("--sweep-plot", default=None, help="write the perplexity-by-budget figure here")
    p.add_argument("--paired", type=nonneg_int, default=0, metavar="POS",
                   help="also compare every policy with full token by token, before and after position POS")
    p.add_argument("--bins", type=nonneg_int, default=0, help="also print perplexity per bin of this many tokens (0 = off)")
    p.add_argument("--full-decode", action="store_true",
                   help="score full token by token (default: chunked prefill, same logits, much faster)")
    p.add_argument("--chunk", type=positive_int, default=1,
                   help="tokens per step for evicting policies (1 = token by token, exact streaming; N > 1 evicts "
                        "between chunks of N, faster, an approximation)")
    p.add_argument("--save-every", type=positive_int, default=1024, help="checkpoint every N tokens")
    p.add_argument("--force", action="store_true", help="rerun finished runs and discard checkpoints")
    p.add_argument("--json", action="store_true", help="print {'results': [...]} as JSON")
    p.set_defaults(func=cmd_stream, resume_hint="rerun the same command to resume from the last checkpoint")
