"""Decode-path quality table, ours beside llama.cpp's own numbers on the same file and text.

Reference: the fp32 weights of the embedded SmolLM2 Q4_1 file (`make_gguf.py smollm2-f32`, the same
numbers our loader dequantises to). Ours: each format's decode path (attnlab.eval.decode_kl: chunks of
n_ctx tokens of the test plays, first half prefilled, second half one token per step), compiled where
asked, against the reference. llama.cpp: `llama-perplexity --kl-divergence-base` on the F32 file, then
`--kl-divergence` for each of its quantized files (the Q4_1 file itself; `smollm2-q4_k_m` from
llama-quantize), on the same text, same n_ctx and chunks. Plus the prefill-path perplexity of each file
on both engines (the way llama-perplexity scores). Everything is written to --out and resumes.

    python benchmarks/decode_kl.py --formats int8,int4:32,kmeans:4 --compile int4:32 --kv float16
    python benchmarks/decode_kl.py --files q4_k_m --formats '' --chunks 4      # perplexity of the Q4_K_M file
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402
import make_gguf  # noqa: E402

FILES = {"q4_1": "smollm2-135m", "q4_k_m": "smollm2-q4_k_m"}  # llama.cpp's rows: our name -> make_gguf name or embedded


def file_path(name: str) -> Path:
    from attnlab.model.files import resolve
    return resolve(name) if name == "smollm2-135m" else make_gguf.make(name)


def llama_perplexity(build: dict, model: Path, text: Path, n_ctx: int, chunks: int, threads: int,
                     kld: Path | None = None, base: bool = False) -> dict:
    """One llama-perplexity run -> its parsed numbers (and the command, for the docs)."""
    from attnlab.eval.decode_kl import parse_llama_perplexity
    cmd = [str(Path(build["bin"]) / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
           "--chunks", str(chunks), "-t", str(threads)]
    if build.get("ub1"):
        cmd += ["-ub", "1"]
    if kld is not None:
        cmd += ["--kl-divergence-base", str(kld)] + ([] if base else ["--kl-divergence"])
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip().splitlines()[-3:]}")
    return {**parse_llama_perplexity(r.stdout + r.stderr), "cmd": " ".join(cmd), "seconds": time.time() - t}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="int8,int4:32,kmeans:4", help="our --quant specs loaded from the Q4_1 file "
                   "(int4:32 keeps its Q4_1 blocks); 'file' = the file loaded with --quant unset")
    p.add_argument("--compile", default="", help="formats whose decode path runs compiled (lm.compile_decode)")
    p.add_argument("--kv", default="float32", help="our KV-cache dtype on the decode path (float32, float16, int8)")
    p.add_argument("--files", default="q4_1,q4_k_m", help=f"llama.cpp's quantized files, among {','.join(FILES)}; "
                   "each also loaded by us (--quant unset) where our loader reads it")
    p.add_argument("--file-paths", default="prefill,decode", help="our paths for each of --files (prefill is how "
                   "llama-perplexity computes; decode is one token per step)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/decode_kl"))
    args = p.parse_args(argv)

    import torch
    import attnlab
    from attnlab.data import corpus
    from attnlab.eval import decode_kl
    from attnlab.io import write_json, write_text
    from attnlab.model.tokenizer import load_tokenizer
    torch.set_num_threads(args.threads)
    print(llamacpp.header())
    ref_file = make_gguf.make("smollm2-f32")
    text = corpus("shakespeare:test")
    text_path = args.out / "shakespeare-test.txt"
    if not text_path.exists():
        write_text(text_path, text)
    tok = load_tokenizer(file_path("smollm2-135m"))
    ids = tok.encode(text, add_special_tokens=False)  # llama.cpp adds no BOS for this vocabulary either
    ident = {"reference": str(ref_file), "kv": args.kv, "text": "shakespeare:test"}

    def ours(spec, path="decode", source="smollm2-135m"):
        def load():
            quant = None if spec == "file" else spec
            lm = attnlab.LM.load(file_path(source), quant=quant, tokenizer=False, kv_dtype=args.kv)
            if spec in args.compile.split(","):
                lm.compile_decode()
            return lm
        return load, path

    formats = {}
    for spec in filter(None, args.formats.split(",")):
        formats[f"{spec}{' compiled' if spec in args.compile.split(',') else ''} decode"] = ours(spec)
    for f in filter(None, args.files.split(",")):
        for path in filter(None, args.file_paths.split(",")):
            formats[f"{f} file {path}"] = ours("file", path, FILES[f])
    reference = lambda: attnlab.LM.load(ref_file, tokenizer=False)  # noqa: E731
    rows = []
    for name, (load, path) in formats.items():  # one at a time: a format our loader cannot read is reported
        try:
            rows += decode_kl.evaluate(reference, {name: (load, path)}, ids, args.out, args.n_ctx, args.chunks, ident)
        except Exception as e:  # noqa: BLE001 - e.g. K-quant files before their loader lands
            rows.append({"format": name, "path": path, "error": f"{type(e).__name__}: {e}"[:200]})
            print(f"{name}: {rows[-1]['error']}", file=sys.stderr)

    builds = llamacpp.find_builds()
    cpp = {}
    if builds:
        build = builds.get("generic") or builds["native"]
        kld = args.out / f"llamacpp-base-c{args.n_ctx}-x{args.chunks}.kld"
        cpp["base"] = llama_perplexity(build, ref_file, text_path, args.n_ctx, args.chunks, args.threads, kld, True)
        for f in filter(None, args.files.split(",")):
            cpp[f] = llama_perplexity(build, file_path(FILES[f]), text_path, args.n_ctx, args.chunks, args.threads, kld)
    write_json(args.out / f"table-c{args.n_ctx}-x{args.chunks}-{args.kv}.json", {"ours": rows, "llamacpp": cpp,
               "args": vars(args) | {"out": str(args.out)}, "tokens": len(ids)})
    print(f"\nreference: {ref_file.name}; text: shakespeare:test ({len(ids)} tokens); n_ctx {args.n_ctx}, "
          f"{args.chunks} chunk(s), scored: second half of each; our KV cache {args.kv}\n")
    print("| engine | format / path | mean KL (nats/token) | KL median | KL p99 | top-1 agreement | PPL | PPL of reference |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| attnlab | {r['format']} | pending: {r['error']} | | | | | |")
        else:
            print(f"| attnlab | {r['format']} | {r['kl']:.5f} ± {r['kl_se']:.5f} | {r['kl_median']:.5f} | "
                  f"{r['kl_p99']:.4f} | {r['top1']:.4f} | {r['ppl']:.4f} | {r['ppl_ref']:.4f} |")
    for f, r in cpp.items():
        if f != "base":
            print(f"| llama.cpp | {f} file (batch) | {r.get('kl', float('nan')):.5f} ± {r.get('kl_se', 0):.5f} | "
                  f"{r.get('kl_median', float('nan')):.5f} | {r.get('kl_p99', float('nan')):.4f} | "
                  f"{r.get('top1', float('nan')):.4f} | {r.get('ppl', float('nan')):.4f} | {r.get('ppl_ref', float('nan')):.4f} |")
    if "base" in cpp:
        print(f"\nllama.cpp base PPL (F32 file): {cpp['base'].get('ppl')}; commands: {cpp['base']['cmd']}")


if __name__ == "__main__":
    main()
