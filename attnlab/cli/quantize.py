"""`attnlab quantize`: write a quantized checkpoint that `attnlab.load` reads back as it is."""
from __future__ import annotations

import time

from attnlab.cli.common import UserError, add_model_args, load_lm


def cmd_quantize(args) -> int:
    from pathlib import Path

    from attnlab.quant import QuantSpec, model_bytes
    from attnlab.quant.store import save_quantized

    spec = QuantSpec.text(args.method, args.bits, args.group)
    try:
        args.quant = QuantSpec.parse(spec)
    except ValueError as e:
        raise UserError(str(e)) from None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    t = time.perf_counter()
    lm = load_lm(args)
    save_quantized(lm, out)
    print(f"{args.quant}: {model_bytes(lm.model) / 2**20:.1f} MiB of weights, quantized in "
          f"{time.perf_counter() - t:.1f} s; wrote {out} (load it with attnlab.load({str(out)!r}))")
    return 0


def cmd_quant_eval(args) -> int:
    from pathlib import Path

    from attnlab.data import corpus
    from attnlab.engine import LM
    from attnlab.eval.quant import evaluate, plot
    from attnlab.io import progress
    from attnlab.quant import QuantSpec

    specs = [s.strip() for s in args.formats.split(",") if s.strip()]
    for s in specs:
        if s not in ("fp32", "bf16"):
            try:
                QuantSpec.parse(s)
            except ValueError as e:
                raise UserError(str(e)) from None
    text = corpus(args.text)
    tok = LM.load(args.model, tokenizer=True, quant="int8")  # only for its tokenizer; int8 loads fastest
    ids = tok.encode(text)[:args.tokens + 1]
    del tok
    out = Path(args.out)
    with progress(len(specs) * (len(ids) - 1 + args.decode_tokens), "quant-eval") as bar:
        rows = evaluate(args.model, specs, ids, out, window=args.window, decode_tokens=args.decode_tokens,
                        progress=bar.update)
    fig = plot(rows, out / "ppl_vs_bits.png", f"{Path(str(args.model)).name} on {args.text}, {len(ids) - 1} tokens")
    base = rows[0]["ppl"]
    print(f"{'format':<12} {'ppl':>8} {'vs ' + rows[0]['format']:>9} {'bits/w':>7} {'MiB':>7}"
          + ("  decode-path ppl" if args.decode_tokens else "") + "   (lower ppl is better)")
    for r in rows:
        dec = f"  {r['ppl_decode']:.3f}" if "ppl_decode" in r else ""
        print(f"{r['format']:<12} {r['ppl']:>8.3f} {100 * (r['ppl'] / base - 1):>+8.2f}% "
              f"{r['bits_per_weight']:>7.2f} {r['model_mib']:>7.1f}{dec}")
    print(f"wrote {out / 'quant.json'} and {fig}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("quant-eval", help="perplexity and size of every weight format on a text")
    add_model_args(p)
    p.add_argument("--formats", default="fp32,bf16,int8,int8:32,int4:32,int4:64,kmeans:4,kmeans:3",
                   help="comma list of fp32, bf16 and --quant specs (default: %(default)s)")
    p.add_argument("--text", default="shakespeare:test", help="text to score (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens scored per format (default: %(default)s)")
    p.add_argument("--window", type=int, default=2048, help="evaluation window (default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="also score the first N tokens token by token through the batch-1 kernels")
    p.add_argument("--out", default="runs/quant", help="output folder (default: %(default)s)")
    p.set_defaults(func=cmd_quant_eval)

    p = sub.add_parser("quantize", help="write a quantized checkpoint (safetensors + config)",
                       description="Quantize a model's linear layers (LM head in int8) and save them.")
    add_model_args(p)
    p.add_argument("--method", required=True, choices=["int8", "int4", "kmeans", "kmeans-naive"],
                   help="quantization method (see --quant on the model commands)")
    p.add_argument("--bits", type=int, default=None, help="k-means bits (2-4, default 4)")
    p.add_argument("--group", type=int, default=None,
                   help="weights per scale (int4, default 32) or per codebook (kmeans, default: a row)")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=cmd_quantize)
