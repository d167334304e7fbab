"""`attnlab stream` reuses a saved run only when nothing that changes its numbers has changed.

The model load and the scoring are replaced by fakes that count calls, so each case costs
milliseconds: what is tested is the keying, not the numbers (test_kv_streaming.py does those).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from attnlab.cli import main
from attnlab.model.loaders import resolve


@pytest.fixture
def fake(monkeypatch, tmp_path):
    calls = []

    def stream_nll(lm, ids, policy, mode="decode", chunk=256, progress=None, checkpoint=None, save_every=1024):
        calls.append(checkpoint)
        assert not checkpoint.exists(), "a checkpoint survived --force"
        return {"nll": torch.full((ids.shape[0], ids.shape[1] - 1), 2.0), "seconds": 1.0, "kv_bytes": 0,
                "peak_tokens": 0}

    lm = SimpleNamespace(encode=lambda text: [ord(c) % 97 for c in text], cfg=SimpleNamespace(context_length=64))
    monkeypatch.setattr("attnlab.cli.stream.load_lm", lambda args: lm)
    monkeypatch.setattr("attnlab.eval.streaming.stream_nll", stream_nll)
    text = tmp_path / "play.txt"
    text.write_text("Fair is foul, and foul is fair: hover through the fog and filthy air. " * 8)
    other = tmp_path / "other.txt"
    other.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 8)
    model = tmp_path / "same-model.gguf"
    os.symlink(resolve("smollm2-135m"), model)
    return SimpleNamespace(calls=calls, text=text, other=other, model=model, out=tmp_path / "runs")


def _stream(fake, *extra):
    base = {"--text": str(fake.text), "--policy": "sink", "--budget": "8", "--tokens": "24", "--streams": "1",
            "--offset": "0", "--chunk": "1", "--n-sink": "4", "--positions": "cache", "--dtype": "float32"}
    flags = [a for a in extra if a in ("--force",)]
    rest = [a for a in extra if a not in flags]
    base.update(dict(zip(rest[::2], rest[1::2])))
    model = base.pop("MODEL", "smollm2-135m")
    argv = ["stream", model, "--out", str(fake.out), "--json", *flags]
    for k, v in base.items():
        argv += [k, v]
    before = len(fake.calls)
    assert main(argv) == 0
    return len(fake.calls) - before


@pytest.mark.parametrize("change", [
    ("--text", "OTHER"), ("--n-sink", "2"), ("--dtype", "bfloat16"), ("MODEL", "SYMLINK"), ("--positions", "original"),
    ("--chunk", "4"), ("--tokens", "32"), ("--streams", "2"), ("--offset", "5"), ("--budget", "12"),
    ("--policy", "window"), ("TEXT_CONTENT", "changed"),
])
def test_changing_a_key_field_recomputes(change, fake, capsys):
    assert _stream(fake) == 1
    assert _stream(fake) == 0  # same command: read back
    key, value = change
    if key == "TEXT_CONTENT":  # same --text name, other words
        fake.text.write_text(fake.text.read_text().replace("foul", "fowl"))
        assert _stream(fake) == 1
        return
    value = {"OTHER": str(fake.other), "SYMLINK": str(fake.model)}.get(value, value)
    assert _stream(fake, key, value) == 1
    assert _stream(fake, key, value) == 0
    assert _stream(fake) == 0  # the first run's result is still there, untouched
    capsys.readouterr()


def test_quantization_slot_is_part_of_the_key():
    from attnlab.cli.stream import run_key
    from attnlab.kv.policies import make_policy
    policy = make_policy("sink", 8, chunk=1)
    a = run_key({"quant": None, "tokens": 8, "streams": 1}, "sink", policy, "decode")[0]
    b = run_key({"quant": "q8", "tokens": 8, "streams": 1}, "sink", policy, "decode")[0]
    assert a != b


def test_force_discards_checkpoint_and_corrupt_result_is_reported(fake, capsys):
    assert _stream(fake) == 1
    [result] = list(fake.out.glob("*.json"))
    ckpt = result.with_name(result.name[:-len(".json")] + ".ckpt.pt")
    result.write_text("{ not json")
    assert main(["stream", "--out", str(fake.out), "--text", str(fake.text), "--policy", "sink", "--budget", "8",
                 "--tokens", "24", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "unreadable" in err and "rerun with --force" in err
    ckpt.write_bytes(b"garbage")
    assert _stream(fake, "--force") == 1  # the fake asserts the checkpoint is gone
    assert json.loads(result.read_text())["identity"]["policy"] == "sink"


def test_corrupt_checkpoint_is_reported(tmp_path):
    from attnlab.eval.streaming import stream_nll
    from attnlab.kv.policies import make_policy
    from tests.conftest import tiny_lm
    ckpt = tmp_path / "run.ckpt.pt"
    for damage in (b"garbage", None):
        if damage is None:
            torch.save({"t": 10**6, "nll": torch.zeros(1, 3), "seconds": 0.0, "peak_tokens": 0, "cache": {}}, ckpt)
        else:
            ckpt.write_bytes(damage)
        with pytest.raises(ValueError, match="checkpoint .* is corrupt or from another run"):
            stream_nll(tiny_lm(), torch.arange(12)[None], make_policy("window", 8, chunk=1).resolve(12),
                       checkpoint=ckpt)
