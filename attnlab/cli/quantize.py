"""`attnlab quantize`: write a quantized checkpoint that `attnlab.load` reads back as it is."""
from __future__ import annotations

import time

from attnlab.cli.common import UserError, add_model_args, load_lm


def cmd_quantize(args) -> int:
    from pathlib import Path

    from attnlab.quant import QuantSpec, model_bytes
    from attnlab.quant.store import save_quantized

    spec = args.method if args.bits is None and args.group is None else \
        ":".join([args.method] + ([str(args.bits)] if args.method.startswith("kmeans") else []) +
                 ([str(args.group)] if args.group is not None else []))
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


def add_parser(sub) -> None:
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
