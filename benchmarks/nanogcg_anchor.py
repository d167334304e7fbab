"""nanogcg beside `attnlab attack`: the same model (our `attnlab export` folder), pairs, steps, candidates a step
(search_width = --batch), top-k, suffix length and start ("! ! ..."), one thread each; success (the greedy reply
begins with the target) by step and wall time a step.

nanogcg 0.3.0 pins transformers <= 4.47.1, so it runs in its own venv (`make bench-nanogcg` builds
build/venv-nanogcg); this script, run by attnlab's python, runs our attack, then itself under that venv's python
with --peer (which imports nothing of attnlab), then prints both. Per step both keep the best of the step's
candidates (nanogcg's buffer_size 0) and drop candidates whose text does not tokenise back (filter_ids). Our
seconds a step leave out the success check; nanogcg's are its run's wall time over its steps.

    make bench-nanogcg NANOGCG_ARGS="--pairs 5 --steps 20 --batch 64 --topk 64"
    .venv/bin/python benchmarks/nanogcg_anchor.py --python build/venv-nanogcg/bin/python --pairs 5 --steps 20
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def peer(args) -> None:
    """nanogcg's side, in its own venv: each pair attacked, each step's suffix checked by greedy decoding."""
    import nanogcg
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(args.threads)
    tok = _tokenizer(args.peer)
    model = AutoModelForCausalLM.from_pretrained(args.peer, torch_dtype=getattr(torch, args.peer_dtype)).eval()
    stamps = _stamp_steps(nanogcg)
    out, record = Path(args.out), _record()  # the code that runs is the code at the start
    done = json.loads(out.read_text())["results"] if out.exists() else []  # resumable: a pair at a time
    rows = [r for r in done if r.get("budget") == [args.steps, args.batch, args.topk, args.length]]
    for pair in json.loads(Path(args.pairs_json).read_text()):
        if any(r["pair"] == pair["pair"] for r in rows):
            continue
        cfg = nanogcg.GCGConfig(num_steps=args.steps, optim_str_init=" !" * args.length, search_width=args.batch,
                                topk=args.topk, seed=args.seed, verbosity="WARNING", use_prefix_cache=True)
        messages = [{"role": "user", "content": pair["prompt"] + "{optim_str}"}]
        start = time.perf_counter()
        stamps.clear()
        res = nanogcg.run(model, tok, messages, pair["target"], cfg)
        seconds = time.perf_counter() - start
        stamps.append((time.perf_counter(), time.process_time()))
        ok = [_succeeds(model, tok, pair, s) for s in res.strings]
        rows.append({"pair": pair["pair"], "budget": [args.steps, args.batch, args.topk, args.length],
                     "losses": res.losses, "success_by_step": ok,
                     "success": _succeeds(model, tok, pair, res.best_string, 8), "suffix": res.best_string,
                     "loss": res.best_loss, "seconds_per_step": seconds / args.steps,
                     "step_seconds": [b[0] - a[0] for a, b in zip(stamps, stamps[1:])],
                     "step_cpu_seconds": [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]})
        print(f"nanogcg pair {pair['pair']}: loss {res.best_loss:.3f}, {seconds / args.steps:.2f} s a step",
              file=sys.stderr)
        tmp = out.with_suffix(".tmp")  # atomic: a stop loses at most the pair under way
        tmp.write_text(json.dumps({**record, "seed": args.seed, "nanogcg": "0.3.0", "dtype": args.peer_dtype,
                                   "transformers": transformers.__version__, "torch": torch.__version__,
                                   "results": rows}, indent=2) + "\n")
        os.replace(tmp, out)


def _stamp_steps(nanogcg) -> list[float]:
    """(wall, CPU) clocks at each step's start (its gradient call): a step's seconds without the run's setup."""
    stamps, gradient = [], nanogcg.gcg.GCG.compute_token_gradient

    def stamped(self, *a, **kw):
        stamps.append((time.perf_counter(), time.process_time()))
        return gradient(self, *a, **kw)
    nanogcg.gcg.GCG.compute_token_gradient = stamped
    return stamps


