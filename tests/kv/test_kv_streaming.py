"""Streaming evaluation: exactness of the fast paths, resumable runs, the stream/generate/chat commands."""
import json

import pytest
import torch

import attnlab
from attnlab.engine import LM
from attnlab.eval.streaming import bins, moving_average, paired, stream_nll
from attnlab.kv import Full, make_policy
from attnlab.model.llama import ModelConfig, Transformer


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, context_length=128)
    return LM(Transformer(cfg).eval())


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (2, 60), generator=torch.Generator().manual_seed(3))


def test_full_decode_equals_prefill_and_plain_logits(tiny, ids):
    dec = stream_nll(tiny, ids, Full(), mode="decode")["nll"]
    pre = stream_nll(tiny, ids, Full(), mode="prefill", chunk=16)["nll"]
    logits = tiny.logits(ids)[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    torch.testing.assert_close(dec, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pre, ref, atol=1e-5, rtol=1e-4)


def test_prefill_mode_refuses_evicting_policies(tiny, ids):
    with pytest.raises(ValueError, match="full"):
        stream_nll(tiny, ids, make_policy("sink", 8, chunk=1), mode="prefill")


def test_interrupted_stream_resumes_to_the_same_result(tiny, ids, tmp_path):
    policy = make_policy("sink_h2o", 12, chunk=1)
    whole = stream_nll(tiny, ids, policy)
    ckpt = tmp_path / "run.ckpt.pt"
    seen = []

    def crash(n):
        seen.append(n)
        if len(seen) == 33:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stream_nll(tiny, ids, policy, checkpoint=ckpt, save_every=10, progress=crash)
    assert torch.load(ckpt, weights_only=False)["t"] == 30
    again = stream_nll(tiny, ids, policy, checkpoint=ckpt, save_every=10)
    torch.testing.assert_close(again["nll"], whole["nll"])
    assert again["peak_tokens"] == 12  # slots held after each step never exceed the budget


def test_summaries():
    nll = torch.log(torch.tensor([[2.0, 2.0, 8.0, 8.0]]))
    assert [round(b["ppl"], 6) for b in bins(nll, 2)] == [2.0, 8.0]
    assert moving_average(torch.arange(5.0), 2).tolist() == [0.5, 1.5, 2.5, 3.5]
    p = paired(nll, torch.zeros_like(nll))
    assert p["ppl_ratio"] == pytest.approx(4.0)


# ---------------------------------------------------------------- the commands, on SmolLM2 (loaded once)

@pytest.fixture(scope="module")
def smol():
    return attnlab.load("smollm2-135m")


@pytest.fixture
def cli(smol, monkeypatch):
    import attnlab.cli as main_cli
    import attnlab.cli.stream as kv_cli
    monkeypatch.setattr(kv_cli, "load_lm", lambda args, **kw: smol)
    monkeypatch.setattr(main_cli, "load_lm", lambda args, **kw: smol)
    return main_cli.main


def test_stream_command_json_and_resume(cli, capsys, tmp_path):
    argv = ["stream", "--tokens", "48", "--streams", "2", "--policy", "full,sink,h2o", "--budget", "16",
            "--out", str(tmp_path), "--json", "--plot", str(tmp_path / "pos.png")]
    assert cli(argv) == 0
    out = json.loads(capsys.readouterr().out)["results"]
    assert [r["policy"] for r in out] == ["full", "sink", "h2o"]
    for r in out:
        assert set(r) >= {"policy", "budget", "tokens", "ppl", "kv_bytes", "tokens_per_s"}
        assert r["tokens"] == 2 * 47 and r["ppl"] > 1
    assert out[1]["budget"] == 16 and out[1]["kv_bytes"] < out[0]["kv_bytes"]
    assert (tmp_path / "pos.png").stat().st_size > 0
    saved = json.loads(next(tmp_path.glob("sink-16-*.json")).read_text())
    assert len(saved["nll_tokens"]) == 2 and len(saved["nll_tokens"][0]) == 47
    assert cli(argv) == 0  # finished runs are read back, not recomputed
    assert json.loads(capsys.readouterr().out)["results"] == out


@pytest.mark.parametrize("extra, message", [
    (["--policy", "sink", "--budget", "4"], "must exceed n_sink"),
    (["--policy", "h2o", "--budget", "1.5"], "(0, 1]"),
    (["--policy", "sink,lru"], "unknown policy"),
    (["--policy", "sink", "--budget", "2%", "--tokens", "100"], "must exceed n_sink"),
])
def test_stream_bad_options_one_line_error(extra, message, capsys):
    from attnlab.cli import main
    assert main(["stream", "--tokens", "64", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_generate_with_sink_policy_streams_past_its_budget(cli, capsys, smol, monkeypatch):
    sizes = []
    real = smol.new_cache

    def spy(*a, **kw):
        cache = real(*a, **kw)
        sizes.append(cache)
        return cache

    monkeypatch.setattr(smol, "new_cache", spy)
    assert cli(["generate", "--prompt", "The king said", "--policy", "sink", "--budget", "8",
                "--max-new-tokens", "24"]) == 0
    assert "The king said" in capsys.readouterr().out
    cache = sizes[0]
    assert cache.seen > 8 and len(cache) <= 8 and cache.layers[0].capacity == 8 + 512


def test_chat_with_sink_policy_never_overflows(smol):
    from attnlab.chat import ChatSession
    from attnlab.sampling import Sampler
    policy = make_policy("sink", 24, chunk=512)
    session = ChatSession(smol, Sampler(), 12, cache_factory=lambda: smol.new_cache(policy=policy))
    for question in ("Hi", "Name a colour", "And a fruit?"):
        reply = list(session.ask(question))
        assert reply
        assert len(session.cache) <= 24
    assert session.cache.seen > 60  # the conversation outgrew the budget without re-prefill or overflow


@pytest.mark.slow
def test_sinks_rescue_window_attention_on_real_text(smol):
    """StreamingLLM on SmolLM2: once the window slides, dropping the first tokens costs far more
    than keeping 4 sinks (2 x 320 test-play tokens, budget 64)."""
    from attnlab.data import corpus
    ids = torch.tensor(smol.encode(corpus("shakespeare:test"))[:640]).view(2, 320)
    ppl = {}
    for name in ("full", "window", "sink"):
        nll = stream_nll(smol, ids, make_policy(name, 64, chunk=1))["nll"][:, 64:]
        ppl[name] = float(nll.mean().exp())
    assert ppl["window"] > 1.5 * ppl["full"]
    assert ppl["sink"] < 1.5 * ppl["full"]


def test_stream_under_quest_scores_token_by_token_and_says_so(smol, monkeypatch, capsys, tmp_path):
    """Quest acts on single-token steps only: under --attention the full cache is decoded token by token (a
    chunked prefill would score plain full attention under Quest's name), and every row names the attention."""
    import attnlab.cli as main_cli
    import attnlab.cli.stream as kv_cli
    view = lambda args, **kw: smol.with_attention(args.attention)  # noqa: E731
    monkeypatch.setattr(kv_cli, "load_lm", view)
    monkeypatch.setattr(main_cli, "load_lm", view)
    argv = ["stream", "--tokens", "96", "--policy", "full", "--out", str(tmp_path)]
    assert main_cli.main([*argv, "--json"]) == 0
    [plain] = json.loads(capsys.readouterr().out)["results"]
    assert main_cli.main([*argv, "--json", "--attention", "quest:32"]) == 0
    [quest] = json.loads(capsys.readouterr().out)["results"]
    assert (plain["mode"], quest["mode"]) == ("prefill", "decode")
    assert quest["ppl"] != pytest.approx(plain["ppl"], rel=1e-4)  # 96 tokens, 32 read: Quest really chose
    assert main_cli.main([*argv, "--attention", "quest:32"]) == 0
    out = capsys.readouterr().out
    assert "full+quest:32:16" in out and "attends with quest:32:16" in out
