"""kvpress as the anchor: the same RULER samples, presses and ratios through NVIDIA's kvpress.

Runs in its own environment (kvpress 0.5.5 needs transformers >= 4.56, < 5.3; attnlab's gets 5.24), so it
imports nothing of attnlab: the samples come as JSON written by attnlab (`--write-samples`, in attnlab's
environment), the model is our `attnlab export` folder. Protocol = kvpress's pipeline: the context is
prefilled once, kvpress's own hook (`BasePress.forward_hook`, what `with press(model)` runs) compresses a
copy of it per (press, ratio), the question is fed after at positions continuing from the context's length, then greedy decoding with the same stop rule as `attnlab ruler`
(EOS, a newline after some text, or the task's max_new tokens). Scores are RULER's string_match_all.

    # attnlab's venv: the samples (seeded exactly as `attnlab ruler --seed 0`)
    python benchmarks/kvpress_anchor.py --write-samples runs/anchor/samples.json --length 4096 --samples 1
    # kvpress's venv (`make bench-kvpress` builds venv-kvpress/ from the package registry)
    venv-kvpress/bin/python benchmarks/kvpress_anchor.py runs/anchor/samples.json MODEL_DIR \
        --presses knorm,streaming_llm,snapkv,tova,expected_attention --ratios 0.25,0.5,0.75 --out runs/anchor/kvpress.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path


def write_samples(path: str, length: int, samples: int, seed: int, model: str) -> None:
    import attnlab
    from attnlab.eval.ruler import TASKS, make_sample
    from attnlab.io import finish_record, run_record, write_json
    record = run_record(None, seed, "python " + " ".join(["benchmarks/kvpress_anchor.py", *sys.argv[1:]]))
    lm = attnlab.load(model, tokenizer=True)
    rows = [make_sample(t, lm.encode, length, seed, i) for i in range(samples) for t in TASKS]
    write_json(Path(path), {**finish_record(record), "samples": [
        {k: s[k] for k in ("task", "length", "index", "ids", "context_tokens", "answers", "max_new", "tokens")}
        for s in rows]})


def load_samples(path) -> list[dict]:
    """The samples of a file `--write-samples` made (older files: the bare list). Imports nothing of attnlab."""
    data = json.loads(Path(path).read_text())
    return data["samples"] if isinstance(data, dict) else data


def _commit() -> str:
    """The attnlab commit the samples and this script come from (this environment imports nothing of attnlab)."""
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def make_press(spec: str, ratio: float):
    """kvpress's press for a spec NAME[:field=value...], as attnlab's `make_press` reads it (e.g.
    snapkv:window_size=32); chunk_length=L wraps it in kvpress's ChunkKVPress (whole chunks of L tokens)."""
    import kvpress
    name, *pairs = spec.split(":")
    fields = {k: int(v) for k, v in (x.split("=", 1) for x in pairs)}
    chunk = fields.pop("chunk_length", 0)
    cls = {"knorm": kvpress.KnormPress, "streaming_llm": kvpress.StreamingLLMPress, "snapkv": kvpress.SnapKVPress,
           "tova": kvpress.TOVAPress, "expected_attention": kvpress.ExpectedAttentionPress}[name]
    press = cls(compression_ratio=ratio, **fields)
    return kvpress.ChunkKVPress(press, chunk_length=chunk) if chunk else press


def prefill(model, sample: dict, question: bool = False):
    """The context through the model once (sdpa), capturing what kvpress's hook sees at each attention layer:
    its keyword arguments (hidden_states, position_embeddings, cache_position). Returns {"out": state} and,
    with question, "in": the state after the cache read the question too (all but the prompt's last token), its
    captures appended to the context's (what one forward over that prompt hands the hook: compress_questions).
    A state is (keys/values per layer, captured arguments, attention modules, question ids, first logits)."""
    import torch
    from transformers import DynamicCache
    n = sample["context_tokens"]
    layers = model.model.layers
    modules = [layer.self_attn for layer in layers]

    def forward(ids, cache, start):
        seen: dict = {}

        def hook(module, args, kwargs, output):
            seen[module.layer_idx] = {k: kwargs[k] for k in ("hidden_states", "position_embeddings", "cache_position")}
        handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
        try:
            with torch.no_grad():
                pos = torch.arange(start, start + ids.shape[1])[None]
                logits = model(ids, past_key_values=cache, position_ids=pos).logits[:, -1]
        finally:
            for h in handles:
                h.remove()
        return seen, logits

    def kv_of(cache):
        return [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in range(len(layers))]

    ids = torch.tensor([sample["ids"]])
    cache = DynamicCache()
    seen, _ = forward(ids[:, :n], cache, 0)
    states = {"out": (kv_of(cache), seen, modules, sample["ids"][n:], None)}
    if question:
        more, _ = forward(ids[:, n:-1], cache, n)  # the last token is fed after the press, as kvpress feeds
        # compress_questions' question suffix: every answer token is computed from the pressed cache
        both = {i: {"hidden_states": torch.cat([seen[i]["hidden_states"], more[i]["hidden_states"]], 1),
                    "position_embeddings": tuple(torch.cat([a, b], 1) for a, b in
                                                 zip(seen[i]["position_embeddings"], more[i]["position_embeddings"])),
                    "cache_position": torch.cat([seen[i]["cache_position"], more[i]["cache_position"]])}
                for i in seen}
        states["in"] = (kv_of(cache), both, modules, sample["ids"][-1:], None)
    return states


