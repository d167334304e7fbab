"""`attnlab export MODEL DIR`: a model (embedded name, GGUF file or folder) as a Hugging Face folder
(config.json + model.safetensors + tokenizer), so transformers, and kvpress, run our models."""
from __future__ import annotations

from pathlib import Path

from attnlab.cli.common import UserError, positive_int


def cmd_export(args) -> int:
    import torch

    from attnlab.engine import LM
    from attnlab.io import status
    from attnlab.model.export import save_hf_folder
    from attnlab.options import Options

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise UserError(f"{out} is not empty; pass --force to write into it")
    with status(f"loading {args.model}"):
        lm = LM.load(args.model, Options(dtype="float32", threads=args.threads))
    if lm.quant is not None:
        raise UserError(f"{args.model} loads as packed {lm.quant} weights; export needs float weights")
    dtype = {"float32": torch.float32, "float16": torch.float16}[args.dtype]
    save_hf_folder(lm.model, out, tokenizer=lm.tokenizer, dtype=dtype)
    print(f"wrote {out}/config.json, model.safetensors ({args.dtype}){', tokenizer' if lm.tokenizer else ''}; "
          f"load it with transformers' AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a model as a Hugging Face folder (config.json + safetensors)")
    p.add_argument("model", metavar="MODEL", help="embedded name, .gguf file or Hugging Face folder")
    p.add_argument("out", metavar="DIR", help="folder to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"], help="stored weight type")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.set_defaults(func=cmd_export)
