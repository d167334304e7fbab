"""Shared pieces of the command line: model options, argument types, user errors."""
from __future__ import annotations

import argparse

from attnlab.engine import DEFAULT_MODEL
from attnlab.errors import AttnlabError


class UserError(AttnlabError):
    """Bad input from the user: printed as one line, exit code 2."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def dtype_choice(text: str) -> str | None:
    """--dtype: float32 | bfloat16 | file (the file's own formats: None)."""
    if text not in ("float32", "bfloat16", "file"):
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from float32, bfloat16, file)")
    return None if text == "file" else text


def add_model_args(p: argparse.ArgumentParser) -> None:
    """MODEL positional (default: the embedded SmolLM2) plus dtype and thread options."""
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, metavar="MODEL",
                   help="embedded name, .gguf file or Hugging Face folder")
    p.add_argument("--dtype", default=None, type=dtype_choice, metavar="{float32,bfloat16,file}",
                   help="expand every weight to this dtype, or 'file': the file's own formats (the default but for "
                        "`dejavu`, whose default is float32; a quantized GGUF stays packed, activations float32)")
    p.add_argument("--rope", default=None, metavar="NAME:F", help="RoPE scaling override: linear|ntk|dynamic|yarn|llama3:F, none")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch intra-op threads (1 by measurement: a busy machine slows 2+ threads down 3x or more)")
    p.add_argument("--quant", type=quant_spec, default=None, metavar="SPEC",
                   help="quantized weights: int8, int4[:GROUP] (default group 32), kmeans[:BITS[:GROUP]], "
                        "kmeans-naive[:BITS] (lookup-then-matmul baseline); default: the file's own formats")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--compile", dest="compile", action="store_const", const=True, default=None,
                      help="insist on the native decode step (the default wherever it applies: one C++ call per token)")
    step.add_argument("--eager", dest="compile", action="store_const", const=False,
                      help="decode with the eager network (the reference path) instead of the native step")
    p.add_argument("--kv-dtype", default=None, choices=["float32", "float16", "int8"],
                   help="KV-cache storage (float16: half the cache memory and bytes read per token; int8: codes "
                        "and a scale per 32 numbers, 0.28x of float32; default: float16 under float32 activations, "
                        "else --dtype)")
    p.add_argument("--attention", type=attention_spec, default=None, metavar="quest:BUDGET[:PAGE[:DENSE[:CHANNELS]]]",
                   help="Quest query-aware decode attention: per step read only the cache pages (PAGE tokens, default "
                        "16) whose key bound is highest, BUDGET tokens in all, in the layers past the first DENSE; "
                        "CHANNELS R > 0 ranks pages by their best key's q.k on the R channels of largest |q| instead "
                        "(e.g. quest:1024:16:0:16; keeps a channel-major copy of the keys); prefill stays exact")


def attention_spec(text: str):
    from attnlab.kv.pages import QuestSpec
    try:
        return QuestSpec.parse(text)
    except AttnlabError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_sparsity_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sparsity", type=sparsity_spec, default=None, metavar="SPEC",
                   help="Deja Vu contextual sparsity: PATH[:MLP[:HEADS]] (predictors from `attnlab dejavu train`, "
                        "MLP/HEADS = fraction skipped, default 0.5), threshold@PATH[:MLP] or oracle[:MLP[:HEADS]]")


def sparsity_spec(text: str):
    from attnlab.sparsity.plan import parse
    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def quant_spec(text: str):
    from attnlab.quant import QuantSpec
    try:
        return QuantSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_options(args):
    """The command's model options as one checked `attnlab.options.Options` (before any slow work)."""
    from attnlab.options import Options
    return Options.from_args(args)


def load_lm(args, tokenizer: bool = True, options=None):
    from attnlab.engine import LM
    from attnlab.io import status
    options = options or model_options(args)
    with status(f"loading {args.model}"):  # 10-20 s for SmolLM2: say so
        return LM.load(args.model, options, tokenizer=tokenizer)
