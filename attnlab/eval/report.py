"""One self-contained HTML page of every run found under some folders.

Why: a day of experiments leaves JSON and PNG files in many folders (runs/stream/...,
runs/ruler/..., docs/figures/...). `build_report` walks them, recognises what wrote each
result (stream, passkey, ruler, lm-eval, quant-eval, dejavu, dynamics, anatomy,
benchmarks) by its fields, and gives each run a section: the command that produced it
(recorded, or rebuilt from the recorded options), its table, its figures and one line
on what to look for. Figures are inlined as base64 and the page loads nothing else, so
it can be mailed or opened offline; PNGs that belong to no recognised result still get
a section of their own, per folder.
"""
from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.errors import AttnlabError

MAX_JSON = 20 * 2 ** 20  # larger JSON files (per-token dumps) are skipped rather than parsed
SKIP_DIRS = {"units", "__pycache__", ".git"}

NOTES = {
    "ruler": "score against compression ratio for each policy, the full cache (ratio 0) as the control: a policy "
             "is good where its line stays near full; cells where full itself is near 0 say nothing about policies.",
    "lm-eval": "lm-eval's metrics on local tasks (acc higher is better, perplexities lower); compare the same tasks "
               "across model args (policy, quantization) rather than against published numbers.",
    "stream": "perplexity of each policy against the full cache on the same tokens: a policy is as good as its "
              "ratio to full; the window policy breaks once the first tokens leave the cache, sinks repair it.",
    "passkey": "accuracy by length and needle depth: a KV policy that evicted the needle cannot answer, however "
               "flat its perplexity; RoPE extension shows whether positions past the trained length still work.",
    "quant-eval": "perplexity against bits per weight: the knee of the curve is where quantization starts to cost.",
    "dejavu": "perplexity against the share of the MLP (and heads) skipped: Deja Vu works where the curve stays "
              "flat; speed rows say what that sparsity buys in tokens per second.",
    "dynamics": "attention entropy during training: the dip and rebound (or not) per depth and learning rate.",
    "anatomy": "where attention goes per layer: sink mass (share on the first tokens) and entropy; the middle "
               "layers are the sink-heavy ones.",
    "benchmark": "tokens per second of each configuration on the recorded machine and load: compare rows measured "
                 "together, not across runs.",
    "figures": "figures found in this folder that no recognised result file claims.",
}


@dataclass
class Section:
    kind: str
    title: str
    source: Path
    command: str = ""
    headers: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    figures: list = field(default_factory=list)
    text: str = ""

    @property
    def note(self) -> str:
        return NOTES.get(self.kind, "")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, dict)):
        return f"[{len(v)} values]"
    return "" if v is None else str(v)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _records(data) -> list[dict]:
    """The first list of flat records in a result: the data itself or its rows/results/cells."""
    for cand in ([data] if isinstance(data, list) else []) + \
            [data.get(k) for k in ("rows", "results", "cells", "runs") if isinstance(data, dict)]:
        if isinstance(cand, list) and cand and all(isinstance(r, dict) for r in cand):
            return cand
    return []


def _table(records: list[dict], columns: int = 10, limit: int = 60) -> tuple[list, list]:
    cols = [k for k in records[0] if all(_scalar(r.get(k)) for r in records[:limit])][:columns]
    return cols, [[_fmt(r.get(k)) for k in cols] for r in records[:limit]]


def _figures(folder: Path, stems: list[str] | None = None) -> list[Path]:
    pngs = sorted(folder.glob("*.png"))
    return pngs if stems is None else [p for p in pngs if p.stem in stems]


# ---------------------------------------------------------------- recognisers: (data, path) -> Section or None

