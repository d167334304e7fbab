"""What quantization costs in quality: perplexity and model bytes per weight format.

Each format is loaded from the same checkpoint and scored on the same tokens. Two
paths are measured because they multiply differently: `ppl` uses chunked prefill
(float activations times dequantised weights: the weight format alone), and
`ppl_decode` feeds tokens one at a time through the fused batch-1 kernels (int8 and
int4 also round activations to int8, as llama.cpp does), on the first
`decode_tokens` tokens. Results are written after every format, so an interrupted
sweep resumes where it stopped.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from attnlab.eval.perplexity import perplexity
from attnlab.io import save_figure, write_json



def bits_per_weight(model) -> float:
    """Stored bits per weight of the linear layers (codes plus scales / codebooks)."""
    from attnlab.quant.linear import QuantLinear, linear_names
    bits = n = 0
    for name in linear_names(model)[:-1]:  # the head's format is fixed (int8), compare the layers
        m = model.get_submodule(name)
        count = m.out_features * m.in_features
        bits += 8 * (m.nbytes if isinstance(m, QuantLinear) else m.weight.numel() * m.weight.element_size())
        n += count
    return bits / n


def evaluate(model_spec, specs: list[str], ids: list[int], out: Path, window: int = 2048,
             decode_tokens: int = 0, progress=None) -> list[dict]:
    """Perplexity of every format in specs ('fp32', 'bf16' or a --quant spec) on ids; rows also in out/quant.json."""
    from attnlab.engine import LM
    from attnlab.quant import model_bytes

    path = Path(out) / "quant.json"
    done = {r["format"]: r for r in json.loads(path.read_text())["rows"]} if path.exists() else {}
    key = {"model": str(model_spec), "tokens": len(ids), "window": window, "decode_tokens": decode_tokens}
    if done and json.loads(path.read_text()).get("key") != key:
        done = {}  # another model, text or size: start over rather than mix runs
    rows = []
    for spec in specs:
        if spec in done:
            rows.append(done[spec])
            continue
        t = time.perf_counter()
        lm = LM.load(model_spec, dtype="bfloat16" if spec == "bf16" else "float32", tokenizer=False,
                     quant=None if spec in ("fp32", "bf16") else spec)
        load_s = time.perf_counter() - t
        r = perplexity(lm, ids, window=window, progress=progress)
        row = {"format": spec, "ppl": r["ppl"], "nll": r["nll"], "tokens": r["tokens"],
               "model_mib": model_bytes(lm.model) / 2**20, "bits_per_weight": bits_per_weight(lm.model),
               "load_s": load_s, "seconds": r["seconds"]}
        if decode_tokens:
            d = perplexity(lm, ids[:decode_tokens + 1], window=window, chunk=1, progress=progress)
            row.update(ppl_decode=d["ppl"], decode_scored=d["tokens"])
        rows.append(row)
        write_json(path, {"key": key, "rows": rows})
    return rows


def plot(rows: list[dict], path, title: str) -> str:
    """Perplexity against stored bits per weight, one point per format."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in rows:
        ax.scatter(r["bits_per_weight"], r["ppl"], s=36)
        ax.annotate(r["format"], (r["bits_per_weight"], r["ppl"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per weight (linear layers; log scale)")
    ax.set_ylabel("perplexity (log scale; lower is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=110)
