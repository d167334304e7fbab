"""The `attnlab` command line: info, generate, chat, ppl, plus the subcommands of each subsystem.

User mistakes (missing or hostile files, bad options, bad text, unwritable paths) end
with one line on stderr and exit code 2; `--debug` shows the traceback instead. Ctrl-C
exits 130 (saying how to resume when the command is resumable); a closed output pipe
(`attnlab info | head`) ends quietly. Options and texts are checked before the model load.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time

from attnlab.cli.common import (UserError, add_model_args, add_sparsity_arg, load_lm, model_options, nonneg_int,
                                positive_int)
from attnlab.errors import AttnlabError
from attnlab.io import progress
from attnlab.textstream import TextStream

# Subsystems that bring their own subcommands through `add_parser(subparsers)`.
SUBSYSTEMS = ["attnlab.cli.dynamics", "attnlab.cli.stream", "attnlab.cli.analysis", "attnlab.cli.quantize",
              "attnlab.cli.serve", "attnlab.cli.passkey", "attnlab.cli.extend",
              "attnlab.cli.dejavu", "attnlab.cli.sweep", "attnlab.cli.ruler", "attnlab.cli.lmeval",
              "attnlab.cli.report", "attnlab.cli.export", "attnlab.cli.fetch", "attnlab.cli.robust"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the help already explains its default or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """One-line usage errors; every option's help shows its default."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def utf8(text: str, what: str) -> str:
    """Command-line text arrives with undecodable bytes smuggled in as surrogates: refuse it here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} is not valid UTF-8") from None
    return text


def check_tokens_fit(tokens: int, text: str, what: str) -> None:
    """Before tokenising: a token covers at least one character (plus a BOS), so an absurd count fails early."""
    if tokens > len(text) + 1:
        raise UserError(f"{what} asks for {tokens} tokens; the text has only {len(text)} characters")


# ---------------------------------------------------------------- commands

def cmd_info(args) -> int:
    """Architecture summary from the file's metadata only: no weights are read (milliseconds, not seconds)."""
    from attnlab.model.metadata import read_config
    from attnlab.kernels import build, isa
    from attnlab.options import Options

    c, source = read_config(args.model)
    if args.rope is not None:  # what a load with --rope would run
        from attnlab.model.loaders import _trained_length
        from attnlab.rope import parse_rope
        c.rope_scaling = parse_rope(args.rope, _trained_length(c))
    opts = Options(dtype=args.dtype, kv_dtype=args.kv_dtype, compile=args.compile)
    element = opts.torch_kv_dtype.itemsize
    kernels = (f"{build.variant()} ({build.library().name})" if build.load() else f"none: {build.why()}")
    step = ("eager (--eager)" if opts.compile is False else "native where the network allows it (one warning where not)"
            if build.load() else "eager (no kernels)")
    rows = [("source", str(source)), ("architecture", c.arch), ("parameters", f"{c.n_params / 1e6:.1f}M"),
            ("layers", c.n_layers), ("hidden size", c.dim), ("MLP size", c.hidden_dim),
            ("attention heads", f"{c.n_heads} query / {c.n_kv_heads} key-value (GQA group {c.n_heads // c.n_kv_heads})"),
            ("head dim", c.head_dim), ("vocabulary", c.vocab_size), ("context length", c.context_length),
            ("RoPE base", c.rope_base), ("RoPE scaling", c.rope_scaling or "none"),
            ("sliding window", c.sliding_window or "none"), ("q/k/v bias", c.qkv_bias),
            ("tied embeddings", c.tie_embeddings), ("dtype", args.dtype or "the file's format, float32 activations"),
            ("KV cache per token", f"{2 * c.n_layers * c.n_kv_heads * c.head_dim * element} bytes "
                                   f"({str(opts.torch_kv_dtype).removeprefix('torch.')})"),
            ("CPU", isa.describe()), ("C++ kernels", kernels), ("decode step", step)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _sampler(args):
    from attnlab.sampling import Sampler
    return Sampler(args.temperature, args.top_k, args.top_p, args.seed)


def _add_sampling(p):
    p.add_argument("--max-new-tokens", type=nonneg_int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: fresh entropy)")


def _add_policy(p):
    try:
        from attnlab.cli.stream import add_policy_args
    except ModuleNotFoundError:
        return
    add_policy_args(p, budget_default="1024")


def _add_speculative(p):
    p.add_argument("--speculative", default=None, metavar="SPEC",
                   help="decode speculatively, the same tokens faster: ngram[:N[:K]], self:sink:W[:K], "
                        "self:quest:BUDGET[:K], draft:PATH[:K]; K: 4 fixed, a8 adaptive (docs/speculative.md)")
    p.add_argument("--stats", action="store_true", help="print tokens/s (and drafted, accepted, tokens per "
                   "verification step) to stderr")


def cmd_generate(args) -> int:
    if not args.prompt:
        raise UserError("empty prompt: pass --prompt TEXT")
    utf8(args.prompt, "--prompt")
    opts, sampler = model_options(args), _sampler(args)  # options checked before the model load
    lm = load_lm(args, options=opts)
    ids = lm.chat_ids([{"role": "user", "content": args.prompt}]) if args.chat else lm.encode(args.prompt)
    policy = opts.new_policy(length=len(ids) + args.max_new_tokens)
    cache = lm.new_cache(capacity=min(len(ids) + args.max_new_tokens, 4096), policy=policy)
    stream = TextStream(lm.tokenizer, sys.stdout)
    if not args.chat:
        sys.stdout.write(args.prompt)
    from attnlab.speculative import SpecStats
    stats, count, start = SpecStats(), 0, time.perf_counter()
    for token in lm.stream(ids, cache, sampler, args.max_new_tokens, stats=stats):
        stream.push(token)
        count += 1
    sys.stdout.write("\n")
    if args.stats:
        _print_stats(count, time.perf_counter() - start, opts, stats)
    return 0


def _print_stats(count: int, took: float, opts, stats) -> None:
    """--stats: tokens/s and speculative decoding's counts, on stderr (stdout stays the text)."""
    spec = f" speculative {opts.speculative}: {stats.as_dict()}" if opts.speculative else ""
    print(f"{count} tokens in {took:.2f} s ({count / took:.1f} tokens/s, prefill included);{spec}", file=sys.stderr)


def cmd_chat(args) -> int:
    """A multi-turn REPL; the KV cache carries the conversation, each turn feeds only its new tokens."""
    from attnlab.chat import ChatSession

    opts, sampler = model_options(args), _sampler(args)
    if opts.policy is not None and opts.policy.fractional:
        raise UserError("chat needs a budget in tokens (e.g. --budget 1024), not a fraction")
    lm = load_lm(args, options=opts)
    session = ChatSession(lm, sampler, args.max_new_tokens, cache_factory=lambda: lm.new_cache(policy=opts.new_policy()))
    from attnlab.speculative import SpecStats
    interactive = sys.stdin.isatty()
    print("attnlab chat: empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        except UnicodeDecodeError:
            raise UserError("chat input is not valid UTF-8") from None
        user = utf8(line, "chat input").strip()
        if not interactive and user:
            print(f"you> {user}")  # piped input: keep the transcript readable
        if not user:
            break
        if user == "/reset":
            session.reset()
            continue
        sys.stdout.write("bot> ")
        stream = TextStream(lm.tokenizer, sys.stdout)
        session.stats, count, start = SpecStats(), 0, time.perf_counter()
        for token in session.ask(user):
            stream.push(token)
            count += 1
        sys.stdout.write("\n")
        if args.stats:
            _print_stats(count, time.perf_counter() - start, opts, session.stats)
    return 0


def cmd_ppl(args) -> int:
    from attnlab.data import corpus
    from attnlab.eval.perplexity import perplexity

    if args.tokens is not None and args.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {args.tokens}")
    if args.scoring == "llamacpp" and args.window is not None and (args.window < 4 or args.window % 2):
        raise UserError(f"--window must be an even number >= 4 with --scoring llamacpp, got {args.window}")
    text = corpus(args.text)
    if args.tokens is not None:
        check_tokens_fit(args.tokens, text, "--tokens")
    lm = load_lm(args)
    ids = lm.encode(text)
    if args.tokens is not None:
        if args.tokens > len(ids):
            raise UserError(f"--tokens {args.tokens}: text {args.text!r} has only {len(ids)} tokens")
        ids = ids[:args.tokens]
    if len(ids) < 2:
        raise UserError(f"text {args.text!r} has fewer than 2 tokens")
    window = args.window or min(lm.cfg.context_length, 2048)
    if args.scoring == "llamacpp":
        return _ppl_llamacpp(args, lm, ids, window)
    with progress(len(ids) - 1, "perplexity") as bar:
        result = perplexity(lm, ids, window=window, chunk=args.chunk, progress=bar.update)
    result.update(model=str(args.model), text=args.text, window=window)
    return _emit(args, result, f"perplexity {result['ppl']:.3f}  (nll {result['nll']:.4f}, {result['tokens']} tokens, "
                               f"window {window}, {result['seconds']:.1f}s, "
                               f"{result['tokens'] / result['seconds']:.0f} tok/s)")


def _emit(args, result: dict, line: str) -> int:
    """A command's result: the JSON with --json, else its one line."""
    print(json.dumps(result) if args.json else line)
    return 0


def _ppl_llamacpp(args, lm, ids, n_ctx: int) -> int:
    """`--scoring llamacpp`: the number `llama-perplexity -f TEXT -c WINDOW [--chunks N]` prints for this text."""
    from attnlab.eval.perplexity import adds_bos, llamacpp_perplexity

    if len(ids) < 2 * n_ctx:
        raise UserError(f"--scoring llamacpp needs at least 2 * window = {2 * n_ctx} tokens "
                        f"(as llama-perplexity does); text {args.text!r} has {len(ids)}")
    n = len(ids) // n_ctx if args.n_chunks is None else min(args.n_chunks, len(ids) // n_ctx)
    with progress(n * (n_ctx - 1 - n_ctx // 2), "perplexity") as bar:
        result = llamacpp_perplexity(lm, ids, n_ctx, args.n_chunks, args.path, adds_bos(lm.tokenizer), bar.update)
    result.update(model=str(args.model), text=args.text, scoring="llamacpp", path=args.path)
    return _emit(args, result, f"perplexity {result['ppl']:.4f}  (llama-perplexity scoring: {result['chunks']} chunks "
                               f"of {n_ctx}, second halves, {result['tokens']} tokens scored, {args.path} path, "
                               f"{result['seconds']:.1f}s)")


# ---------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="attnlab", description="Understand and exploit attention sparsity in Transformers.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("info", help="architecture summary of a model")
    add_model_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="generate text, streamed to stdout")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="text to continue (or the user message with --chat)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling(p)
    _add_policy(p)
    add_sparsity_arg(p)
    _add_speculative(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat keeping the KV cache between turns")
    add_model_args(p)
    _add_sampling(p)
    _add_policy(p)
    add_sparsity_arg(p)
    _add_speculative(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ppl", help="perplexity on a text")
    add_model_args(p)
    p.add_argument("--text", default="shakespeare:test", help="shakespeare[:split|:play] or a file path")
    p.add_argument("--tokens", type=int, default=None, help="score only the first N tokens (default: all)")
    p.add_argument("--window", type=positive_int, default=None,
                   help="tokens per evaluation window (default: the context length, at most 2048)")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size")
    p.add_argument("--scoring", choices=["windows", "llamacpp"], default="windows",
                   help="windows: every token scored once in disjoint windows; llamacpp: as `llama-perplexity -c "
                        "WINDOW` scores (chunks of WINDOW tokens, BOS in front where the vocabulary adds one, the "
                        "second half of each scored), so the two numbers compare directly")
    p.add_argument("--n-chunks", type=positive_int, default=None,
                   help="--scoring llamacpp: score at most N chunks (llama-perplexity's --chunks; default: all)")
    p.add_argument("--path", choices=["prefill", "decode"], default="prefill",
                   help="--scoring llamacpp: prefill (each chunk as one batch, as llama.cpp runs it) or decode "
                        "(the scored half one token per step, as generation runs)")
    p.add_argument("--json", action="store_true", help="print a JSON result")
    add_sparsity_arg(p)
    p.set_defaults(func=cmd_ppl)

    for name in SUBSYSTEMS:
        importlib.import_module(name).add_parser(sub)
    return parser


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if text else type(e).__name__


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the exit-time flush cannot fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a real file (tests capture it)
        pass


def use_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process (None: leave torch's): the one place attnlab sets them, at the
    command line's edge (and in the worker processes it starts). The engine keeps its own count (`LM.threads`)."""
    if threads is not None:
        if threads < 1:
            raise AttnlabError(f"threads must be >= 1, got {threads}")
        import torch
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # results record the command that made them
    try:
        use_threads(getattr(args, "threads", None) or None)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        hint = getattr(args, "resume_hint", None)
        print("attnlab: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # `attnlab info | head`: the reader has what it wanted
        _quiet_stdout()
        return 141
    except (AttnlabError, OSError) as e:  # anything else is a bug: its traceback stays
        if args.debug:
            raise
        print(f"attnlab: error: {_one_line(e)}", file=sys.stderr)
        return 2
