"""GGUF files the benchmarks need, written to ~/.cache/attnlab/bench (never committed).

- `smollm2-f32.gguf` / `smollm2-f16.gguf`: the embedded SmolLM2 Q4_1 file dequantised (the "fp32 weights of
  the same file": the reference for KL); `smollm2-q4_k_m.gguf`: llama.cpp's `llama-quantize --allow-requantize`
  of the F16 file (a real K-quant file: SmolLM2's 576-wide rows make many tensors fall back to Q5_0/Q8_0).
- `llama1b-{q4_0,q4_1,q4_k_m}.gguf`: a Llama-3.2-1B-shaped model (dim 2048, 16 layers, 32/8 heads, FFN 8192,
  SmolLM2's tokenizer so ours loads it, tied Q8_0 embedding) with random weights: speed and loading at a
  realistic size. Q4_0/Q4_1 through `gguf.quants.quantize`, Q4_K_M by llama-quantize from an F16 file.
- `qwen15b-q4_k_m.gguf`: a Qwen2.5-1.5B-shaped model (qwen2: dim 1536, 28 layers, 12/2 heads, FFN 8960, q/k/v
  biases, tied embedding, the Qwen2.5 tokenizer of the fetched 0.5B file: `attnlab fetch qwen2.5-coder-0.5b`)
  with random weights, by llama-quantize from `qwen15b-f16.gguf` (3 GiB; deleted after): the size people run,
  every matrix a K-quant (1536 and 8960 are multiples of 256), as the real file's.

    python benchmarks/make_gguf.py smollm2-f32 smollm2-q4_k_m llama1b-q4_0     # or: all
  `qwen15b-kq.gguf`: the same tensors in the same types (Q6_K head, Q6_K v and down where llama-quantize's
  Q4_K_M rule gives more bits, Q4_K elsewhere) written as random valid blocks, without llama.cpp: the same bytes
  a token reads, for timing ours where llama.cpp is not built; not llama-quantize's output.

    python benchmarks/make_gguf.py qwen15b-q4_k_m    # ~/.cache/attnlab/bench/qwen15b-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402

OUT = Path(os.environ.get("ATTNLAB_BENCH_FILES", Path.home() / ".cache" / "attnlab" / "bench"))
LLAMA1B = {"block_count": 16, "embedding_length": 2048, "feed_forward_length": 8192, "attention.head_count": 32,
           "attention.head_count_kv": 8, "context_length": 8192, "rope.dimension_count": 64}
QWEN15B = {"block_count": 28, "embedding_length": 1536, "feed_forward_length": 8960, "attention.head_count": 12,
           "attention.head_count_kv": 2, "context_length": 32768, "rope.freq_base": 1000000.0,
           "attention.layer_norm_rms_epsilon": 1e-6}
NAMES = ["smollm2-f32", "smollm2-f16", "smollm2-q4_k_m", "llama1b-q4_0", "llama1b-q4_1", "llama1b-f16",
         "llama1b-q4_k_m", "qwen15b-f16", "qwen15b-q4_k_m", "qwen15b-kq"]


def _embedded():
    import gguf
    from attnlab.model.files import resolve
    return gguf.GGUFReader(str(resolve("smollm2-135m")))


def _writer(path: Path, reader, overrides: dict, name: str, arch: str = "llama", general: bool = True):
    """An `arch` GGUF writer with every metadata key of reader's file (tokenizer included), arch.* keys
    replaced by overrides, general.file_type dropped (llama-quantize and the loaders read the tensors); without
    `general`, every general.* key dropped (another model's name, size and finetune)."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", "general.name") \
                or (not general and key.startswith("general.")):
            continue
        if key.startswith(f"{arch}.") and key[len(arch) + 1:] in overrides:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for key, value in overrides.items():
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{arch}.{key}", value, kind)
    w.add_name(name)
    return w


def _finish(w, path: Path) -> Path:
    """Write the file under a temporary name and rename it into place (no half-written file is ever used)."""
    tmp = Path(str(path) + ".tmp")
    w.path = tmp
    w.write_header_to_file(path=tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    tmp.rename(path)
    return path


def smollm2_dense(path: Path, dtype: str) -> Path:
    """The embedded file with every tensor dequantised (matrices to dtype F32 or F16; norms F32)."""
    import gguf
    r = _embedded()
    w = _writer(path, r, {}, f"SmolLM2-135M-Instruct dequantised ({dtype})")
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.astype(np.float16) if dtype == "F16" and a.ndim == 2 else a)
    return _finish(w, path)


def llama1b(path: Path, qtype: str, seed: int = 0) -> Path:
    """Random weights (normal, std 0.02; norms 1) in the 1B shape; matrices in qtype, the tied embedding in
    Q8_0 (F16 when qtype is F16, the input of llama-quantize)."""
    import gguf
    c = LLAMA1B
    d, ff, h, kv = c["embedding_length"], c["feed_forward_length"], c["attention.head_count"], c["attention.head_count_kv"]
    hd = d // h
    r = _embedded()
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    w = _writer(path, r, {**c, "rope.freq_base": 500000.0, "vocab_size": vocab},
                f"Llama-3.2-1B-shaped, random weights ({qtype})")
    q = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)

    def mat(name, rows, cols, kind):
        a = (0.02 * rng.standard_normal((rows, cols), dtype=np.float32))
        if kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)

    emb = gguf.GGMLQuantizationType.F16 if qtype == "F16" else gguf.GGMLQuantizationType.Q8_0
    mat("token_embd.weight", vocab, d, emb)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(c["block_count"]):
        for n, rows, cols in (("attn_q", d, d), ("attn_k", kv * hd, d), ("attn_v", kv * hd, d),
                              ("attn_output", d, d), ("ffn_gate", ff, d), ("ffn_up", ff, d), ("ffn_down", d, ff)):
            mat(f"blk.{i}.{n}.weight", rows, cols, q)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    return _finish(w, path)


