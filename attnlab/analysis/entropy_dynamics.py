"""J3: attention entropy of small causal Transformers while they learn real text (JoMA Figs. 6, 8).

Models are the engine's Llama-style `Transformer` (pre-RMSNorm, RoPE, SwiGLU MLP),
dim 200, MLP width 200, 1 head, trained with `attnlab.train` on the Shakespeare
training plays (word tokens), bptt 35, batch 20, Adam without weight decay, clip 0.5,
constant learning rate. The paper used a post-LayerNorm encoder on WikiText2/103;
the architecture and corpus differ, so the curves are compared in shape only.

Logged every `eval_every` minibatches (and at step 0), per layer:
- entropy_chunk: attention entropy -sum a log(a + 1e-8), mean over query rows and heads,
  on one fixed validation chunk (the first validation batch);
- entropy_val:   the same averaged over all `eval_batches` validation batches;
- sink_mass_val: mean attention on position 0 over queries t >= 1;
- stable_rank:   ||W||_F^2 / ||W||_2^2 of the lower MLP weights (gate and up rows, [2h, d]);
- embed_abs_cos: mean |cos| over pairs of embedding vectors of the 1000 most frequent
  training tokens (random baseline sqrt(2 / (pi d)));
plus validation loss. Uniform causal attention over 35 tokens has entropy 2.63.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from attnlab.analysis.anatomy import row_entropy, run_with_probs
from attnlab.errors import AttnlabError

EARLY_EVALS = [2, 5, 10, 15, 20, 30, 40, 50, 60, 75]  # the entropy drop happens in the first ~50 minibatches
WORKERS = 2  # runs trained in parallel processes (one torch thread each)
SIZES = {
    "quick": dict(layers=(1, 2), lrs=(1e-3,), sweep_layers=2, sweep_lrs=(), steps=40, eval_every=10,
                  eval_batches=2, vocab_size=1000),
    "full": dict(layers=(5, 3, 2, 1), lrs=(1e-3,), sweep_layers=1, sweep_lrs=(3e-3, 3e-4), steps=400,
                 eval_every=20, eval_batches=5, vocab_size=2000),
}
# The paper's architecture (attnlab.analysis.postln) at the paper's lr; width/steps cut to fit a shared CPU.
POSTLN_SIZES = {
    "quick": dict(layers=(1, 2), lr=1e-4, steps=20, eval_batches=2, vocab_size=1000, dim=200),
    "full": dict(layers=(1, 2, 3, 5), lr=1e-4, steps=1000, eval_batches=5, vocab_size=2000, dim=200),
}
LATE_EVALS = [100, 150, 200, 300, 400, 500, 600, 800, 1000, 1250, 1500, 1750, 2000, 2500, 3000, 3500, 4000, 5000,
              6000, 7000, 8000, 10000, 12000, 15000, 20000]
UNIFORM_35 = sum(math.log(t) for t in range(1, 36)) / 35


def stable_rank(w: torch.Tensor) -> float:
    """||W||_F^2 / sigma_max(W)^2 of a matrix."""
    s = torch.linalg.svdvals(w.detach().float())
    return float((s ** 2).sum() / s[0] ** 2)


def embedding_cosines(emb: torch.Tensor) -> dict:
    """emb [n, d] -> mean |cos|, mean cos and std of cos over distinct pairs."""
    e = torch.nn.functional.normalize(emb.detach().float(), dim=-1)
    c = e @ e.T
    off = c[~torch.eye(len(c), dtype=torch.bool)]
    return {"embed_abs_cos": float(off.abs().mean()), "embed_mean_cos": float(off.mean()),
            "embed_std_cos": float(off.std())}


def make_probe(top_tokens: torch.Tensor):
    """probe(model, val_batches) -> the J3 numbers (see module docstring)."""

    def probe(model, val_batches) -> dict:
        L = model.cfg.n_layers
        ent = torch.zeros(L)
        sink = torch.zeros(L)
        chunk = None
        for b, (x, _) in enumerate(val_batches):
            e_b, s_b = torch.zeros(L), torch.zeros(L)

            def on_probs(i, p):
                e_b[i] = row_entropy(p).mean()
                s_b[i] = p[:, :, 1:, 0].mean()

            run_with_probs(model, x, on_probs)
            ent += e_b
            sink += s_b
            if b == 0:
                chunk = e_b.clone()
        n = len(val_batches)
        row = {"entropy_chunk": chunk.tolist(), "entropy_val": (ent / n).tolist(), "sink_mass_val": (sink / n).tolist(),
               "stable_rank": [stable_rank(layer.mlp.w13.weight) for layer in model.layers]}
        row.update(embedding_cosines(model.embed.weight[top_tokens]))
        return row

    return probe


def curve_summary(steps: list[int], values: list[float]) -> dict:
    """start, min (and its step), end; drop = start - min, rebound = end - min."""
    v = torch.tensor(values, dtype=torch.float64)
    i = int(v.argmin())
    drop, rebound = float(v[0] - v[i]), float(v[-1] - v[i])
    return {"start": float(v[0]), "min": float(v[i]), "argmin_step": steps[i], "end": float(v[-1]),
            "drop": drop, "rebound": rebound, "bounces_back": bool(rebound > 0.1 * max(drop, 1e-9) and rebound > 0.02)}


def train_one(out: Path, n_layers: int, lr: float, seed: int, size: dict, progress: bool, tokenizer=None):
    """Train one J3 model; returns (evaluation rows, tokenizer)."""
    from attnlab.io import progress as bar
    from attnlab.train import TrainConfig, Trainer

    cfg = TrainConfig(n_layers=n_layers, lr=lr, seed=seed, steps=size["steps"], eval_every=size["eval_every"],
                      eval_batches=size["eval_batches"], vocab_size=size["vocab_size"], ckpt_every=100,
                      eval_at=[s for s in EARLY_EVALS if s < size["steps"]],
                      keep_checkpoints=1)
    resume = (out / "latest.json").exists()
    tr = Trainer(cfg, out, resume=resume, tokenizer=tokenizer)
    counts = torch.bincount(tr.train_ids, minlength=tr.tokenizer.vocab_size)
    counts[0] = 0  # <unk> is not a word
    tr.probe = make_probe(counts.argsort(descending=True)[:1000])
    with bar(cfg.steps - tr.step, f"J3 L{n_layers} lr {lr:g}", unit="batch") as pb:
        if not progress:
            pb.disable = True
        tr.run(progress=pb)
    return tr.log_rows(), tr.tokenizer


def _train_job(job) -> list[dict]:
    return train_one(*job)[0]


def run_attention_entropy(out, seed: int = 0, size: str = "full", progress: bool = True, arch: str = "llama",
                          lr: float = 0.0, steps: int = 0, seeds: int = 1, layers: str = "") -> dict:
    """The registry entry: train every configuration of SIZES[size] into out/runs/, then plot.

    arch "postln" runs the paper's architecture instead (``run_postln``); for "llama", ``lr`` /
    ``steps`` > 0 replace the size's learning rates (no sweep) / minibatch count."""
    if arch not in ("llama", "postln"):
        raise AttnlabError(f"unknown --arch {arch!r}; choose llama or postln")
    if lr < 0 or steps < 0 or seeds < 1:
        raise AttnlabError("--lr and --steps must be >= 0 and --seeds >= 1")
    try:
        depths = tuple(int(x) for x in layers.split(",") if x.strip())
    except ValueError:
        raise AttnlabError(f"--layers must be comma-separated integers, got {layers!r}") from None
    if any(d < 1 for d in depths):
        raise AttnlabError("--layers must be >= 1")
    if arch == "postln":
        return run_postln(out, seed, size, progress, lr=lr, steps=steps, seeds=seeds, depths=depths)
    from attnlab.analysis import plots
    from attnlab.io import write_json

    t0 = time.perf_counter()
    out, cfg = Path(out), dict(SIZES[size])
    if lr:
        cfg.update(lrs=(lr,), sweep_lrs=())
    if depths:
        cfg.update(layers=depths, sweep_lrs=())
    if steps:
        cfg.update(steps=steps, eval_every=max(20, steps // 10))
    configs = [(n, lr) for n in cfg["layers"] for lr in cfg["lrs"]]
    configs += [(cfg["sweep_layers"], lr) for lr in cfg["sweep_lrs"]]
    labels = [f"{n} layer{'s' if n > 1 else ''}, lr {lr:g}" for n, lr in configs]
    jobs = [(out / "runs" / f"L{n}_lr{lr:g}", n, lr, seed, cfg, progress) for n, lr in configs]
    if size == "full" and WORKERS > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # one torch thread per spawned worker (read when it imports torch)
        try:
            with ProcessPoolExecutor(WORKERS, mp_context=mp.get_context("spawn")) as pool:
                logs = list(pool.map(_train_job, jobs))
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    else:
        logs = [_train_job(j) for j in jobs]
    runs = dict(zip(labels, logs))
    summary = {}
    for label, log in runs.items():
        steps = [r["step"] for r in log]
        summary[label] = {
            "entropy_val": [curve_summary(steps, [r["entropy_val"][i] for r in log]) for i in range(len(log[0]["entropy_val"]))],
            "entropy_chunk": [curve_summary(steps, [r["entropy_chunk"][i] for r in log]) for i in range(len(log[0]["entropy_chunk"]))],
            "val_loss": {"start": log[0]["val_loss"], "end": log[-1]["val_loss"], "min": min(r["val_loss"] for r in log)},
            "sink_mass_val": {"start": log[0]["sink_mass_val"], "end": log[-1]["sink_mass_val"]},
            "stable_rank": {"start": log[0]["stable_rank"], "end": log[-1]["stable_rank"]},
            "embed_abs_cos": {"start": log[0]["embed_abs_cos"], "end": log[-1]["embed_abs_cos"]},
        }
    baseline = math.sqrt(2 / (math.pi * 200))
    main = {k: v for k, v in runs.items() if any(k.endswith(f"lr {lr:g}") for lr in cfg["lrs"])}
    figures = [
        plots.entropy_per_layer(runs, out / "entropy_val.png", "J3: attention entropy per layer, mean over validation batches",
                                reference=UNIFORM_35),
        plots.entropy_per_layer(runs, out / "entropy_chunk.png", "J3: attention entropy per layer, fixed validation chunk",
                                key="entropy_chunk", reference=UNIFORM_35),
        plots.dynamics_panels(main, out / "dynamics.png", "J3: MLP stable rank, embedding cosines, sink mass, loss", baseline),
    ]
    metrics = {"experiment": "attention-entropy", "size": size, "seed": seed,
               "runtime_s": round(time.perf_counter() - t0, 2), "figures": [Path(f).name for f in figures],
               "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
               "uniform_entropy_35": UNIFORM_35, "cos_baseline": baseline, "summary": summary, "runs": runs}
    write_json(out / "metrics.json", metrics)
    return metrics


def summary_lines(m: dict) -> list[str]:
    out = [f"uniform causal entropy over 35 tokens: {m['uniform_entropy_35']:.3f}; "
           f"random |cos| baseline {m['cos_baseline']:.4f}"]
    for label, s in m["summary"].items():
        layers = "; ".join(f"L{i} {c['start']:.2f}->{c['min']:.2f}@{c['argmin_step']}->{c['end']:.2f}"
                           f"{' (bounces back)' if c['bounces_back'] else ''}" for i, c in enumerate(s["entropy_val"]))
        out.append(f"{label}: val loss {s['val_loss']['start']:.2f}->{s['val_loss']['end']:.2f}; entropy {layers}")
    return out


def _row_summaries(log: list[dict], key: str) -> list[dict]:
    steps = [r["step"] for r in log]
    return [curve_summary(steps, [r[key][i] for r in log]) for i in range(len(log[0][key]))]


AUTHORS_CURVES = Path(__file__).resolve().parents[2] / "docs" / "figures" / "theory" / "j3_authors_curves.json"


def _vs_authors(runs: dict, cfg: dict, out: Path) -> list:
    """Per depth the authors stored curves for (1, 2, 5 layers at lr 1e-4): our runs beside theirs.
    Needs the summary JSON of a source checkout (``attnlab.analysis.j3_authors``); else nothing."""
    import json

    from attnlab.analysis.j3_authors import plot_vs_authors
    if not AUTHORS_CURVES.exists() or abs(cfg["lr"] - 1e-4) > 1e-12:
        return []
    authors = json.loads(AUTHORS_CURVES.read_text())
    have = {c["nlayers"] for c in authors["curves"]}
    figs = []
    for n in cfg["layers"]:
        ours = {k: v for k, v in runs.items() if k.startswith(f"postln {n} layer")}
        if n in have and ours:
            figs.append(plot_vs_authors(ours, authors, n, out / f"entropy_vs_authors_L{n}.png"))
    return figs


def run_postln(out, seed: int, size: str, progress: bool, lr: float = 0.0, steps: int = 0, seeds: int = 1,
               depths: tuple = ()) -> dict:
    """J3 on the paper's post-LN Transformer: depths x seeds, one process, then per-layer plots."""
    from attnlab.analysis import plots
    from attnlab.analysis.postln import train_postln
    from attnlab.io import progress as bar
    from attnlab.io import write_json

    t0 = time.perf_counter()
    out, cfg = Path(out), dict(POSTLN_SIZES[size])
    cfg.update({k: v for k, v in (("lr", lr), ("steps", steps), ("layers", depths)) if v})
    marks = [s for s in EARLY_EVALS + LATE_EVALS if s < cfg["steps"]]
    from attnlab.analysis.postln import segments
    runs, times, sessions = {}, {}, {}
    for n in cfg["layers"]:
        for s in range(seed, seed + seeds):
            label = f"postln {n} layer{'s' if n > 1 else ''}, lr {cfg['lr']:g}, seed {s}"
            ts = time.perf_counter()
            with bar(cfg["steps"], label, unit="batch") as pb:
                pb.disable = pb.disable or not progress  # never re-enable a bar tqdm built disabled
                ckpt = out / "checkpoints" / f"postln_L{n}_lr{cfg['lr']:g}_seed{s}.pt"  # rerun = resume / extend
                runs[label] = train_postln(n, cfg["lr"], s, cfg["steps"], marks, dim=cfg["dim"], hidden_dim=cfg["dim"],
                                           vocab_size=cfg["vocab_size"], eval_batches=cfg["eval_batches"], progress=pb,
                                           checkpoint=ckpt)
            times[label] = runs[label][-1]["seconds"]  # training time, summed over resumed sessions
            sessions[label] = segments(ckpt)  # which code trained which minibatches, and for how long
            write_json(out / "partial.json", {"runs": runs, "seconds": times})  # survive an interrupted sweep
    summary = {label: {"entropy_val": _row_summaries(log, "entropy_val"),
                       "entropy_chunk": _row_summaries(log, "entropy_chunk"),
                       "val_loss": {"start": log[0]["val_loss"], "end": log[-1]["val_loss"]},
                       "seconds": times[label], "sessions": sessions[label]} for label, log in runs.items()}
    figures = [
        plots.entropy_per_layer(runs, out / "entropy_val_postln.png",
                                "J3, post-LN (paper's architecture): entropy per layer, mean over validation batches",
                                reference=UNIFORM_35),
        plots.entropy_per_layer(runs, out / "entropy_chunk_postln.png",
                                "J3, post-LN: entropy per layer, fixed validation chunk", key="entropy_chunk",
                                reference=UNIFORM_35)]
    figures += _vs_authors(runs, cfg, out)
    metrics = {"experiment": "attention-entropy", "arch": "postln", "size": size, "seed": seed, "seeds": seeds,
               "runtime_s": round(time.perf_counter() - t0, 2), "figures": [Path(f).name for f in figures],
               "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
               "uniform_entropy_35": UNIFORM_35, "cos_baseline": math.sqrt(2 / (math.pi * cfg["dim"])),
               "summary": summary, "runs": runs}
    write_json(out / "metrics.json", metrics)
    return metrics