def _record() -> dict:
    """The command, attnlab commit and dirty flag (this environment imports nothing of attnlab: git directly)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    try:
        commit, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "attnlab"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", None
    return {"command": " ".join(["benchmarks/nanogcg_anchor.py", *sys.argv[1:]]), "commit": commit, "dirty": dirty}


def _tokenizer(folder: str):
    """The export's tokenizer under transformers 4.47: its config names transformers 5's class, so the fast
    tokenizer is built from tokenizer.json with the same special tokens and chat template. No bos_token: SmolLM2's
    is <|im_start|>, and nanogcg strips every occurrence of the BOS text from the rendered template, which would
    attack a prompt without its turn markers (the template writes no BOS of its own)."""
    from transformers import PreTrainedTokenizerFast
    cfg = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"),
                                  **{k: cfg[k] for k in ("eos_token", "pad_token", "unk_token") if k in cfg})
    tok.chat_template = (Path(folder) / "chat_template.jinja").read_text()
    return tok


def _succeeds(model, tok, pair, suffix: str, extra: int = 2) -> bool:
    import torch
    text = tok.apply_chat_template([{"role": "user", "content": pair["prompt"] + suffix}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    n = len(tok(pair["target"], add_special_tokens=False).input_ids) + extra
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip().startswith(pair["target"].strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="build/venv-nanogcg/bin/python", help="nanogcg's venv python")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", default="5", help="'all', N or A-B of the shipped pairs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="candidates a step (nanogcg's search_width)")
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--score-dtype", default="bfloat16", help="ours: `attnlab attack --score-dtype` (bfloat16, "
                                                              "float32, file)")
    ap.add_argument("--grad-dtype", default="float32", help="ours: `attnlab attack --grad-dtype`")
    ap.add_argument("--peer-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="nanogcg's model dtype (the export is float32)")
    ap.add_argument("--rounds", type=int, default=0, help="timing only: this many rounds of ours then nanogcg, "
                                                          "interleaved; medians of the steps' seconds")
    ap.add_argument("--together", action="store_true", help="run ours and nanogcg at the same time, one thread each "
                    "(a success comparison on a 2-core machine: each side's seconds a step then share the memory bus)")
    ap.add_argument("--plot", nargs="+", metavar="PATH", help="only plot: PNG then side_by_side.json files (a model "
                                                               "each)")
    ap.add_argument("--out", default="runs/nanogcg")
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # nanogcg's side: the exported folder
    ap.add_argument("--pairs-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot[1:], args.plot[0]))
        return 0
    if args.peer:
        peer(args)
        return 0
    from attnlab.io import provenance, write_json
    from attnlab.robust.pairs import pairs
    record = provenance(["benchmarks/nanogcg_anchor.py", *(argv or sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    attnlab = [sys.executable, "-m", "attnlab"]
    if not (model_dir / "config.json").exists():
        subprocess.run([*attnlab, "export", args.model, str(model_dir), "--force"], check=True)
    budget = ["--steps", str(args.steps), "--batch", str(args.batch), "--topk", str(args.topk), "--length",
              str(args.length), "--seed", str(args.seed), "--threads", str(args.threads)]
    (out / "pairs.json").write_text(json.dumps([{"pair": i, "prompt": p, "target": t} for i, p, t in pairs(args.pairs)]))

    def ours_run(folder: Path) -> list[dict]:
        subprocess.run([*attnlab, "attack", args.model, "--pairs", args.pairs, "--out", str(folder), *budget,
                        "--score-dtype", args.score_dtype, "--grad-dtype", args.grad_dtype], check=True)
        return json.loads((folder / "attack.json").read_text())["results"]

    def peer_run(path: Path) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        subprocess.run([args.python, __file__, "--peer", str(model_dir), "--pairs-json", str(out / "pairs.json"),
                        "--out", str(path), "--peer-dtype", args.peer_dtype, *budget], check=True, env=env)
        return json.loads(path.read_text())

    if args.rounds:
        return timing(args, record, out, ours_run, peer_run)
    if args.together:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(2) as pool:
            mine, peers = pool.submit(ours_run, out / "ours"), pool.submit(peer_run, out / "nanogcg.json")
            ours, theirs = mine.result(), peers.result()
    else:
        ours = ours_run(out / "ours")
        theirs = peer_run(out / "nanogcg.json")
    table = summarize(ours, theirs["results"], args.steps)
    write_json(out / "side_by_side.json", {**record, "seed": args.seed, "budget": vars(args), "peer": {
        k: theirs[k] for k in ("nanogcg", "transformers", "torch")}, **table})
    return 0


def timing(args, record: dict, out: Path, ours_run, peer_run) -> int:
    """Rounds of our attack then nanogcg's on the same budget, one after the other (a shared machine's load moves
    both alike within a round): every step's seconds, the medians, and their ratio."""
    import statistics
    ours, theirs = [], []
    for r in range(args.rounds):
        folder = out / f"timing-{r}"
        shutil.rmtree(folder, ignore_errors=True)  # a fresh run, not a resumed one
        for res in ours_run(folder / "ours"):
            state = json.loads((folder / "ours" / f"pair-{res['pair']:02d}.state.json").read_text())
            ours += [(h["seconds"], h.get("cpu_seconds")) for h in state["history"]]
        peer = peer_run(folder / "nanogcg.json")["results"]
        theirs += [x for res in peer for x in zip(res["step_seconds"], res.get("step_cpu_seconds", []))]
        a, n = (statistics.median(x[0] for x in ours), statistics.median(x[0] for x in theirs))
        ac, nc = (statistics.median(x[1] for x in ours), statistics.median(x[1] for x in theirs))
        print(f"round {r + 1}: median s a step, attnlab {a:.2f}, nanogcg {n:.2f}: {n / a:.2f}x; CPU s a step "
              f"{ac:.2f}, {nc:.2f}: {nc / ac:.2f}x", flush=True)
    summary = {"attnlab_median_s": a, "nanogcg_median_s": n, "speedup": n / a, "attnlab_median_cpu_s": ac,
               "nanogcg_median_cpu_s": nc, "cpu_speedup": nc / ac,
               "attnlab_step_seconds": ours, "nanogcg_step_seconds": theirs}  # (wall, CPU) per step
    from attnlab.io import write_json
    write_json(out / "timing.json", {**record, "seed": args.seed, "budget": vars(args), **summary})
    return 0


