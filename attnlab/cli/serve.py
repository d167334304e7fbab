"""`attnlab serve`: the OpenAI-compatible server (FastAPI + uvicorn) over bounded-cache sessions."""
from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, load_lm, model_options, positive_float, positive_int
from attnlab.cli.stream import add_policy_args


def cmd_serve(args) -> int:
    try:
        from attnlab.serve import PolicySpec
        from attnlab.serve.config import Keys
        from attnlab.serve.conn import GuardedServer, serve_config
    except ModuleNotFoundError as e:
        raise UserError(f"serving needs the 'serve' extra ({e.name} is missing): pip install 'attnlab[serve]'") from None
    if args.health_port and args.replicas:
        raise UserError("--health-port serves one server's heartbeat; with --replicas ask the front's /health")
    if args.ray and not args.replicas:
        raise UserError("--ray ADDRESS needs --replicas N (the number of servers to run on that cluster)")
    if "," in args.policy:
        raise UserError("serve takes one --policy (requests may pick another through the attnlab field)")
    opts = model_options(args)
    spec = opts.policy or PolicySpec("full")
    if spec.fractional:
        raise UserError(f"serve needs --budget in tokens (e.g. 1024), got {args.budget!r}")
    keys = Keys(api_keys(args), args.admin_key or ())
    loopback = args.host in ("127.0.0.1", "localhost", "::1")
    if not (keys.api or keys.admin) and not loopback and not args.insecure_no_auth:
        raise UserError(f"serving on {args.host} without --api-key lets anyone who can reach it use it: give "
                        f"--api-key (or ATTNLAB_API_KEYS / --api-keys-file), or --insecure-no-auth")
    hosts = ["127.0.0.1", "localhost", "::1"] + ([args.host] if args.host not in ("0.0.0.0", "::") else [])
    name = args.name or Path(str(args.model)).name.removesuffix(".gguf")
    config = serve_settings(args, name, spec, hosts + (args.allowed_host or []))
    build = partial(build_app, args, config.per_replica(), keys)
    app = None if args.replicas else build()
    print(f"attnlab serve: {name} ({spec.name}{'' if spec.name == 'full' else f', budget {spec.budget}'}) on "
          f"http://{args.host}:{args.port}/  (OpenAI base_url http://{args.host}:{args.port}/v1)")
    if keys.api or keys.admin:
        print(f"attnlab serve: {len(keys.api)} API key(s), {len(keys.admin)} admin key(s); conversations are "
              f"private to each key")
    else:
        print("attnlab serve: no API keys: anyone who can reach this address can use the server and see every "
              "conversation" + (" (localhost only)" if loopback else " (--insecure-no-auth)"))
    if args.replicas:
        return serve_replicas(args, build, config, keys)
    side = beat = None
    if args.health_port:  # /health from a process of its own (attnlab/serve/health.py)
        from attnlab.serve import health
        side, beat = health.start(args.host, args.health_port)
        print(f"attnlab serve: GET /health also on http://{args.host}:{args.health_port}/health (a process of its own)")
    try:
        GuardedServer(serve_config(app, args.host, args.port, config.http, args.log_level),
                      tasks=[beat.run] if beat else []).run()
    finally:
        if side is not None:
            side.terminate()
            beat.close()
    return 0


def guard_spec(text: str):
    import argparse

    from attnlab.errors import AttnlabError
    from attnlab.robust.defenses import Guard
    try:
        return Guard.parse(text)
    except AttnlabError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def serve_settings(args, name, spec, hosts):
    """Every serving limit from the command line, validated once (`ServeConfig`)."""
    from attnlab.errors import AttnlabError
    from attnlab.serve.config import Limits, ServeConfig
    mib = 1 << 20
    try:
        http = Limits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                      keep_alive=args.keep_alive, max_connections=args.max_connections,
                      max_per_client=args.max_connections_per_client, send_timeout=args.send_timeout)
        return ServeConfig(
            name, spec, max_sessions=args.max_sessions, max_bytes=args.max_cache_mib * mib,
            key_sessions=args.max_sessions_per_key,
            key_bytes=args.max_cache_mib_per_key * mib if args.max_cache_mib_per_key else None,
            max_tokens=args.max_tokens, max_tokens_cap=args.max_tokens_cap, max_prompt_tokens=args.max_prompt_tokens,
            max_body=args.max_body_kib << 10, max_active=args.max_active, key_active=args.max_active_per_key,
            key_queued=args.max_queued_per_key, queue_timeout=args.queue_timeout, max_batch=args.max_batch,
            chunk=args.chunk, http=http, hosts=tuple(hosts), openapi=args.openapi,
            cors_origins=tuple(args.cors_origin or ()), replicas=args.replicas or 1, guard=args.guard,
            speculative=args.serve_speculative)
    except AttnlabError as e:
        raise UserError(str(e)) from None


def build_app(args, config, keys):
    """Load the model and build the server's app (in this process, or in each Ray Serve replica)."""
    from attnlab.serve import create_app, memory
    memory.configure()  # before the weights are read: their buffers are mapped, and unmapped when freed
    lm = load_lm(args, options=model_options(args))
    try:
        return create_app(lm, config, keys)
    except ValueError as e:
        raise UserError(str(e)) from None


