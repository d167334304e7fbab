"""`attnlab analyze` (attention anatomy of a checkpoint) and `attnlab train` (small LM from scratch)."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from attnlab.cli.common import UserError, add_model_args, load_lm, nonneg_int, positive_int
from attnlab.io import progress, provenance, write_json


def cmd_analyze(args) -> int:
    import torch

    from attnlab.analysis import plots
    from attnlab.analysis.anatomy import analyze_ids, frequency_relation, summarise
    from attnlab.analysis.sinks import sink_experiment
    from attnlab.data import corpus

    if args.tokens < 32:
        raise UserError(f"--tokens must be at least 32, got {args.tokens}")
    record = provenance(getattr(args, "argv", None) or ["analyze"])  # taken when the run starts
    text = corpus(args.text)
    t0 = time.perf_counter()
    lm = load_lm(args)
    text_ids = lm.encode(text)
    ids = text_ids[args.offset:args.offset + args.tokens]
    if len(ids) < 32:
        raise UserError(f"text {args.text!r} has only {len(ids)} tokens after --offset {args.offset} (need 32)")
    cfg = lm.cfg
    layer = cfg.n_layers // 2 if args.map_layer is None else args.map_layer
    if not -cfg.n_layers <= layer < cfg.n_layers or not 0 <= args.map_head < cfg.n_heads:
        raise UserError(f"--map-layer/--map-head out of range: the model has {cfg.n_layers} layers, {cfg.n_heads} heads")
    layer %= cfg.n_layers
    sinks = (1, args.sinks) if args.sinks != 1 else (1,)
    out = Path(args.out)
    with progress(cfg.n_layers, "attention anatomy", unit="layer") as bar:
        res = analyze_ids(lm.model, torch.tensor(ids), sinks=sinks, map_layer=layer, map_head=args.map_head,
                          progress=bar.update)
    stats = summarise(res)
    relation = frequency_relation(res.received, torch.tensor(ids), text_ids, skip=args.sinks)
    name = Path(str(args.model)).name
    tag = f"{name}, {args.text}, {len(ids)} tokens"
    figures = [plots.layer_bars({k: v.tolist() for k, v in res.stats.items()}, out / "layers.png",
                                f"{tag}: sink mass and entropy per layer (mean over heads)", args.sinks),
               plots.head_heatmaps({k: v.tolist() for k, v in res.stats.items()}, out / "heads.png", tag, args.sinks),
               plots.attention_map(res.attention_map, out / "attention_map.png",
                                   f"{name}: layer {layer}, head {args.map_head} (first {min(96, len(ids))} tokens)")]
    result = {**record, "seed": None,  # deterministic: no sampling
              "model": str(args.model), "text": args.text, "tokens": len(ids), "offset": args.offset,
              "config": {"layers": cfg.n_layers, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads},
              "definitions": "see attnlab/analysis/anatomy.py", "stats": stats, "token_relation": relation,
              "attention_map": {"layer": layer, "head": args.map_head}}
    if args.sink_tokens:
        sink_ids = text_ids[args.offset:args.offset + args.sink_tokens]
        replace = lm.encode_rendered(args.replace_with)
        if len(replace) != 1:
            raise UserError(f"--replace-with must be one token, {args.replace_with!r} is {len(replace)}")
        with progress(4, "sink experiment", unit="case") as bar:
            sres = sink_experiment(lm.model, sink_ids, sinks=args.sinks, window=args.window,
                                   replace_id=replace[0], progress=bar.update)
        figures.append(plots.sink_bars(sres, out / "sink_experiment.png",
                                       f"{name}: {args.sinks} sinks + window {args.window}, {args.text}"))
        result["sink_experiment"] = {k: v for k, v in sres.items() if k != "nll_curve"}
        result["sink_experiment"]["replace_with"] = args.replace_with
        result["sink_nll_curve"] = sres["nll_curve"]
    result["figures"] = [Path(f).name for f in figures]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(out / "anatomy.json", result)
    s = stats
    print(f"{tag}: first-token mass {s['sink_mass_1']['model_mean']:.3f}, first-{args.sinks} mass "
          f"{s[f'sink_mass_{args.sinks}']['model_mean']:.3f}, entropy {s['entropy']['model_mean']:.3f} nats "
          f"({s['entropy_normalised']['model_mean']:.3f} of uniform), top-5% share {s['top5_share']['model_mean']:.3f}, "
          f"top-20% share {s['top20_share']['model_mean']:.3f}, key 0 in top 5% {s['first_in_top5']['model_mean']:.3f}")
    print(f"attention received vs token frequency (Spearman, all layers): {relation['spearman_frequency_all_layers']:+.3f}; "
          f"vs co-occurrence: {relation['spearman_cooccurrence_all_layers']:+.3f}")
    if args.sink_tokens:
        print("sink experiment (ppl): " + ", ".join(f"{k} {v['ppl']:.2f}" for k, v in sres["cases"].items()))
    print(f"wrote {out / 'anatomy.json'} and {', '.join(result['figures'])}")
    return 0


TRAIN_FIELDS = {  # option -> (TrainConfig field, type, help)
    "--corpus": ("corpus", str, "training text: shakespeare[:split|:play] or a file"),
    "--val-corpus": ("val_corpus", str, "validation text"),
    "--tokenizer": ("tokenizer", str, "word (default), char or smollm2"),
    "--vocab-size": ("vocab_size", int, "word tokenizer vocabulary, <unk> included"),
    "--dim": ("dim", int, "model width"),
    "--layers": ("n_layers", int, "Transformer blocks"),
    "--heads": ("n_heads", int, "query heads"),
    "--kv-heads": ("n_kv_heads", int, "key/value heads (0 = heads)"),
    "--hidden": ("hidden_dim", int, "MLP width"),
    "--context": ("context", int, "training sequence length"),
    "--batch": ("batch", int, "sequences per minibatch"),
    "--steps": ("steps", int, "total minibatches (with --resume: train on to this step)"),
    "--lr": ("lr", float, "peak learning rate (AdamW)"),
    "--schedule": ("schedule", str, "constant, cosine or linear"),
    "--warmup": ("warmup", int, "linear warm-up steps"),
    "--min-lr-ratio": ("min_lr_ratio", float, "final lr / peak lr for cosine and linear"),
    "--weight-decay": ("weight_decay", float, "AdamW weight decay"),
    "--clip": ("clip", float, "gradient-norm clip (0 = off)"),
    "--rope-base": ("rope_base", float, "RoPE base"),
    "--seed": ("seed", int, "initialisation and data-order seed"),
    "--eval-every": ("eval_every", int, "minibatches between evaluations"),
    "--eval-batches": ("eval_batches", int, "validation batches per evaluation"),
    "--ckpt-every": ("ckpt_every", int, "minibatches between checkpoints (0 = end only)"),
}


def cmd_train(args) -> int:
    from attnlab.train import TrainConfig, Trainer, ddp

    ddp.init()  # under torchrun: data-parallel over the ranks (gloo); otherwise nothing
    kwargs = {f: getattr(args, f) for f, _, _ in TRAIN_FIELDS.values() if getattr(args, f) is not None}
    if args.rope_scale:
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": args.rope_scale}
    if args.tie_embeddings:
        kwargs["tie_embeddings"] = True
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; train writes a run folder there")
    dim, heads = kwargs.get("dim", TrainConfig.dim), kwargs.get("n_heads", TrainConfig.n_heads)
    kv = kwargs.get("n_kv_heads", TrainConfig.n_kv_heads) or heads
    if heads < 1 or dim % heads or (dim // heads) % 2:
        raise UserError(f"--dim {dim} must split into --heads {heads} heads of an even size (RoPE rotates pairs)")
    if kv < 1 or heads % kv:
        raise UserError(f"--heads {heads} must be a multiple of --kv-heads {kv}")
    if args.resume and (out / "latest.json").exists():
        saved = json.loads((out / json.loads((out / "latest.json").read_text())["checkpoint"] / "state.json").read_text())
        base = TrainConfig(**saved["train_config"])
        cfg = dataclasses.replace(base, **{k: v for k, v in kwargs.items() if k == "steps"})
        changed = [k for k, v in kwargs.items() if k != "steps" and getattr(base, k) != v]
        if changed:
            raise UserError(f"--resume keeps the saved configuration; only --steps may change (got {', '.join(changed)})")
    else:
        cfg = TrainConfig(**kwargs)
    trainer = Trainer(cfg, out, resume=args.resume)
    m = trainer.model.cfg
    if not trainer.main:  # rank > 0: train silently, rank 0 reports
        trainer.run()
        ddp.shutdown()
        return 0
    print(f"training {m.n_layers} layers, dim {m.dim}, vocab {m.vocab_size} ({cfg.tokenizer}), "
          f"{sum(p.numel() for p in trainer.model.parameters()) / 1e6:.2f}M parameters, "
          f"{trainer.train_ids.numel()} training tokens; from step {trainer.step} to {cfg.steps}")
    with progress(max(0, cfg.steps - trainer.step), "train", unit="batch") as bar:
        rows = trainer.run(progress=bar)
    if rows:
        last = rows[-1]
        print(f"step {last['step']}: val loss {last['val_loss']:.4f}" +
              (f", train loss {last['train_loss']:.4f}" if "train_loss" in last else ""))
    print(f"checkpoint {out / json.loads((out / 'latest.json').read_text())['checkpoint']}; log {out / 'metrics.jsonl'}"
          + (f" ({trainer.world} processes)" if trainer.world > 1 else ""))
    ddp.shutdown()
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("analyze", help="attention anatomy of a model: sinks, entropy, heavy hitters",
                              description="Per-layer/per-head attention statistics over a real text, "
                                          "and StreamingLLM's drop/replace/keep sink experiment.")
    add_model_args(p)
    p.set_defaults(dtype="float32")  # the documented anatomy is of the float model
    p.add_argument("--text", default="shakespeare:test", help="shakespeare[:split|:play] or a file path")
    p.add_argument("--tokens", type=positive_int, default=512, help="tokens analysed (default 512)")
    p.add_argument("--offset", type=nonneg_int, default=0, help="skip this many tokens of the text first")
    p.add_argument("--sinks", type=positive_int, default=4, help="initial tokens counted as sinks (default 4)")
    p.add_argument("--map-layer", type=int, default=None, help="layer of the attention-map figure (default: middle)")
    p.add_argument("--map-head", type=nonneg_int, default=0, help="query head of the attention-map figure")
    p.add_argument("--sink-tokens", type=nonneg_int, default=1024,
                   help="tokens of the sink experiment (0 = skip it; default 1024)")
    p.add_argument("--window", type=positive_int, default=256, help="recent-token window of the sink experiment")
    p.add_argument("--replace-with", default="\n", help="token replacing the sinks in the 'replace' case (newline)")
    p.add_argument("--out", default="runs/analyze", help="output folder (JSON + PNG figures)")
    p.set_defaults(func=cmd_analyze)

    p = subparsers.add_parser("train", help="train a small causal LM from scratch (resumable)",
                              description="Train the engine's Transformer on a corpus; safetensors checkpoints.")
    for opt, (field, typ, help_) in TRAIN_FIELDS.items():
        p.add_argument(opt, dest=field, type=typ, default=None, help=help_, metavar=opt[2:].upper().replace("-", "_"))
    p.add_argument("--rope-scale", type=float, default=None, help="linear RoPE scaling factor (position interpolation)")
    p.add_argument("--tie-embeddings", action="store_true", help="share input and output embeddings")
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl)")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.set_defaults(func=cmd_train, resume_hint="rerun with --resume to continue from the last checkpoint")
