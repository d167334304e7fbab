"""The `attnlab` command line: info, generate, chat, ppl, plus the subcommands of each subsystem.

User mistakes (missing files, bad options, empty text) end with one line on stderr and
exit code 2; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from attnlab.cli.common import UserError, add_model_args, load_lm, nonneg_int, positive_int
from attnlab.io import progress
from attnlab.textstream import TextStream

# Subsystems that bring their own subcommands through `add_parser(subparsers)`.
SUBSYSTEMS = ["attnlab.cli.dynamics", "attnlab.cli.stream", "attnlab.cli.analysis", "attnlab.cli.quantize",
              "attnlab.cli.serve", "attnlab.cli.passkey", "attnlab.cli.extend"]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---------------------------------------------------------------- commands

def cmd_info(args) -> int:
    lm = load_lm(args, tokenizer=False)
    c = lm.cfg
    rows = [("source", str(lm.source)), ("architecture", c.arch), ("parameters", f"{c.n_params / 1e6:.1f}M"),
            ("layers", c.n_layers), ("hidden size", c.dim), ("MLP size", c.hidden_dim),
            ("attention heads", f"{c.n_heads} query / {c.n_kv_heads} key-value (GQA group {c.n_heads // c.n_kv_heads})"),
            ("head dim", c.head_dim), ("vocabulary", c.vocab_size), ("context length", c.context_length),
            ("RoPE base", c.rope_base), ("RoPE scaling", c.rope_scaling or "none"), ("q/k/v bias", c.qkv_bias),
            ("tied embeddings", c.tie_embeddings), ("dtype", str(lm.dtype).replace("torch.", "")),
            ("KV cache per token", f"{2 * c.n_layers * c.n_kv_heads * c.head_dim * lm.model.embed.weight.element_size()} bytes")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _sampler(args):
    from attnlab.sampling import Sampler
    return Sampler(args.temperature, args.top_k, args.top_p, args.seed)


def _add_sampling(p):
    p.add_argument("--max-new-tokens", type=nonneg_int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=nonneg_int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _policy(args, length: int | None):
    """The KV-cache policy of --policy/--budget/--positions/--n-sink (None for full)."""
    if getattr(args, "policy", "full") == "full":
        return None
    from attnlab.cli.stream import build_policy
    if length is None and any(c in args.budget for c in ".%eE"):
        raise UserError("chat needs a budget in tokens (e.g. --budget 1024), not a fraction")
    return build_policy(args.policy, args.budget, args.positions, args.n_sink, length, block=args.block)


def _add_policy(p):
    try:
        from attnlab.cli.stream import add_policy_args
    except ModuleNotFoundError:
        return
    add_policy_args(p, budget_default="1024")


def cmd_generate(args) -> int:
    lm = load_lm(args)
    if not args.prompt:
        raise UserError("empty prompt: pass --prompt TEXT")
    ids = lm.chat_ids([{"role": "user", "content": args.prompt}]) if args.chat else lm.encode(args.prompt)
    policy = _policy(args, length=len(ids) + args.max_new_tokens)
    cache = lm.new_cache(capacity=min(len(ids) + args.max_new_tokens, 4096), policy=policy)
    stream = TextStream(lm.tokenizer, sys.stdout)
    if not args.chat:
        sys.stdout.write(args.prompt)
    for token in lm.stream(ids, cache, _sampler(args), args.max_new_tokens):
        stream.push(token)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args) -> int:
    """A multi-turn REPL; the KV cache carries the conversation, each turn feeds only its new tokens."""
    from attnlab.chat import ChatSession

    lm = load_lm(args)
    policy = _policy(args, length=None)
    session = ChatSession(lm, _sampler(args), args.max_new_tokens, cache_factory=lambda: lm.new_cache(policy=policy))
    print("attnlab chat: empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            break
        if not user:
            break
        if user == "/reset":
            session.reset()
            continue
        sys.stdout.write("bot> ")
        stream = TextStream(lm.tokenizer, sys.stdout)
        for token in session.ask(user):
            stream.push(token)
        sys.stdout.write("\n")
    return 0


def cmd_ppl(args) -> int:
    from attnlab.data import corpus
    from attnlab.eval.perplexity import perplexity

    if args.tokens is not None and args.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {args.tokens}")
    text = corpus(args.text)
    lm = load_lm(args)
    ids = lm.encode(text)
    if args.tokens is not None:
        ids = ids[:args.tokens]
    if len(ids) < 2:
        raise UserError(f"text {args.text!r} has fewer than 2 tokens")
    window = args.window or min(lm.cfg.context_length, 2048)
    with progress(len(ids) - 1, "perplexity") as bar:
        result = perplexity(lm, ids, window=window, chunk=args.chunk, progress=bar.update)
    result.update(model=str(args.model), text=args.text, window=window)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {result['ppl']:.3f}  (nll {result['nll']:.4f}, {result['tokens']} tokens, "
              f"window {window}, {result['seconds']:.1f}s, {result['tokens'] / result['seconds']:.0f} tok/s)")
    return 0


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
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling(p)
    _add_policy(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat keeping the KV cache between turns")
    add_model_args(p)
    _add_sampling(p)
    _add_policy(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ppl", help="perplexity on a text")
    add_model_args(p)
    p.add_argument("--text", default="shakespeare:test", help="shakespeare[:split|:play] or a file path")
    p.add_argument("--tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--window", type=positive_int, default=None, help="tokens per evaluation window")
    p.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size")
    p.add_argument("--json", action="store_true", help="print a JSON result")
    p.set_defaults(func=cmd_ppl)

    for name in SUBSYSTEMS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from attnlab.data import CorpusError
    from attnlab.kv.cache import CacheFullError
    from attnlab.model.loaders import ModelLoadError

    try:
        return int(args.func(args) or 0)
    except (UserError, ModelLoadError, CorpusError, CacheFullError, ValueError, FileNotFoundError) as e:
        if args.debug:
            raise
        print(f"attnlab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