def _ruler(data, path):
    if not (isinstance(data, dict) and "cells" in data and "tasks" in data and "ratios" in data):
        return None
    from attnlab.eval.ruler_run import full_by_task, table
    rows = data["cells"]
    text = (f"{len(data['tasks'])} tasks x lengths {data['lengths']}, {data['samples']} sample(s) per cell, seed "
            f"{data['seed']}\n\n{table(rows)}\n\nfull cache per task and length:\n{full_by_task(rows)}")
    text += "".join(("\n\nbest against best (paired per sample):" if i == 0 else "") +  # the press anchor's
                    f"\nratio {p['ratio']:g}, {p['scope']}: attnlab's {p['attnlab_best']} - kvpress's "
                    f"{p['kvpress_best']} = {p['mean']:+.1f} points, 95% [{p['lo']:+.1f}, {p['hi']:+.1f}], "
                    f"sign test p = {p['sign_p']:.3f}, n = {p['n']}" for i, p in enumerate(data.get("paired", [])))
    return Section("ruler", f"RULER: {data.get('model', path.parent.name)}", path, data.get("command", ""), text=text,
                   figures=_figures(path.parent, ["ruler", "bars"]))  # bars: the press anchor's side-by-side


def _lmeval(data, path):
    if not (isinstance(data, dict) and isinstance(data.get("results"), dict)):
        return None
    if not ("model_args" in data or "versions" in data):
        return None
    rows = []
    for task, metrics in data["results"].items():
        for k, v in metrics.items():
            if k.endswith("_stderr,none") or not isinstance(v, (int, float)) or "," not in k:
                continue
            err = metrics.get(k.replace(",", "_stderr,", 1))
            rows.append([task, k.split(",")[0], _fmt(v), _fmt(err) if isinstance(err, float) else ""])
    cmd = data.get("command") or f"lm_eval --model {data.get('config', {}).get('model', '?')} --model_args " \
                                  f"'{data.get('config', {}).get('model_args', '')}'"
    args = data.get("model_args") or data.get("config", {}).get("model_args", "")
    return Section("lm-eval", f"lm-eval: {path.parent.name} ({args or 'full cache'})", path, cmd,
                   ["task", "metric", "value", "stderr"], rows)


def _passkey(data, path):
    recs = data.get("results") if isinstance(data, dict) else None
    if not (isinstance(recs, list) and recs and isinstance(recs[0], dict) and {"depth", "accuracy"} <= set(recs[0])):
        return None
    depths = sorted({r["depth"] for r in recs})
    lengths = sorted({r["length"] for r in recs})
    acc = {(r["length"], r["depth"]): r["accuracy"] for r in recs}
    rows = [[n] + [_fmt(acc.get((n, d))) for d in depths] for n in lengths]
    cmd = data.get("command") or (f"attnlab passkey {data.get('model', '')} --lengths {','.join(map(str, lengths))} "
                                  f"--depths {','.join(f'{d:g}' for d in depths)} --trials {data.get('trials')} "
                                  f"--seed {data.get('seed')} (policy {data.get('policy')}, rope {data.get('rope')})")
    return Section("passkey", f"passkey: {path.parent.name}/{path.stem} ({data.get('policy')})", path, cmd,
                   ["length"] + [f"depth {d:g}" for d in depths], rows, _figures(path.parent, [path.stem]))


def _stream_group(records: list[tuple[dict, Path]]) -> Section:
    folder = records[0][1].parent
    runs = [r for r, _ in records]
    runs.sort(key=lambda r: (r["policy"] != "full", r["policy"], r.get("budget", 0)))
    full = next((r["ppl"] for r in runs if r["policy"] == "full"), None)
    rows = [[r["policy"], r.get("budget"), r.get("positions"), r.get("tokens"), _fmt(r["ppl"]),
             f"{r['ppl'] / full:.3f}x" if full else "", _fmt(r.get("tokens_per_s")), r.get("mode")] for r in runs]
    r0 = runs[0]
    budgets = ",".join(dict.fromkeys(str(r["budget"]) for r in runs if r["policy"] != "full")) or "256"
    cmd = (f"attnlab stream {r0.get('model', '')} --text {r0.get('text')} --tokens {r0.get('stream_tokens')} "
           f"--streams {r0.get('streams')} --policy {','.join(dict.fromkeys(r['policy'] for r in runs))} "
           f"--budget {budgets} --chunk {r0.get('chunk')}")
    return Section("stream", f"stream: {folder.name}", folder, cmd,
                   ["policy", "budget", "positions", "tokens", "ppl", "vs full", "tok/s", "mode"], rows,
                   _figures(folder))


