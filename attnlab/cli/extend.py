"""`attnlab extend`: context extension of a pretrained model by RoPE scaling + a short fine-tune."""
from __future__ import annotations

from attnlab.cli.common import UserError, nonneg_int, positive_int
from attnlab.engine import DEFAULT_MODEL
from attnlab.io import progress


def cmd_extend(args) -> int:
    from attnlab.train import ddp
    from attnlab.train.extend import extend

    ddp.init()  # under torchrun: data-parallel over the ranks (gloo)
    if args.factor < 1:
        raise UserError(f"--factor must be >= 1, got {args.factor}")
    try:
        with progress(args.steps, "extend", unit="step") as bar:
            lm, rows = extend(args.model, args.out, args.factor, args.method, args.steps, args.context, args.text,
                              args.batch, args.lr, args.warmup, args.seed, args.resume, bar, lora=args.lora)
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    main = ddp.is_main()
    ddp.shutdown()
    if not main:  # rank > 0 under torchrun: rank 0 reports
        return 0
    for r in rows:
        extra = f", train loss {r['train_loss']:.4f}" if "train_loss" in r else ""
        print(f"step {r['step']}: validation loss {r['val_loss']:.4f}{extra}")
    print(f"extended model ({args.method}, factor {args.factor:g}, rope {lm.cfg.rope_scaling}) written to {args.out}; "
          f"load it with attnlab.load({str(args.out)!r})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("extend", help="extend a model's context: RoPE scaling + fine-tune (resumable)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, metavar="MODEL",
                   help="embedded name, .gguf file or Hugging Face folder (default: %(default)s)")
    p.add_argument("--factor", type=float, required=True, help="context multiplier (e.g. 2, 4)")
    p.add_argument("--method", default="pi", choices=["pi", "ntk", "yarn", "none"],
                   help="pi = Position Interpolation; none = fine-tune without scaling (the control)")
    p.add_argument("--steps", type=nonneg_int, default=50, help="fine-tuning steps (0: only rescale and save)")
    p.add_argument("--context", type=positive_int, default=2048, help="training sequence length")
    p.add_argument("--text", default="shakespeare:train", help="training text: shakespeare[:split|:play] or a file")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=nonneg_int, default=5, help="linear warm-up steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="data-order seed (default: %(default)s)")
    p.add_argument("--out", required=True, help="run folder; becomes a loadable checkpoint")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--lora", type=nonneg_int, default=0, metavar="RANK",
                   help="train rank-RANK LoRA adapters on the projections instead of every weight (for models a "
                        "full fine-tune does not fit); merged into the saved weights (default: full fine-tune)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.set_defaults(func=cmd_extend)
