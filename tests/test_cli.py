"""Command-line behaviour a user meets: one-line errors with exit code 2, machine-readable output."""
from __future__ import annotations

import json

import pytest

from attnlab.cli import main
from attnlab.model.loaders import resolve


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse rejects the option itself
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _truncated(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(resolve("smollm2-135m"), "rb") as f:
        path.write_bytes(f.read(2_000_000))
    return path


def _corrupt(tmp_path):
    path = tmp_path / "corrupt.gguf"
    with open(resolve("smollm2-135m"), "rb") as f:
        head = bytearray(f.read(4096))
    head[8:24] = b"\xff" * 16  # garbage tensor/metadata counts after a valid magic and version
    path.write_bytes(bytes(head))
    return path


@pytest.mark.parametrize("make_args,expect", [
    (lambda t: ["info", str(t / "missing.gguf")], "no such model file"),
    (lambda t: ["info", str((t / "x.gguf").write_text("hello") and t / "x.gguf")], "not a GGUF file"),
    (lambda t: ["info", str(_truncated(t))], "corrupt or truncated GGUF"),
    (lambda t: ["info", str(_corrupt(t))], "corrupt or truncated GGUF"),
    (lambda t: ["info", str(t)], "no config.json"),
    (lambda t: ["ppl", "--text", str((t / "e.txt").write_text("") is not None and t / "e.txt")], "empty"),
    (lambda t: ["ppl", "--text", "shakespeare:nosuchplay"], "unknown play"),
    (lambda t: ["ppl", "--tokens", "-5"], "at least 2"),
    (lambda t: ["generate", "--prompt", "hi", "--max-new-tokens", "-1"], "must be >= 0"),
])
def test_bad_input_gives_one_line_error(make_args, expect, tmp_path, capsys):
    code, _, err = run(capsys, *make_args(tmp_path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], err


def test_unsupported_architecture_names_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = run(capsys, "info", str(tmp_path))
    assert code == 2 and "llama" in err and "qwen2" in err


def test_debug_shows_traceback(tmp_path):
    with pytest.raises(Exception):
        main(["--debug", "info", str(tmp_path / "missing")])


def test_info_and_ppl_json(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0 and "llama" in out and "576" in out
    code, out, _ = run(capsys, "ppl", "--text", "shakespeare:hamlet", "--tokens", "64", "--json")
    result = json.loads(out)
    assert code == 0 and result["tokens"] == 63 and set(result) >= {"ppl", "nll", "tokens", "seconds"}
    assert 1 < result["ppl"] < 1000


def test_generate_streams_text(capsys):
    code, out, _ = run(capsys, "generate", "--prompt", "Once upon a time", "--max-new-tokens", "8")
    assert code == 0 and out.startswith("Once upon a time") and len(out) > len("Once upon a time") + 4
