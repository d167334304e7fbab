"""`attnlab lm-eval`: EleutherAI's lm-evaluation-harness on our engine (model `attnlab`), with the local
Shakespeare tasks always on the include path; writes lm-eval's own result files under --out."""
from __future__ import annotations

import json
from pathlib import Path

from attnlab.cli.common import UserError
from attnlab.io import write_json


def cmd_lmeval(args) -> int:
    try:
        import lm_eval
        from lm_eval.loggers import EvaluationTracker
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ModuleNotFoundError:
        raise UserError("lm-eval is not installed: pip install 'attnlab[eval]'") from None
    import attnlab.eval.lmeval  # noqa: F401  (registers the model "attnlab")
    from attnlab.eval.lmeval_tasks import TASK_DIR, write_tasks

    if args.make_tasks:
        for path in write_tasks(args.make_tasks):
            print(path)
        return 0
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks is empty (try attnlab_shakespeare, or attnlab_nextline,attnlab_cloze)")
    include = [str(TASK_DIR)] + [str(Path(p)) for p in args.include_path or []]
    for p in include[1:]:
        if not Path(p).is_dir():
            raise UserError(f"--include-path {p}: not a folder")
    manager = TaskManager(include_path=include, include_defaults=args.builtin_tasks)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task {unknown[0]!r} (local tasks: "
                        f"{', '.join(t for t in manager.all_tasks if t.startswith('attnlab'))}; nothing is downloaded)")
    pairs = [kv.split("=", 1) for kv in (args.model_args or "").split(",") if kv.strip()]
    if any(len(kv) != 2 for kv in pairs):
        raise UserError(f"--model-args must be key=value,key=value, got {args.model_args!r}")
    given = {("pretrained" if k.strip() == "model" else k.strip()): v.strip() for k, v in pairs}
    given.setdefault("pretrained", "smollm2-135m")  # lm-eval names its result folder after `pretrained`
    given.setdefault("threads", str(args.threads))
    model_args = ",".join(f"{k}={v}" for k, v in given.items())
    out = Path(args.out)
    tracker = EvaluationTracker(output_path=str(out))
    results = lm_eval.simple_evaluate(model="attnlab", model_args=model_args, tasks=tasks, task_manager=manager,
                                      limit=args.limit, num_fewshot=args.num_fewshot, log_samples=args.log_samples,
                                      evaluation_tracker=tracker, random_seed=args.seed, numpy_random_seed=args.seed,
                                      torch_random_seed=args.seed, fewshot_random_seed=args.seed,
                                      bootstrap_iters=args.bootstrap_iters)
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples if args.log_samples else None)
    if args.log_samples and samples:
        for name in results["configs"]:
            tracker.save_results_samples(task_name=name, samples=samples[name])
    command = f"attnlab lm-eval --tasks {','.join(tasks)} --model-args '{model_args}'" + \
        (f" --limit {args.limit:g}" if args.limit else "") + f" --out {args.out}"
    write_json(out / "attnlab_summary.json", {"command": command, "model_args": model_args, "tasks": tasks,
                                              "limit": args.limit, "results": results["results"]})
    if args.json:
        print(json.dumps(results["results"], default=str))
    else:
        print(make_table(results))
        print(f"wrote lm-eval's result files under {out}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks on the attnlab engine (local tasks, any KV policy)")
    p.add_argument("--tasks", default="attnlab_shakespeare", help="lm-eval task names, comma list")
    p.add_argument("--model-args", default="", help="model=smollm2-135m,policy=sink,budget=256,n_sink=4,quant=int8,"
                                                    "compile=1,rope=yarn:2,sparsity=...,kv_dtype=float16,chunk=64")
    p.add_argument("--include-path", action="append", default=None, help="another folder of task YAMLs (repeatable)")
    p.add_argument("--builtin-tasks", action="store_true",
                   help="also index lm-eval's own ~15,000 tasks (minutes; their datasets must already be cached)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a count, or a share if < 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--seed", type=int, default=0, help="seed of lm-eval's sampling of few-shot examples")
    p.add_argument("--bootstrap-iters", type=int, default=1000, help="bootstrap resamples for standard errors")
    p.add_argument("--threads", type=int, default=1, help="torch threads (unless --model-args sets threads)")
    p.add_argument("--log-samples", action="store_true", help="also write every document's request and answer")
    p.add_argument("--out", default="runs/lm-eval", help="folder for lm-eval's result files")
    p.add_argument("--make-tasks", default=None, metavar="DIR",
                   help="only (re)write the local tasks' JSONL files into DIR and exit")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_lmeval)
