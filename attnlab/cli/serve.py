"""`attnlab serve`: the OpenAI-compatible server (FastAPI + uvicorn) over bounded-cache sessions."""
from __future__ import annotations

from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, load_lm, positive_int
from attnlab.cli.stream import add_policy_args


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from attnlab.serve import CacheSpec, create_app
    except ModuleNotFoundError as e:
        raise UserError(f"serving needs the 'serve' extra ({e.name} is missing): pip install 'attnlab[serve]'") from None
    if "," in args.policy:
        raise UserError("serve takes one --policy (requests may pick another through the attnlab field)")
    try:
        budget = int(args.budget)
    except ValueError:
        raise UserError(f"serve needs --budget in tokens (e.g. 1024), got {args.budget!r}") from None
    spec = CacheSpec(args.policy, budget, args.n_sink, args.positions, args.block)
    lm = load_lm(args)
    name = args.name or Path(str(args.model)).name.removesuffix(".gguf")
    try:
        app = create_app(lm, name, spec, max_sessions=args.max_sessions, max_bytes=args.max_cache_mib << 20,
                         max_tokens=args.max_tokens, max_active=args.max_active, queue_timeout=args.queue_timeout,
                         max_prompt_tokens=args.max_prompt_tokens, chunk=args.chunk)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"attnlab serve: {name} ({spec.policy}{'' if spec.policy == 'full' else f', budget {budget}'}) on "
          f"http://{args.host}:{args.port}/  (OpenAI base_url http://{args.host}:{args.port}/v1)")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with bounded-cache conversations and a cache view")
    add_model_args(p)
    add_policy_args(p, budget_default="1024", policy_default="sink")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--name", default=None, help="model id clients ask for (default: the model file's name)")
    p.add_argument("--max-sessions", type=positive_int, default=16, help="conversations held; LRU beyond")
    p.add_argument("--max-cache-mib", type=positive_int, default=1024, help="KV bytes of all held conversations; LRU beyond")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="reply length when a request gives none")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=32768, help="largest prompt one request may feed")
    p.add_argument("--max-active", type=positive_int, default=8, help="requests generating at once (interleaved)")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request waits for a slot, then 503")
    p.add_argument("--chunk", type=positive_int, default=128, help="prefill chunk (bounded caches hold budget + chunk)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log verbosity")
    p.set_defaults(func=cmd_serve)