def more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M makes Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def qwen15b(path: Path, seed: int = 0, blocks: bool = False) -> Path:
    """Random F16 weights (normal, std 0.02; biases 0.02; norms 1) in Qwen2.5-1.5B's shape, tied embedding,
    with the tokenizer and chat template of the fetched Qwen2.5 0.5B file: llama-quantize's input. With
    `blocks`, the matrices as Q4_K_M's types instead, random valid blocks (fp16 factors ~N(0, 1e-3))."""
    from attnlab.model.files import resolve
    import gguf
    c = QWEN15B
    d, ff, h, kv = c["embedding_length"], c["feed_forward_length"], c["attention.head_count"], c["attention.head_count_kv"]
    hd = d // h
    r = gguf.GGUFReader(str(resolve("qwen2.5-coder-0.5b")))
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    name = f"Qwen2.5-1.5B-shaped, random weights ({'Q4_K_M types' if blocks else 'F16'})"
    w = _writer(path, r, {**c, "rope.dimension_count": hd}, name, arch="qwen2", general=False)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return 0.02 * rng.standard_normal(shape, dtype=np.float32)

    def mat(name, rows, cols, six=False):
        if not blocks:
            return w.add_tensor(name, normal(rows, cols).astype(np.float16))
        kind = gguf.GGMLQuantizationType.Q6_K if six else gguf.GGMLQuantizationType.Q4_K
        size = 210 if six else 144  # bytes per 256 weights; fp16 d at 208 (Q6_K), d and dmin at 0 and 2 (Q4_K)
        raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        for at in ([208] if six else [0, 2]):
            raw[:, at:at + 2] = (1e-3 * rng.standard_normal(len(raw))).astype(np.float16).view(np.uint8).reshape(-1, 2)
        w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=kind)
    mat("token_embd.weight", vocab, d, six=True)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(c["block_count"]):
        for n, rows, cols in (("attn_q", d, d), ("attn_k", kv * hd, d), ("attn_v", kv * hd, d),
                              ("attn_output", d, d), ("ffn_gate", ff, d), ("ffn_up", ff, d), ("ffn_down", d, ff)):
            mat(f"blk.{i}.{n}.weight", rows, cols, n in ("attn_v", "ffn_down") and more_bits(i, c["block_count"]))
            if n in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{n}.bias", normal(rows))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    return _finish(w, path)


def quantize(src: Path, dst: Path, qtype: str = "Q4_K_M") -> Path:
    """llama.cpp's own quantizer (either build: both give the same file)."""
    builds = llamacpp.find_builds()
    if not builds:
        raise SystemExit("llama.cpp is not built: make bench-llamacpp")
    exe = Path(next(iter(builds.values()))["bin"]) / "llama-quantize"
    tmp = Path(str(dst) + ".tmp")
    subprocess.run([str(exe), "--allow-requantize", str(src), str(tmp), qtype], check=True,
                   stdout=subprocess.DEVNULL)
    tmp.rename(dst)
    return dst


def make(name: str, out: Path = OUT) -> Path:
    """The file called name (see NAMES), made once; its dependencies first."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.gguf"
    if path.exists():
        return path
    t = time.time()
    model, kind = name.split("-", 1)
    if model == "smollm2" and kind in ("f32", "f16"):
        smollm2_dense(path, kind.upper())
    elif kind == "q4_k_m":
        quantize(make(f"{model}-f16", out), path)
        if model == "qwen15b":  # 3 GiB of input made in a minute: not kept
            (out / f"{model}-f16.gguf").unlink()
    elif model == "qwen15b":
        qwen15b(path, blocks=kind == "kq")
    else:
        llama1b(path, kind.upper())
    print(f"{path}: {path.stat().st_size / 2**20:.0f} MiB in {time.time() - t:.0f} s")
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="+", help=f"'all' or any of {', '.join(NAMES)}")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    for name in NAMES if args.names == ["all"] else args.names:
        if name not in NAMES:
            raise SystemExit(f"unknown file {name!r}: one of {', '.join(NAMES)}")
        print(make(name, args.out))


if __name__ == "__main__":
    main()
