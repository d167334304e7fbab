"""The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file (`make test-real`): what random-weight files cannot show.

Loaded in its own formats (q/k/v biases, an untied output matrix, a 151,936-token vocabulary, Q4_K, Q6_K,
Q5_0 and Q8_0 tensors), its chat template, its tokenizer equal to llama.cpp's on the test plays, perplexity
of our decode and prefill paths within 0.5% of `llama-perplexity` on the same file and tokens, and a
sensible greedy answer.
The file is fetched (`attnlab fetch`, verified by sha256) and llama.cpp built (`make bench-llamacpp`) here if
missing: the first run takes minutes. The perplexity setting: REAL_PPL_CTX (512) and REAL_PPL_CHUNKS (4).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen2.5-coder-0.5b"
N_CTX = int(os.environ.get("REAL_PPL_CTX", 512))
CHUNKS = int(os.environ.get("REAL_PPL_CHUNKS", 4))
NEEDS = ("llama-perplexity", "llama-tokenize")


def _bench(name: str):
    """A module of benchmarks/ (the llama.cpp helpers the benchmarks use: one way to run llama.cpp)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def path():
    from attnlab.model.fetch import fetch
    return fetch(MODEL, log=lambda line: print(line, file=sys.stderr))  # verified; fetched if missing


def _usable(builds: dict) -> dict | None:
    for name in ("generic", "native"):  # as benchmarks/decode_kl.py prefers
        b = builds.get(name)
        if b and all((Path(b["bin"]) / t).exists() for t in NEEDS):
            return b
    return None


@pytest.fixture(scope="module")
def llamacpp():
    """A llama.cpp build with llama-perplexity and llama-tokenize: found, else built (minutes, once)."""
    llamacpp = _bench("llamacpp")
    build = _usable(llamacpp.find_builds())
    if build is None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "build_llamacpp.py"), "--only", "native"],
                       check=True, cwd=ROOT, env=env)
        build = _usable(llamacpp.find_builds())
    assert build is not None, "make bench-llamacpp built no llama-perplexity/llama-tokenize"
    print(f"\nllama.cpp: {build['bin']} ({build.get('version')}, {build.get('note')})")
    return build


@pytest.fixture(scope="module")
def lm(path):
    import attnlab
    return attnlab.load(MODEL, compile=True, kv_dtype="float16")


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> Path:
    from attnlab.data import corpus
    out = tmp_path_factory.mktemp("real") / "shakespeare-test.txt"
    out.write_text(corpus("shakespeare:test"))
    return out


def test_loads_in_its_own_formats(lm, path):
    from attnlab.model.gguf_header import ggml_type, scan_gguf
    from attnlab.quant.linear import QuantLinear

    types = {ggml_type(t.ggml_type)[0] for t in scan_gguf(path).tensors.values()}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types, types  # mixed: 896-wide rows fall back from K-quants
    c = lm.cfg
    assert (c.arch, c.vocab_size, c.n_layers, c.dim, c.n_heads, c.n_kv_heads) == ("qwen2", 151936, 24, 896, 14, 2)
    assert c.qkv_bias and not c.tie_embeddings
    linears = {n: m for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear | QuantLinear)}
    plain = [n for n, m in linears.items() if not isinstance(m, QuantLinear)]
    assert not plain, f"dequantised to float: {plain[:3]}"  # every matrix stays in the file's blocks
    leaves = [p for m in linears.values() for p in (m.parts or [m])]
    formats = {(p.kind, p.group, p.bits, p.has_min) for p in leaves}
    assert len(formats) >= 3, formats  # the block formats kept apart, not promoted to one
    head = lm.model.lm_head
    assert isinstance(head, QuantLinear) and head.out_features == 151936  # its own matrix, not the embedding's
    bias = lm.model.layers[0].attn.wqkv.bias
    assert bias is not None and bias.shape == (896 + 2 * 128,) and float(bias.abs().max()) > 1.0
    assert lm.compiled is not None  # the native decode step runs this file


def test_chat_template(lm):
    text = lm.render_chat([{"role": "user", "content": "hi"}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = lm.chat_ids([{"role": "user", "content": "hi"}])
    im_start, im_end = lm.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (im_start, im_end) == (151644, 151645)
    assert ids[0] == im_start and ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert im_end in lm.eos_ids  # a reply stops at the end of its turn


def llama_tokenize(build: dict, path: Path, text_file: Path) -> list[int]:
    cmd = [str(Path(build["bin"]) / "llama-tokenize"), "-m", str(path), "-f", str(text_file), "--ids",
           "--log-disable"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("["))
    return json.loads(line)


def test_tokenizer_equals_llamacpp(lm, llamacpp, path, plays, tmp_path):
    theirs = llama_tokenize(llamacpp, path, plays)
    ours = lm.encode(plays.read_text())
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    assert len(ours) == len(theirs) and first is None, (len(ours), len(theirs), first)
    print(f"\ntest plays: {len(ours):,} tokens, equal to llama-tokenize's")
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("def f(x):\n    return x ** 2  # 12345 678\n\tnaïve café 東京 🙂  spaces   \n\n'don't' ÅÆ")
    assert lm.encode(mixed.read_text()) == llama_tokenize(llamacpp, path, mixed)


def test_perplexity_within_half_a_percent_of_llama_perplexity(lm, llamacpp, path, plays):
    from attnlab.eval.perplexity import adds_bos, llamacpp_perplexity
    theirs = _bench("decode_kl").llama_perplexity(llamacpp, path, plays, N_CTX, CHUNKS, threads=1)
    ids = lm.encode(plays.read_text())  # the same tokens (test_tokenizer_equals_llamacpp)
    bos = adds_bos(lm.tokenizer)
    ours = {p: llamacpp_perplexity(lm, ids, N_CTX, CHUNKS, p, bos) for p in ("prefill", "decode")}
    print(f"\nperplexity, test plays, {CHUNKS} chunks of {N_CTX} (second halves, {ours['decode']['tokens']} tokens), "
          f"BOS {bos}:\n  llama-perplexity {theirs['ppl']:.4f}  ({theirs['cmd']})")
    for p, r in ours.items():
        print(f"  attnlab {p:<8} {r['ppl']:.4f}  ({(r['ppl'] / theirs['ppl'] - 1) * 100:+.2f}%, {r['seconds']:.0f} s)")
    for p, r in ours.items():
        assert abs(r["ppl"] / theirs["ppl"] - 1) < 0.005, (p, r["ppl"], theirs["ppl"])


def test_greedy_answer_is_sensible(lm):
    answer = lm.generate("What is the capital of France? Answer in one word.", max_new_tokens=16, chat=True)
    assert "Paris" in answer and len(answer) < 40, answer  # and it stopped at the end of its turn
    code = lm.generate("Write a Python function `square(x)` that returns x squared. Only the code.",
                       max_new_tokens=48, chat=True)
    print(f"\nanswers: {answer!r}\n{code}")
    assert "def square(x)" in code and "return" in code, code