def _generic(kind: str, title: str):
    def recognise(data, path, test):
        if not test(data, path):
            return None
        recs = _records(data)
        headers, rows = _table(recs) if recs else (["field", "value"], [[k, _fmt(v)] for k, v in data.items()
                                                                         if _scalar(v)][:30])
        md = path.with_suffix(".md")
        return Section(kind, f"{title}: {path.parent.name}/{path.stem}", path,
                       data.get("command", "") if isinstance(data, dict) else "", headers, rows,
                       _figures(path.parent, [path.stem]), md.read_text() if md.exists() else "")
    return recognise


def _anatomy(data, path):
    if not (isinstance(data, dict) and isinstance(data.get("stats"), dict) and "definitions" in data):
        return None
    rows = []
    for name, s in data["stats"].items():
        per = s.get("per_layer", []) if isinstance(s, dict) else []
        rows.append([name, _fmt(s.get("model_mean")) if isinstance(s, dict) else _fmt(s),
                     _fmt(min(per)) if per else "", _fmt(max(per)) if per else "",
                     (per.index(max(per)) if per else "")])
    cmd = data.get("command") or f"attnlab analyze {data.get('model', '')} --text {data.get('text')} " \
                                 f"--tokens {data.get('tokens')}"
    return Section("anatomy", f"anatomy: {path.parent.name}/{path.stem}", path, cmd,
                   ["statistic", "model mean", "min layer", "max layer", "argmax layer"], rows,
                   [p for p in _figures(path.parent) if p.stem.split("_")[0] == path.stem.split("_")[0]])


def _dynamics(data, path):
    if not (isinstance(data, dict) and "experiment" in data and "summary" in data):
        return None
    rows = []
    for run, s in data["summary"].items():
        ent = s.get("entropy_val") if isinstance(s, dict) else None
        if isinstance(ent, list) and ent and isinstance(ent[0], dict):
            rows.append([run, _fmt(sum(e["drop"] for e in ent) / len(ent)),
                         _fmt(sum(e["rebound"] for e in ent) / len(ent)),
                         f"{sum(bool(e.get('bounces_back')) for e in ent)}/{len(ent)}"])
        else:
            rows.append([run, _fmt(s), "", ""])
    cmd = data.get("command") or f"attnlab dynamics {data['experiment']} --size {data.get('size')} " \
                                 f"--seed {data.get('seed')}"
    figs = [path.parent / Path(f).name for f in data.get("figures", []) if (path.parent / Path(f).name).exists()]
    return Section("dynamics", f"dynamics: {data['experiment']} ({path.parent.name})", path, cmd,
                   ["run", "entropy drop (mean)", "rebound (mean)", "bounces back"], rows,
                   figs or _figures(path.parent, [path.stem]))


def _keys(*names):
    return lambda d, p: isinstance(d, dict) and all(n in d for n in names)


def _row_keys(*names):
    def test(d, p):
        recs = _records(d)
        return bool(recs) and all(n in recs[0] for n in names)
    return test


_quant = _generic("quant-eval", "quant-eval")
_dejavu = _generic("dejavu", "dejavu")
_bench = _generic("benchmark", "benchmark")
RECOGNISERS = [
    _ruler, _lmeval, _passkey, _anatomy, _dynamics,
    lambda d, p: _quant(d, p, _row_keys("format", "ppl", "bits_per_weight")),
    lambda d, p: _dejavu(d, p, _row_keys("method", "sparsity", "ppl")),
    lambda d, p: _dejavu(d, p, lambda d, p: _keys("sparsity", "recall")(d, p) or _keys("keep", "layers")(d, p)),
    lambda d, p: _bench(d, p, lambda d, p: _row_keys("variant", "tok_s")(d, p) or _keys("bandwidth_gbs")(d, p)
                        or _keys("budget", "sink", "threads")(d, p)),
    lambda d, p: _generic("benchmark", "result")(d, p, lambda d, p: isinstance(d, dict) and "command" in d),
]