def answer(model, tok, sample: dict, press, state) -> str:
    """kvpress's own hook (`BasePress.forward_hook`, what `with press(model)` runs after each layer's attention
    in the prefill) applied to a copy of the prefilled cache, then the question (if not pressed with the
    context) and greedy decoding."""
    import torch
    from transformers import DynamicCache
    kv, seen, modules, question, logits = state
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    if press is not None:
        press.post_init_from_model(model)
        for i, module in enumerate(modules):
            module.rotary_emb = model.model.rotary_emb  # what `with press(model)` sets before hooking
            press.forward_hook(module, [], {**seen[i], "past_key_values": cache}, (None, None))
    nxt = len(sample["ids"])
    with torch.no_grad():
        if question:
            pos = torch.arange(nxt - len(question), nxt)[None]
            logits = model(torch.tensor([question]), past_key_values=cache, position_ids=pos).logits[:, -1]
        out = []
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for _ in range(sample["max_new"]):
            t = int(logits.argmax(-1))
            if t in eos:
                break
            out.append(t)
            if len(out) >= sample["max_new"] or "\n" in tok.decode(out, skip_special_tokens=True).lstrip():
                break
            logits = model(torch.tensor([[t]]), past_key_values=cache, position_ids=torch.tensor([[nxt]])).logits[:, -1]
            nxt += 1
    return tok.decode(out, skip_special_tokens=True)


def dump_kept(model, sample: dict, presses: list[str], ratio: float, path: str) -> None:
    """kvpress's kept indices on one sample: its ScorerPress.compress keeps scores.topk(int(n * (1 - ratio)))
    of each layer and KV head; saved as {press: [layer: LongTensor [kv_heads, kept] ascending]}."""
    import torch
    kv, seen, modules = prefill(model, sample)["out"][:3]
    out = {}
    for name in presses:
        press = make_press(name, ratio)
        press.post_init_from_model(model)
        kept = []
        for i, module in enumerate(modules):
            module.rotary_emb = model.model.rotary_emb
            k, v = kv[i]
            with torch.no_grad():
                scores = press.score(module, seen[i]["hidden_states"], k, v, None, dict(seen[i]))
            n = max(1, int(k.shape[2] * (1 - ratio)))
            kept.append(scores.topk(n, dim=-1).indices.sort(-1).values[0])
        out[name] = kept
    torch.save(out, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("samples", nargs="?")
    p.add_argument("model_dir", nargs="?")
    p.add_argument("--write-samples", default=None)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples-per-task", "--samples", dest="n", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--presses", default="knorm,streaming_llm,snapkv,tova,expected_attention")
    p.add_argument("--ratios", default="0.25,0.5,0.75")
    p.add_argument("--question", default="out", help="out, in (kvpress's compress_questions), or out,in")
    p.add_argument("--out", default="kvpress_anchor.json")
    p.add_argument("--limit", type=int, default=0, help="only the first N samples (timing)")
    p.add_argument("--dump-kept", default=None, help="only save kvpress's kept indices on the first sample (.pt)")
    a = p.parse_args()
    if a.write_samples:
        write_samples(a.write_samples, a.length, a.n, a.seed, a.model)
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    samples = load_samples(a.samples)[: a.limit or None]
    if a.dump_kept:
        dump_kept(model, samples[0], a.presses.split(","), float(a.ratios.split(",")[0]), a.dump_kept)
        return 0
    questions = a.question.split(",")
    cells = [("full", "out", 0.0)] + [(n, q, float(r)) for q in questions for n in a.presses.split(",")
                                      for r in a.ratios.split(",")]
    head = {"command": " ".join(["python", "benchmarks/kvpress_anchor.py"] + sys.argv[1:]), "commit": _commit(),
            "seed": 0, "kvpress": version("kvpress"), "transformers": version("transformers"), "model": a.model_dir}
    results = []
    for s in samples:
        start = time.process_time()
        states = prefill(model, s, "in" in questions)
        first = time.process_time() - start
        for name, question, ratio in cells:
            t = time.process_time()
            pred = answer(model, tok, s, None if name == "full" else make_press(name, ratio), states[question])
            score = 100 * sum(x.lower() in pred.lower() for x in s["answers"]) / len(s["answers"])
            results.append({"press": name, "question": question, "ratio": ratio, "task": s["task"],
                            "index": s["index"], "score": score, "pred": pred,
                            "cpu_seconds": time.process_time() - t, "prefill_cpu_seconds": first})
            print(json.dumps(results[-1]), flush=True)
        tmp = Path(a.out).with_suffix(".tmp")  # after each sample, atomically: a cut run keeps what it did
        tmp.write_text(json.dumps({**head, "results": results}, indent=1))
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
