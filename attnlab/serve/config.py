"""Every serving limit in one validated object: `ServeConfig` (and the API keys, `Keys`).

Why one object: the server, its admission, the session store, the HTTP layer and the replicas' front
all read the same limits; built once (from the command line by `attnlab serve`, directly in tests)
and checked once here, with one-line errors naming the flag, so no limit is forwarded keyword by
keyword or checked in two places. Defaults are `attnlab serve`'s.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from attnlab.errors import AttnlabError
from attnlab.options import PolicySpec

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Limits:
    """The HTTP layer's limits (docs/serve.md, "Limits"); seconds and connection counts."""
    header_timeout: float = 10.0    # request line + headers, from the first byte (or the connection, or the last reply)
    body_timeout: float = 30.0      # the whole body, from the end of the headers
    keep_alive: float = 5.0         # an idle connection between requests
    max_connections: int = 512      # open at once, all clients
    max_per_client: int = 64        # open at once from one client address
    send_timeout: float = 30.0      # a reply the client does not read for this long: the connection is closed
    send_buffer: int = 256 << 10    # bytes of reply held for a client (socket buffer, and as much again queued)
    log_interval: float = 10.0      # at most one line per interval for refused connections and accept errors

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise AttnlabError(f"{flag(f.name)} must be positive, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class Keys:
    """API keys (`Authorization: Bearer KEY`); admin keys also see every conversation. None at all: keyless."""
    api: tuple = ()
    admin: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "api", tuple(self.api))
        object.__setattr__(self, "admin", tuple(self.admin))

    @property
    def owners(self) -> int:
        """How many callers the quotas are split between (1 for a keyless server)."""
        return max(1, len(set(self.api) | set(self.admin)))


@dataclass(frozen=True)
class ServeConfig:
    """What one server (or each replica) serves and every limit it keeps.

    key_*: one key's share; None: the global limit split evenly between the keys (sessions, bytes), or
    the fairness defaults of `admission.Admission` (active: every slot while no other key waits, queued:
    4 x max_active). max_bytes counts every byte a conversation's cache holds (`LayerKV.nbytes`)."""
    model_name: str
    spec: PolicySpec = PolicySpec()          # the cache policy of a request that names none
    max_sessions: int = 16                   # conversations held (LRU beyond), all keys
    max_bytes: int = 1 << 30                 # cache bytes of all held conversations
    key_sessions: int | None = None
    key_bytes: int | None = None
    max_tokens: int = 256                    # a request's reply length when it gives none
    max_tokens_cap: int = 4096               # the largest max_tokens a request may ask (at least max_tokens)
    max_prompt_tokens: int = 32768
    max_body: int = 1 << 20                  # request body bytes
    max_active: int = 8                      # generations at once, all keys; the rest wait for a slot
    key_active: int | None = None            # generations of one key at once
    key_queued: int | None = None            # requests of one key waiting for a slot; beyond: 429
    queue_timeout: float = 60.0              # seconds a request waits for a slot, then 503
    max_batch: int = 8                       # rows of one scheduler step
    chunk: int = 512                         # prefill chunk
    http: Limits = Limits()                  # deadlines and connection caps of the HTTP layer
    hosts: tuple = LOOPBACK                  # Host header names answered
    openapi: bool = False
    cors_origins: tuple = ()
    replicas: int = 1                        # servers sharing the limits above (each keeps 1/replicas of them)
    guard: object = None                     # a request guard (issue 60): None, none
    speculative: object = None               # how a request that names none decodes: None (plain) or an ngram spec

    def __post_init__(self):
        if not self.model_name:
            raise AttnlabError("the served model needs a name")
        for name in ("max_sessions", "max_bytes", "max_tokens", "max_tokens_cap", "max_prompt_tokens", "max_body",
                     "max_active", "max_batch", "chunk", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AttnlabError(f"{flag(name)} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.http, Limits):
            raise AttnlabError(f"http must be a Limits (deadlines and connection caps), got {self.http!r}")
        if not self.queue_timeout > 0:
            raise AttnlabError(f"{flag('queue_timeout')} must be positive, got {self.queue_timeout!r}")
        for name, whole in (("key_sessions", "max_sessions"), ("key_bytes", "max_bytes"),
                            ("key_active", "max_active"), ("key_queued", None)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AttnlabError(f"{flag(name)} must be a whole number >= 1, got {value!r}")
            if whole and value > getattr(self, whole):
                raise AttnlabError(f"{flag(name)} ({value}) is more than {flag(whole)} ({getattr(self, whole)})")
        if self.max_tokens_cap < self.max_tokens:
            object.__setattr__(self, "max_tokens_cap", self.max_tokens)  # the default reply is always allowed
        object.__setattr__(self, "speculative", served_speculative(self.speculative, "--speculative"))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))

    def quotas(self, keys: Keys) -> tuple[int, int]:
        """(sessions, bytes) one key may hold: its own setting, else the global limit split between the keys."""
        n = keys.owners
        return self.key_sessions or max(1, self.max_sessions // n), self.key_bytes or self.max_bytes // n

    def per_replica(self) -> ServeConfig:
        """The config each of `replicas` servers runs: the cache and session limits divided between them,
        so N replicas together hold at most what one server would (docs/serve.md, "Replicas")."""
        n = self.replicas
        if n == 1:
            return self
        def part(v):
            return None if v is None else max(1, v // n)
        return replace(self, max_sessions=max(1, self.max_sessions // n), max_bytes=max(1, self.max_bytes // n),
                       key_sessions=part(self.key_sessions), key_bytes=part(self.key_bytes), replicas=1)


MAX_DRAFTS, MAX_NGRAM = 16, 8  # a request's K and N at most: a verification row is K + 1 rows of everyone's step


def served_speculative(text, where: str):
    """A speculative spec the server decodes with (None or 'none': plain). ngram only: a draft model or the model
    drafting for itself keeps a second cache per conversation, which the session store does not count."""
    from attnlab.speculative import SpeculativeSpec
    if text is None or text == "none":
        return None
    spec = SpeculativeSpec.parse(text)
    if spec.kind != "ngram":
        raise AttnlabError(f"{where}: the server drafts with ngram[:N[:K]] only, not {spec.kind} (a draft model "
                           f"or self-drafting would hold a second cache per conversation)")
    if spec.k > MAX_DRAFTS or spec.n > MAX_NGRAM:
        raise AttnlabError(f"{where}: at most K = {MAX_DRAFTS} drafts and N = {MAX_NGRAM}, got {spec}")
    return spec


FLAGS = {"max_bytes": "--max-cache-mib", "key_sessions": "--max-sessions-per-key",
         "key_bytes": "--max-cache-mib-per-key", "key_active": "--max-active-per-key",
         "key_queued": "--max-queued-per-key", "max_body": "--max-body-kib",
         "max_per_client": "--max-connections-per-client"}


def flag(name: str) -> str:
    """The command-line flag of a config field, for error messages."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))