def collect(paths: list[str | Path]) -> list[Section]:
    """Sections for every recognised result under paths (folders, walked recursively, or files)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise AttnlabError(f"{p}: no such file or folder")
        files += [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()
                                                 and not SKIP_DIRS & set(f.relative_to(p).parts[:-1]))
    sections, streams, claimed = [], {}, set()
    lmeval_dirs = {f.parent for f in files if f.name == "attnlab_summary.json"}
    for f in files:
        if f.suffix != ".json" or f.stat().st_size > MAX_JSON:
            continue
        if f.name.startswith("results_") and any(d in f.parents for d in lmeval_dirs):
            continue  # lm-eval's own file: its attnlab_summary.json above it says the same, with the command
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and "nll_tokens" in data and "policy" in data:
            streams.setdefault(f.parent, []).append((data, f))
            continue
        for rec in RECOGNISERS:
            s = rec(data, f)
            if s is not None:
                sections.append(s)
                break
    sections += [_stream_group(g) for g in streams.values()]
    for s in sections:
        claimed.update(s.figures)
    loose: dict[Path, list[Path]] = {}
    for f in files:
        if f.suffix == ".png" and f not in claimed:
            loose.setdefault(f.parent, []).append(f)
    sections += [Section("figures", f"figures: {d.name}", d, figures=sorted(v)) for d, v in loose.items()]
    order = list(NOTES)
    sections.sort(key=lambda s: (order.index(s.kind) if s.kind in order else len(order), str(s.source)))
    return sections


CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1100px;padding:16px;color:#222}
h1{font-size:22px}h2{font-size:17px;margin:28px 0 4px;border-top:1px solid #ddd;padding-top:14px}
.kind{display:inline-block;background:#eef;border-radius:4px;padding:0 6px;font-size:12px;margin-right:6px}
.src{color:#777;font-size:12px}.note{background:#fffbe6;border-left:3px solid #e6c200;padding:4px 8px}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}pre.cmd{white-space:pre-wrap;word-break:break-all}table{border-collapse:collapse;margin:6px 0}
td,th{border:1px solid #ccc;padding:2px 7px;font-size:12px;text-align:right}th{background:#f0f0f0}
td:first-child{text-align:left}img{max-width:100%;display:block;margin:8px 0;border:1px solid #eee}
nav a{margin-right:10px;font-size:12px}"""


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def render(sections: list[Section], title: str = "attnlab runs") -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>",
             f"<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; img-src data:; "
             f"style-src 'unsafe-inline'\"><style>{CSS}</style></head><body><h1>{e(title)}</h1>",
             f"<p>{len(sections)} runs. Each section: the command that produced it, its table, its figures and "
             f"what to look for.</p><details><summary>contents</summary><nav>"]
    parts += [f"<a href='#s{i}'>{e(s.title)}</a>" for i, s in enumerate(sections)]
    parts.append("</nav></details>")
    for i, s in enumerate(sections):
        parts.append(f"<section id='s{i}'><h2><span class='kind'>{e(s.kind)}</span>{e(s.title)}</h2>"
                     f"<div class='src'>{e(str(s.source))}</div>")
        if s.note:
            parts.append(f"<p class='note'>What to look for: {e(s.note)}</p>")
        parts.append(f"<pre class='cmd'>{e(s.command or '(command not recorded)')}</pre>")
        if s.rows:
            parts.append("<table><tr>" + "".join(f"<th>{e(str(h))}</th>" for h in s.headers) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in s.rows]
            parts.append("</table>")
        if s.text:
            parts.append(f"<pre>{e(s.text)}</pre>")
        parts += [_img(f) for f in s.figures]
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def build_report(paths: list[str | Path], out: str | Path, title: str = "attnlab runs") -> tuple[Path, int]:
    from attnlab.io import write_text
    sections = collect(paths)
    if not sections:
        raise AttnlabError(f"no run results (JSON or PNG) found under {', '.join(map(str, paths))}")
    return write_text(out, render(sections, title)), len(sections)
