"""`attnlab passkey`: passkey retrieval accuracy by context length and needle depth,
under any KV-cache policy and RoPE scaling (`--policy sink --budget 1024`, `--rope yarn:4`)."""
from __future__ import annotations

import json

from attnlab.cli.common import UserError, add_model_args, load_lm, positive_int
from attnlab.cli.stream import add_policy_args, build_policy
from attnlab.io import progress, write_json


def _numbers(text: str, kind, what: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{what} must be a comma list of numbers, got {text!r}") from None
    if not values:
        raise UserError(f"--{what} is empty")
    return values


def cmd_passkey(args) -> int:
    from attnlab.eval.passkey import passkey_eval

    lengths = _numbers(args.lengths, int, "lengths")
    depths = _numbers(args.depths, float, "depths")
    if any(length < 64 for length in lengths):
        raise UserError("--lengths must be at least 64 tokens each")
    if any(not 0 <= d <= 1 for d in depths):
        raise UserError("--depths must be in [0, 1]")
    policy = None
    if args.policy != "full":
        if "," in args.policy:
            raise UserError("passkey takes one --policy per run")
        policy = build_policy(args.policy, args.budget, args.positions, args.n_sink, max(lengths), chunk=args.chunk)
    lm = load_lm(args)
    total = len(lengths) * len(depths) * args.trials
    with progress(total, "passkey", unit="trial") as bar:
        try:
            rows = passkey_eval(lm, lengths, depths, args.trials, args.seed, policy, args.chunk, bar.update)
        except ValueError as e:
            raise UserError(str(e)) from None
    result = {"model": str(args.model), "policy": policy.describe() if policy else "full",
              "attention": str(lm.options.attention or "full"),
              "rope": lm.cfg.rope_scaling, "trials": args.trials, "seed": args.seed, "results": rows}
    if args.out:
        write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"passkey retrieval, {result['policy']}, attention {result['attention']}, rope {args.rope or 'as trained'}: accuracy over {args.trials} keys")
    print(f"{'length':>8} " + " ".join(f"{'depth ' + format(d, 'g'):>10}" for d in depths))
    for length in lengths:
        accs = [r["accuracy"] for r in rows if r["length"] == length]
        print(f"{length:>8} " + " ".join(f"{a:>10.2f}" for a in accs))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("passkey", help="passkey retrieval accuracy by context length and depth")
    add_model_args(p)
    p.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens, comma list")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths in [0, 1], comma list")
    p.add_argument("--trials", type=positive_int, default=3, help="random keys per (length, depth)")
    p.add_argument("--seed", type=int, default=0, help="seed of the keys and filler (default: %(default)s)")
    add_policy_args(p, budget_default="1024")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk (a policy evicts between chunks)")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_passkey)
