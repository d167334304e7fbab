"""Every error a user can cause: exit 2 and one line (130 + a resume hint for Ctrl-C), no traceback, no model load."""
from __future__ import annotations

import argparse
import io
import subprocess
import sys

import pytest

from attnlab.cli import build_parser
from tests.model_files import write_gguf
from tests.test_cli import run


def one_line_error(code, err, expect):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expect in lines[0] and "Traceback" not in err, err


@pytest.fixture
def no_model_load(monkeypatch):
    """Option errors must be found before the (slow) model load: loading fails the test."""
    def refuse(*a, **k):
        raise AssertionError("model loaded before the options were checked")
    for mod in ("attnlab.cli", "attnlab.cli.stream", "attnlab.cli.analysis"):
        monkeypatch.setattr(f"{mod}.load_lm", refuse)


@pytest.fixture
def small_text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 20)
    return path


@pytest.mark.parametrize("argv,expect", [
    (["generate", "--prompt", "hi", "--temperature", "nan"], "must be a finite number"),
    (["generate", "--prompt", "hi", "--dtype", "f16"], "invalid choice 'f16' (choose from float32, bfloat16, file)"),
    (["generate", "--prompt", "hi", "--top-p", "inf"], "must be a finite number"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "--prompt", "caf\udce9"], "--prompt is not valid UTF-8"),  # b"caf\xe9" via surrogateescape
    (["generate", "--prompt", "hi", "--policy", "nosuch"], "unknown"),
    (["stream", "--paired", "-5"], "must be >= 0"),
    (["stream", "--bins", "-3"], "must be >= 0"),
    (["stream", "--offset", "-1"], "must be >= 0"),
    (["stream", "--n-sink", "-1"], "must be >= 0"),
    (["train", "--heads", "3", "--dim", "16", "--out", "{tmp}/run"], "--dim 16 must split into --heads 3"),
    (["train", "--heads", "4", "--kv-heads", "3", "--dim", "32", "--out", "{tmp}/run"], "multiple of --kv-heads 3"),
    (["train", "--out", "{text}"], "is a file"),
    (["ppl", "--text", "{text}", "--tokens", str(10**12)], "asks for 1000000000000 tokens"),
    (["stream", "--text", "{text}", "--tokens", str(10**9)], "asks for 1000000000 tokens"),
    (["ppl", "--text", "{bad}"], "cannot read corpus"),  # a text file that is not UTF-8
    (["stream", "--text", "{bad}"], "cannot read corpus"),
])
def test_bad_option_one_line_before_load(argv, expect, tmp_path, small_text, capsys, no_model_load):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Wherefore art thou, Rom\xe9o?".encode("latin-1"))
    argv = [a.format(tmp=tmp_path, text=small_text, bad=bad) for a in argv]
    code, _, err = run(capsys, *argv)
    one_line_error(code, err, expect)


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf")


@pytest.mark.parametrize("stdin", [b"hello \xff\xfe there\n", b"\xc3\n"])
def test_chat_non_utf8_input(stdin, tiny_gguf, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code, _, err = run(capsys, "chat", str(tiny_gguf))
    one_line_error(code, err.split("\n", 1)[1], "chat input is not valid UTF-8")  # after the banner line


def test_chat_surrogate_escaped_input(tiny_gguf, capsys, monkeypatch):
    """Under a C locale Python decodes stdin with surrogateescape: the bad bytes arrive as surrogates."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8",
                                                       errors="surrogateescape"))
    code, _, err = run(capsys, "chat", str(tiny_gguf))
    one_line_error(code, err.split("\n", 1)[1], "chat input is not valid UTF-8")


def test_ctrl_c_on_resumable_run_says_how_to_resume(small_text, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("attnlab.cli.stream.load_lm", interrupted)
    code, _, err = run(capsys, "stream", "--text", str(small_text), "--tokens", "16")
    assert code == 130 and "rerun the same command to resume" in err and "Traceback" not in err
    monkeypatch.setattr("attnlab.model.metadata.read_config", interrupted)
    code, _, err = run(capsys, "info")
    assert code == 130 and err.strip() == "attnlab: interrupted"


def test_os_errors_are_one_line(capsys, monkeypatch):
    """An unwritable --out or an unreadable file surfaces as OSError from deep inside a command."""
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "/root/runs/x.json")
    monkeypatch.setattr("attnlab.model.metadata.read_config", denied)
    code, _, err = run(capsys, "info")
    one_line_error(code, err, "Permission denied: '/root/runs/x.json'")


def test_closed_pipe_is_quiet(tiny_gguf):
    """`attnlab info | head -0`: the reader is gone before anything is written."""
    proc = subprocess.Popen([sys.executable, "-m", "attnlab", "info", str(tiny_gguf)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def _options(parser, prefix=""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prefix} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prefix, action


def test_every_option_has_help_with_default():
    parser = build_parser()
    missing = [f"{cmd} {a.option_strings or a.dest}" for cmd, a in _options(parser) if not a.help]
    assert not missing, missing
    text = parser._subparsers._group_actions[0].choices["stream"].format_help()
    assert "(default: 2048)" in " ".join(text.split())  # a sane stream length, shown


def test_model_load_status_line(monkeypatch, tiny_gguf, capsys):
    """Where progress bars show (a terminal, or ATTNLAB_PROGRESS=1), a model load says it is running."""
    monkeypatch.setenv("ATTNLAB_PROGRESS", "1")
    code, _, err = run(capsys, "generate", str(tiny_gguf), "--prompt", "hi")
    assert code == 2 and err.startswith(f"loading {tiny_gguf} ... ") and " s\n" in err and "no tokenizer" in err
    monkeypatch.delenv("ATTNLAB_PROGRESS")
    code, _, err = run(capsys, "generate", str(tiny_gguf), "--prompt", "hi")
    assert code == 2 and "loading" not in err


def test_piped_chat_keeps_turns_apart(smollm2, capsys, monkeypatch):
    """Piped input gets no `you> ` prompts run into the replies: each turn is echoed on its own line."""
    monkeypatch.setattr("attnlab.cli.load_lm", lambda args, **kw: smollm2)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello\nBye\n"), encoding="utf-8"))
    code, out, _ = run(capsys, "chat", "--max-new-tokens", "3")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "you> Hello" and lines[1].startswith("bot> ") and lines[2] == "you> Bye", out


def test_dtype_file_is_the_files_own_formats():
    """`--dtype file` asks for the file's formats where a command's default is float32 (dejavu's)."""
    p = build_parser()
    assert p.parse_args(["dejavu", "bench", "--dtype", "file"]).dtype is None
    assert p.parse_args(["dejavu", "bench"]).dtype == "float32"
    assert p.parse_args(["generate", "--prompt", "hi"]).dtype is None

