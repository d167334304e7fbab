"""Every serving limit in one validated object (`attnlab.serve.config`), and `Server` taking it whole."""
from __future__ import annotations

import inspect

import pytest

from attnlab.errors import AttnlabError
from attnlab.serve.config import Keys, Limits, ServeConfig


def test_server_takes_at_most_four_parameters():
    from attnlab.serve import Server, create_app
    assert len(inspect.signature(Server.__init__).parameters) <= 4  # self, lm, config, keys
    assert list(inspect.signature(create_app).parameters) == ["lm", "config", "keys"]


@pytest.mark.parametrize("fields,message", [
    (dict(max_active=0), "--max-active must be a whole number >= 1, got 0"),
    (dict(key_active=9), r"--max-active-per-key \(9\) is more than --max-active \(8\)"),
    (dict(key_bytes=2 << 30), r"--max-cache-mib-per-key \(2147483648\) is more than --max-cache-mib"),
    (dict(queue_timeout=0), "--queue-timeout must be positive, got 0"),
    (dict(max_sessions=True), "--max-sessions must be a whole number"),
    (dict(http=None), "http must be a Limits"),
    (dict(speculative="self:sink:64"), "--speculative: the server drafts with ngram"),
    (dict(speculative="ngram:3:17"), "--speculative: at most K = 16"),
    (dict(speculative="ngram:x"), "bad speculative spec"),
])
def test_bad_limits_are_one_line_errors_naming_the_flag(fields, message):
    with pytest.raises(AttnlabError, match=message) as e:
        ServeConfig("m", **fields)
    assert "\n" not in str(e.value)


def test_speculative_spec_is_parsed_once():
    assert str(ServeConfig("m", speculative="ngram:2:a6").speculative) == "ngram:2:a6"
    assert ServeConfig("m", speculative="none").speculative is None and ServeConfig("m").speculative is None


def test_http_limits_and_quotas_and_replicas():
    with pytest.raises(AttnlabError, match="--send-timeout must be positive"):
        Limits(send_timeout=0)
    c = ServeConfig("m", max_sessions=16, max_bytes=1 << 30, max_tokens=5000)
    assert c.max_tokens_cap == 5000  # the default reply is always allowed
    assert c.quotas(Keys(["a" * 8, "b" * 8], ["c" * 8])) == (5, (1 << 30) // 3)
    assert c.quotas(Keys()) == (16, 1 << 30)
    each = ServeConfig("m", max_sessions=16, max_bytes=1 << 30, key_sessions=8, replicas=4).per_replica()
    assert (each.max_sessions, each.max_bytes, each.key_sessions, each.replicas) == (4, 1 << 28, 2, 1)
    assert ServeConfig("m", guard=None).guard is None  # room for issue 60's --guard


def test_the_command_line_builds_the_config_once(monkeypatch):
    from attnlab.cli import build_parser
    import attnlab.cli.serve as cli
    args = build_parser().parse_args(["serve", "m.gguf", "--max-active", "4", "--max-active-per-key", "2",
                                      "--max-cache-mib", "64", "--send-timeout", "5", "--replicas", "2"])
    c = cli.serve_settings(args, "m", ServeConfig("x").spec, ["127.0.0.1"])
    assert (c.max_active, c.key_active, c.max_bytes, c.http.send_timeout, c.replicas) == (4, 2, 64 << 20, 5.0, 2)
    assert c.per_replica().max_bytes == 32 << 20


def test_the_servers_speculation_gives_way_to_a_policy_that_cannot_cut_back(smollm2):
    """--speculative is the default; a request whose policy scores by attention decodes plainly (asking for
    speculation with such a policy is refused by the scheduler: tests/serve/test_scheduler_speculative.py)."""
    from attnlab.options import PolicySpec
    from attnlab.serve import create_app
    from attnlab.serve.protocol import ChatRequest
    server = create_app(smollm2, ServeConfig("m", PolicySpec("sink", 64, 4, "cache"), speculative="ngram:3:4")
                        ).state.server

    def plan(**attnlab):
        return server.checks.request(ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 attnlab=attnlab)).speculative
    assert str(plan()) == "ngram:3:4"
    assert plan(policy="h2o", budget=64) is None
    assert plan(speculative="none") is None and str(plan(speculative="ngram:2:2")) == "ngram:2:2"
