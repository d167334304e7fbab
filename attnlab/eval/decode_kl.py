"""Decode-path quality the way llama.cpp reports it (`llama-perplexity --kl-divergence`).

The text is cut into chunks of n_ctx tokens; in each, the first half is prefilled and the second
half is scored, as llama-perplexity scores (logits at positions n_ctx/2 .. n_ctx-2). On the decode
path ("decode") the scored half goes through the engine's step one token per step with a cache,
teacher-forced (the compiled step where the model was compiled): what generation runs, int8
activations and a float16 cache included. On the prefill path ("prefill") the whole chunk is one
batch, as llama-perplexity computes it. A format is compared with a reference model (the fp32
weights of the same file): mean KL(reference || format) per token, the share of tokens whose top-1
agrees, and both perplexities. Reference log-probabilities are saved once per text and reused; rows
are written after each format, so an interrupted run resumes.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from attnlab.errors import AttnlabError
from attnlab.io import keyed_name, progress, write_atomic, write_json


def chunks_of(ids, n_ctx: int, chunks: int | None = None) -> list[torch.Tensor]:
    """Disjoint n_ctx-token chunks from the start of ids (llama-perplexity's split), at most `chunks`."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if n_ctx < 4 or n_ctx % 2:
        raise AttnlabError(f"n_ctx must be an even number >= 4, got {n_ctx}")
    n = ids.numel() // n_ctx if chunks is None else min(chunks, ids.numel() // n_ctx)
    if n < 1:
        raise AttnlabError(f"need at least {n_ctx} tokens for one chunk of n_ctx={n_ctx}, got {ids.numel()}")
    return [ids[i * n_ctx:(i + 1) * n_ctx] for i in range(n)]


@torch.inference_mode()
def scored_logprobs(lm, chunk: torch.Tensor, path: str = "decode", bar=None) -> torch.Tensor:
    """Log-probabilities [n_ctx/2 - 1, vocab] (float32) at positions n_ctx/2 .. n_ctx-2 of one chunk.
    decode: prefill the first half, then one token per `lm.forward` step; prefill: the chunk as one batch."""
    n, first = chunk.numel(), chunk.numel() // 2
    cache = lm.new_cache(capacity=n)
    if path == "prefill":
        logits = lm.prefill(chunk[None], cache, chunk=n, all_logits=True)[0, first:n - 1]
        if bar is not None:
            bar.update(n - 1 - first)
        return torch.log_softmax(logits.float(), -1)
    if path != "decode":
        raise AttnlabError(f"path must be 'decode' or 'prefill', got {path!r}")
    lm.prefill(chunk[None, :first], cache)
    out = []
    for pos in range(first, n - 1):
        logits = lm.forward(chunk[None, pos:pos + 1], cache)
        out.append(torch.log_softmax(logits[0, -1].float(), -1))
        if bar is not None:
            bar.update(1)
    return torch.stack(out)


def compare(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> dict:
    """KL(ref || test) per token (mean, its standard error, median, 99th percentile), top-1 agreement, and
    the perplexity of both on targets; ref and test are log-probabilities [T, vocab]."""
    kl = (ref.exp() * (ref - test)).sum(-1).clamp_min(0)
    same = (ref.argmax(-1) == test.argmax(-1)).float()
    nll_ref = -ref.gather(1, targets[:, None])[:, 0]
    nll = -test.gather(1, targets[:, None])[:, 0]
    t = kl.numel()
    return {"kl": float(kl.mean()), "kl_se": float(kl.std() / math.sqrt(t)) if t > 1 else 0.0,
            "kl_median": float(kl.median()), "kl_p99": float(torch.quantile(kl.double(), 0.99)),
            "top1": float(same.mean()), "ppl": math.exp(float(nll.mean())), "ppl_ref": math.exp(float(nll_ref.mean())),
            "tokens": t}


def _merge(parts: list[dict]) -> dict:
    """Token-weighted means over chunks (perplexities through their mean NLL)."""
    n = sum(p["tokens"] for p in parts)
    w = lambda k: sum(p[k] * p["tokens"] for p in parts) / n  # noqa: E731
    out = {k: w(k) for k in ("kl", "kl_median", "kl_p99", "top1")}
    out["kl_se"] = math.sqrt(sum((p["kl_se"] * p["tokens"]) ** 2 for p in parts)) / n
    out["ppl"] = math.exp(sum(math.log(p["ppl"]) * p["tokens"] for p in parts) / n)
    out["ppl_ref"] = math.exp(sum(math.log(p["ppl_ref"]) * p["tokens"] for p in parts) / n)
    out["tokens"] = n
    return out


def evaluate(reference, formats: dict, ids, out: str | Path, n_ctx: int = 2048, chunks: int | None = 1,
             ident: dict | None = None) -> list[dict]:
    """Score each format against the reference on the same chunks of ids.

    reference: a loaded LM or a zero-argument function returning one (its log-probabilities are computed
    on the prefill path once and cached in `out`); formats: {row name: (function returning an LM, path)}
    with path "decode" or "prefill". Rows (+ their key) go to out/decode_kl-<hash>.json after every format.
    ident: what else the numbers depend on (model file, options), for the file's key."""
    out = Path(out)
    parts = chunks_of(ids, n_ctx, chunks)
    key = {"n_ctx": n_ctx, "chunks": len(parts), "ids": _digest(torch.cat(parts)), **(ident or {})}
    stem = keyed_name("decode_kl", key)
    rows_path, ref_path = out / f"{stem}.json", out / f"{stem}.reference.pt"
    done = {r["format"]: r for r in json.loads(rows_path.read_text())["rows"]} if rows_path.exists() else {}
    if ref_path.exists():
        ref = torch.load(ref_path)
    else:
        lm = reference() if callable(reference) else reference
        with progress(len(parts) * (n_ctx // 2 - 1), "reference") as bar:
            ref = [scored_logprobs(lm, c, "prefill", bar) for c in parts]
        del lm
        write_atomic(ref_path, lambda tmp: torch.save(ref, tmp))
    targets = [c[n_ctx // 2 + 1:] for c in parts]
    rows = []
    for name, (load, path) in formats.items():
        if name in done:
            rows.append(done[name])
            continue
        lm = load()
        with progress(len(parts) * (n_ctx // 2 - 1), name) as bar:
            got = [compare(r, scored_logprobs(lm, c, path, bar), t) for r, c, t in zip(ref, parts, targets)]
        del lm
        rows.append({"format": name, "path": path, **_merge(got)})
        write_json(rows_path, {"key": key, "rows": rows + [r for n, r in done.items() if n not in formats]})
    return rows


def _digest(ids: torch.Tensor) -> str:
    import hashlib
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16]


def parse_llama_perplexity(text: str) -> dict:
    """The numbers `llama-perplexity` prints: final PPL, and with --kl-divergence the mean KLD (± its
    uncertainty), median and 99th percentile KLD, and 'Same top p' (as a fraction)."""
    import re
    out = {}
    pats = {"ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)",
            "ppl_ref": r"Mean PPL\(base\)\s*:\s*([\d.]+)", "kl": r"Mean\s+KLD:\s*([-\d.]+)",
            "kl_se": r"Mean\s+KLD:\s*[-\d.]+\s*±\s*([\d.]+)", "kl_median": r"Median\s+KLD:\s*([-\d.]+)",
            "kl_p99": r"99\.0%\s+KLD:\s*([-\d.]+)", "top1": r"Same top p:\s*([\d.]+)"}
    for k, pat in pats.items():
        m = re.search(pat, text)
        if m:
            out[k] = float(m.group(1)) / (100 if k == "top1" else 1)
    if "ppl" not in out:
        m = re.search(r"Final estimate: PPL = ([\d.]+)", text)
        if m:
            out["ppl"] = float(m.group(1))
    return out