def summarize(ours: list[dict], theirs: list[dict], steps: int) -> dict:
    def curve(rows):  # the share of pairs whose suffix at step s succeeds
        return [sum(r["success_by_step"][s] for r in rows) / len(rows) for s in range(steps)]

    def ever(rows):  # the share of pairs with a success at some step <= s (an attack that stops when it wins)
        return [sum(any(r["success_by_step"][:s + 1]) for r in rows) / len(rows) for s in range(steps)]
    side = {"attnlab": {"success": sum(r["success"] for r in ours) / len(ours), "by_step": curve(ours),
                        "by_step_ever": ever(ours),
                        "seconds_per_step": sum(r["seconds_per_step"] for r in ours) / len(ours),
                        "final_loss": [r["loss"] for r in ours]},
            "nanogcg": {"success": sum(r["success"] for r in theirs) / len(theirs), "by_step": curve(theirs),
                        "by_step_ever": ever(theirs),
                        "seconds_per_step": sum(r["seconds_per_step"] for r in theirs) / len(theirs),
                        "final_loss": [r["loss"] for r in theirs]}}
    a, n = side["attnlab"], side["nanogcg"]
    print(f"{'':>10} {'success':>8} {'s/step':>8} {'mean loss':>10}")
    for name, s in side.items():
        print(f"{name:>10} {s['success']:>8.0%} {s['seconds_per_step']:>8.2f} "
              f"{sum(s['final_loss']) / len(s['final_loss']):>10.3f}")
    marks = sorted({max(1, steps // 4), max(1, steps // 2), steps})
    print("success by step: " + ", ".join(f"{m}: {a['by_step'][m - 1]:.0%} vs {n['by_step'][m - 1]:.0%}"
                                          for m in marks))
    print("succeeded by step: " + ", ".join(f"{m}: {a['by_step_ever'][m - 1]:.0%} vs {n['by_step_ever'][m - 1]:.0%}"
                                            for m in marks))
    print(f"speed: attnlab {n['seconds_per_step'] / a['seconds_per_step']:.2f}x nanogcg's steps a second")
    return side


def plot(paths: list[str], png: str) -> str:
    """Per side_by_side.json (a model), the share of pairs succeeded by each step and the mean target loss, ours
    against nanogcg's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnlab.io import save_figure
    fig, axes = plt.subplots(2, len(paths), figsize=(4.6 * len(paths), 5.6), squeeze=False)
    for col, path in enumerate(paths):
        run = json.loads(Path(path).read_text())
        folder, budget = Path(path).parent, run["budget"]
        rows = {"attnlab": json.loads((folder / "ours" / "attack.json").read_text())["results"],
                "nanogcg": json.loads((folder / "nanogcg.json").read_text())["results"]}
        losses = {"attnlab": [[h["loss"] for h in json.loads((folder / "ours" / f"pair-{r['pair']:02d}.state.json")
                                                          .read_text())["history"]] for r in rows["attnlab"]],
                  "nanogcg": [r["losses"] for r in rows["nanogcg"]]}
        for name, style in (("attnlab", "-"), ("nanogcg", "--")):
            steps = range(1, budget["steps"] + 1)
            won = [100 * sum(any(r["success_by_step"][:s]) for r in rows[name]) / len(rows[name]) for s in steps]
            axes[0, col].plot(steps, won, style, label=name)
            mean = [sum(c[s] for c in losses[name]) / len(losses[name]) for s in range(len(steps))]
            axes[1, col].plot(steps, mean, style, label=name)
        pairs = len(losses["attnlab"])
        axes[0, col].set_title(f"{Path(budget['model']).name[:40]}\n{pairs} pairs, B={budget['batch']}, "
                               f"k={budget['topk']}, L={budget['length']}", fontsize=9)
        axes[0, col].set_ylabel("pairs succeeded by this step (%)")
        axes[1, col].set_ylabel("mean target loss (nats/token)")
        axes[1, col].set_xlabel("GCG step")
        axes[0, col].legend(fontsize=8)
    return save_figure(fig, png)


if __name__ == "__main__":
    sys.exit(main())