def serve_replicas(args, build, config, keys) -> int:
    """--replicas N: N servers as a Ray Serve application behind an affinity router, until interrupted."""
    from attnlab.serve.replicas import ReplicaSet
    each = config.per_replica()
    print(f"attnlab serve: starting {args.replicas} replica(s) on Ray ({args.ray or 'a local instance'}), "
          f"{args.threads} CPU(s) each; each conversation is routed to the replica holding its cache")
    print(f"attnlab serve: limits are for all replicas together: each holds at most {each.max_sessions} "
          f"conversation(s) and {each.max_bytes >> 20} MiB of cache (--max-sessions {config.max_sessions}, "
          f"--max-cache-mib {config.max_bytes >> 20} divided by {args.replicas})")
    replicas = ReplicaSet(build, args.replicas, args.host, args.port, args.ray, cpus=args.threads, config=config,
                          keys=keys)
    print(f"attnlab serve: {args.replicas} replica(s) up")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        replicas.close()
    return 0


def api_keys(args) -> list[str]:
    """--api-key values, then ATTNLAB_API_KEYS (comma-separated), then --api-keys-file (one per line, # comments)."""
    keys = list(args.api_key or [])
    keys += [k.strip() for k in os.environ.get("ATTNLAB_API_KEYS", "").split(",") if k.strip()]
    if args.api_keys_file:
        try:
            lines = Path(args.api_keys_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --api-keys-file {args.api_keys_file}: {e}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    bad = [k for k in keys if len(k) < 8 or any(c.isspace() for c in k)]
    if bad:
        raise UserError("API keys must be at least 8 characters without spaces")
    return keys


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with bounded-cache conversations and a cache view")
    add_model_args(p)
    add_policy_args(p, budget_default="1024", policy_default="sink")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--health-port", type=int, default=None, metavar="PORT",
                   help="also answer GET /health on PORT from a small process of its own: milliseconds whatever the "
                        "model does (503 once the server's event loop has been stuck 10 s)")
    p.add_argument("--name", default=None, help="model id clients ask for (default: the model file's name)")
    p.add_argument("--max-sessions", type=positive_int, default=16, help="conversations held; LRU beyond")
    p.add_argument("--max-cache-mib", type=positive_int, default=1024, help="KV bytes of all held conversations; LRU beyond")
    p.add_argument("--max-sessions-per-key", type=positive_int, default=None,
                   help="conversations one key holds (default: --max-sessions split evenly between the keys)")
    p.add_argument("--max-cache-mib-per-key", type=positive_int, default=None,
                   help="KV bytes one key's conversations hold (default: --max-cache-mib split evenly between keys)")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="reply length when a request gives none")
    p.add_argument("--max-tokens-cap", type=positive_int, default=4096, help="largest max_tokens a request may ask")
    p.add_argument("--max-body-kib", type=positive_int, default=1024, help="largest request body (KiB), else 413")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=32768, help="largest prompt one request may feed")
    p.add_argument("--max-active", type=positive_int, default=8, help="requests in the scheduler at once; the rest queue")
    p.add_argument("--max-active-per-key", type=positive_int, default=None,
                   help="generations one key runs at once (default: every slot while alone, its share while other "
                        "keys want slots)")
    p.add_argument("--max-queued-per-key", type=positive_int, default=None,
                   help="requests one key may have waiting for a slot (default: 4 x --max-active); beyond: 429")
    p.add_argument("--guard", type=guard_spec, default=None, metavar="ppl[:THRESHOLD[:TEXT_THRESHOLD]]",
                   help="reject prompts the perplexity filter flags (adversarial suffixes) with a 400 naming why, "
                        "scored in the request's own prefill; ppl: the model's calibrated thresholds "
                        "(docs/robust.md), or THRESHOLD nats/token (TEXT_THRESHOLD: raw completion prompts apart)")
    p.add_argument("--speculative", dest="serve_speculative", default=None, metavar="ngram[:N[:K]]",
                   help="decode every request speculatively unless it asks otherwise (attnlab.speculative: "
                        "ngram[:N[:K]] or none): the same tokens, drafts verified in the batched step")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="conversations prefilling or decoding together (one batched decode step); the rest wait")
    p.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request waits for a slot, then 503")
    p.add_argument("--chunk", type=positive_int, default=512,
                   help="prefill chunk (bounded caches hold budget + chunk; smaller: less memory per conversation, slower prefill)")
    p.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds a request may take to send its headers, else 408 and closed")
    p.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds a request may take to send its body after the headers, else 408 and closed")
    p.add_argument("--send-timeout", type=positive_float, default=30.0,
                   help="seconds a client may leave its reply unread (socket buffers full), else the connection is "
                        "closed")
    p.add_argument("--keep-alive", type=positive_float, default=5.0, help="seconds an idle connection is kept open")
    p.add_argument("--max-connections", type=positive_int, default=512, help="open connections, all clients")
    p.add_argument("--max-connections-per-client", type=positive_int, default=64,
                   help="open connections from one client address (beyond: closed when accepted)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="accept 'Authorization: Bearer KEY' (repeatable; also ATTNLAB_API_KEYS, --api-keys-file)")
    p.add_argument("--api-keys-file", metavar="PATH", help="file with one API key per line")
    p.add_argument("--admin-key", action="append", metavar="KEY", help="a key that also sees every conversation")
    p.add_argument("--insecure-no-auth", action="store_true", help="serve a non-loopback address without keys")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="extra Host header name to answer (default: the bound address and localhost; '*': any)")
    p.add_argument("--openapi", action="store_true", help="serve the API schema at /openapi.json")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN", help="allow browser calls from this origin")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="N servers as a Ray Serve application (pip install 'attnlab[scale]'), each conversation "
                        "routed to the replica holding its cache")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="with --replicas: the Ray cluster to join (HOST:PORT or auto; default: a local instance)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log verbosity")
    p.set_defaults(func=cmd_serve)
