"""Fuzz harness: mutated GGUF files and Hugging Face folders must load to finite logits or raise ModelLoadError.

A seeded mutation loop over a tiny random llama written here (tests/model_files.py): byte
flips and interesting integers in the GGUF header, weight bytes, truncations, metadata
rewritten through gguf.GGUFWriter with wrong values or types, config.json fields set to
hostile JSON, safetensors header and data bytes; a quarter of the cases load with
--quant int8 (GGUF Q8_0 tensors kept packed). A third of the cases are type-confused but
valid (tests/fuzz_confused.py): config.json that is not an object, any value at any depth
replaced by another JSON type (an array for a scalar, a string for an int, an object for a
flag, a nested null), GGUF metadata written with the wrong type, rope_freqs of the wrong
length or values, and attnlab's own quantized folder (config.json and tensors) likewise. Every case runs in a worker process
(spawned once, reused) whose data segment is capped at its start-up size + 1 GiB and
whose case must finish within CASE_SECONDS: a subprocess is the only way to stop a
hang or survive a blow-up without taking pytest down, and one long-lived worker keeps
the per-case cost at milliseconds (torch is imported once). A worker that dies or times
out is replaced and the case counted as a failure.

Default suite: 300 cases (~25 s). `make fuzz` (pytest -m fuzz) runs FUZZ_CASES (10,000);
the report counts outcomes per mutation family.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from tests import fuzz_confused

CASE_SECONDS = 20
SCHEDULE = (0, 1, 2, 0, 1, 3, 0, 1, 4)  # family per case: bytes and fields two thirds, type-confused one third
MEMORY_HEADROOM = 1 << 30
INTERESTING = [0, 1, 2, 3, 7, 8, 9, 12, 13, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
               2**63 - 1, 2**63, 2**64 - 1]
HF_KEYS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
           "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
           "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "eos_token_id", "bos_token_id",
           "attention_bias"]
GGUF_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length"]


# ---------------------------------------------------------------- worker side

def _worker_init():
    import resource
    # Packed weights run on the dequantise-then-matmul fallback: the harness tests validation, which a quantized
    # load goes through the same way, not the kernels.
    os.environ["ATTNLAB_NO_KERNELS"] = "1"

    import torch
    torch.set_num_threads(1)
    import attnlab.engine  # noqa: F401  (imported once per worker, before the cap)
    used = int(open("/proc/self/status").read().split("VmData:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (used + MEMORY_HEADROOM, used + MEMORY_HEADROOM))


def run_case(files: dict[str, bytes], quant: str | None = None) -> tuple[str, str]:
    """Write the case's files, load them (with --quant's path when quant), score a fixed input -> (outcome, detail)."""
    import traceback

    import torch

    from attnlab.engine import LM
    from attnlab.model.loaders import ModelLoadError
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / name).write_bytes(data)
        target = Path(tmp) / ("m.gguf" if "m.gguf" in files else "hf")
        try:
            lm = LM.load(target, tokenizer=False, quant=quant)
            ids = torch.randint(0, lm.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
            logits = lm.logits(ids)
        except ModelLoadError as e:
            return "rejected", str(e).splitlines()[0][:200] if str(e) else ""
        except BaseException as e:  # noqa: BLE001  (any other type is what the harness hunts)
            return "other", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        if not bool(torch.isfinite(logits).all()):
            return "nonfinite", f"{lm.cfg}"
        return "loaded", ""


# ---------------------------------------------------------------- mutators

def _bases(tmp: Path) -> dict:
    from attnlab.model.validate import scan_gguf
    from tests.model_files import write_gguf, write_hf
    gguf_path = write_gguf(tmp / "m.gguf")
    gguf_q8 = write_gguf(tmp / "q.gguf", qtype="Q8_0")
    hf = write_hf(tmp / "hf")
    return {"gguf": gguf_path.read_bytes(), "gguf_header": scan_gguf(gguf_path).data_offset,
            "gguf_q8": gguf_q8.read_bytes(), "gguf_q8_header": scan_gguf(gguf_q8).data_offset,
            "config": json.loads((hf / "config.json").read_text()), "st": (hf / "model.safetensors").read_bytes(),
            **fuzz_confused.bases(tmp)}


def _flip(data: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    at = rng.randrange(lo, max(lo + 1, hi))
    if at < len(data):
        data[at] = rng.randrange(256) if rng.random() < 0.5 else data[at] ^ (1 << rng.randrange(8))


def _int(data: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    size = rng.choice([4, 8])
    at = rng.randrange(lo, max(lo + 1, hi - size))
    value = rng.choice(INTERESTING) if rng.random() < 0.8 else rng.randrange(2**64)
    if at + size <= len(data):
        struct.pack_into("<I" if size == 4 else "<Q", data, at, value % (2**32 if size == 4 else 2**64))


def _hostile_value(rng: random.Random):
    return rng.choice([0, -1, 1, 3, 7, 10**9, 2**31, 2**63, 0.5, -1e30, float("nan"), float("inf"), "", "llama",
                       "8", None, True, False, [], [1, 2], {}, {"rope_type": "linear"}, {"factor": 0},
                       {"rope_type": "llama3", "factor": 8.0}, {"rope_type": "yarn", "factor": 2.0},
                       rng.randrange(-5, 100)])


def gguf_case(base: dict, rng: random.Random) -> dict[str, bytes]:
    """One mutated GGUF file: bytes of the header or the data, truncation, or metadata rewritten by the writer."""
    quant = rng.random() < 0.3
    data = bytearray(base["gguf_q8" if quant else "gguf"])
    header = base["gguf_q8_header" if quant else "gguf_header"]
    how = rng.random()
    if how < 0.2:  # rewritten through the writer: a wrong value, a wrong type, a tensor dropped or reshaped
        return {"m.gguf": _semantic_gguf(rng)}
    for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
        kind = rng.random()
        if kind < 0.45:
            _flip(data, 0, header, rng)
        elif kind < 0.75:
            _int(data, 4, header, rng)
        elif kind < 0.95:
            _flip(data, header, len(data), rng)
        else:
            del data[rng.randrange(len(data)):]
    return {"m.gguf": bytes(data)}


def _semantic_gguf(rng: random.Random) -> bytes:
    from tests.model_files import tiny_tensors, write_gguf
    tensors, meta = tiny_tensors(seed=rng.randrange(1000)), {}
    kind = rng.random()
    if kind < 0.5:
        meta[rng.choice(GGUF_KEYS)] = rng.choice(INTERESTING[:13] + [0.5, 1e30, None])
    elif kind < 0.7 and tensors:
        del tensors[rng.choice(sorted(tensors))]
    else:
        name = rng.choice(sorted(tensors))
        t = tensors[name]
        tensors[name] = t.T.copy() if t.ndim == 2 and rng.random() < 0.5 else t[..., : max(1, t.shape[-1] // 2)].copy()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return write_gguf(Path(tmp) / "x.gguf", tensors, meta).read_bytes()
        except Exception:  # the writer refused (e.g. a value out of uint32): fall back to a valid file
            return write_gguf(Path(tmp) / "x.gguf").read_bytes()


def hf_case(base: dict, rng: random.Random) -> dict[str, bytes]:
    """One mutated folder: config.json fields or bytes, safetensors header/data bytes, truncation."""
    config, st = dict(base["config"]), bytearray(base["st"])
    header = 8 + struct.unpack_from("<Q", st, 0)[0]
    text = None
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.random()
        if kind < 0.45:
            key = rng.choice(HF_KEYS)
            if rng.random() < 0.15:
                config.pop(key, None)
            else:
                config[key] = _hostile_value(rng)
        elif kind < 0.55:
            text = bytearray(json.dumps(config).encode())
            _flip(text, 0, len(text), rng)
        elif kind < 0.75:
            (_flip if rng.random() < 0.6 else _int)(st, 0, header, rng)
        elif kind < 0.95:
            _flip(st, header, len(st), rng)
        else:
            del st[rng.randrange(len(st)):]
    cfg_bytes = bytes(text) if text is not None else json.dumps(config).encode()
    return {"hf/config.json": cfg_bytes, "hf/model.safetensors": bytes(st)}


# ---------------------------------------------------------------- driver

def _ready() -> None:
    time.sleep(0.2)  # long enough for every worker of the pool to take one


def _new_pool(ctx, workers: int):
    """A pool whose workers have finished start-up (torch import, kernel build): the case clock starts after."""
    pool = ctx.Pool(workers, initializer=_worker_init)
    for res in [pool.apply_async(_ready) for _ in range(workers)]:
        res.get(timeout=600)
    return pool


def fuzz(n_cases: int, seed: int, workers: int = 1) -> tuple[Counter, list]:
    """Run n_cases (half GGUF, half HF) -> (outcome counts, failures [(case id, outcome, detail)])."""
    ctx = mp.get_context("spawn")
    rng = random.Random(seed)
    counts, failures = Counter(), []
    pool = _new_pool(ctx, workers)
    with tempfile.TemporaryDirectory() as tmp:
        base = _bases(Path(tmp))
        base.update(pool.apply(fuzz_confused.quantized_base, (tmp,)))  # in a worker: quantized loads need its setup
    families = [("gguf", gguf_case), ("hf", hf_case), ("gguf-confused", fuzz_confused.gguf_case),
                ("hf-confused", fuzz_confused.hf_case), ("quantized-confused", fuzz_confused.quantized_case)]
    try:
        i = 0
        while i < n_cases:
            batch = []
            for j in range(i, min(n_cases, i + 8 * workers)):
                family, make = families[SCHEDULE[j % len(SCHEDULE)]]
                case = make(base, rng)
                quant = "int8" if family != "quantized-confused" and rng.random() < 0.25 else None  # a quarter quantized
                batch.append((j, family, (case, quant)))
            i += len(batch)
            queue = [(j, family, case, pool.apply_async(run_case, case)) for j, family, case in batch]
            while queue:
                j, family, case, res = queue.pop(0)
                try:
                    outcome, detail = res.get(timeout=CASE_SECONDS)
                except mp.TimeoutError:
                    outcome, detail = "hang", f"no answer within {CASE_SECONDS} s (or the worker died)"
                counts[outcome] += 1
                counts[f"{family} {outcome}"] += 1
                if outcome not in ("loaded", "rejected"):
                    failures.append((j, outcome, detail))
                    print(f"fuzz case {j}: {outcome}: {detail[-600:]}", file=sys.stderr, flush=True)
                    if outcome == "hang":  # a stuck or dead worker: start fresh, resubmit the rest of the batch
                        pool.terminate()
                        pool = _new_pool(ctx, workers)
                        queue = [(k, f, c, pool.apply_async(run_case, c)) for k, f, c, _ in queue]
    finally:
        pool.terminate()
    return counts, failures


def _report(counts: Counter, failures: list, seconds: float) -> str:
    total = {k: v for k, v in counts.items() if " " not in k}
    lines = [f"{sum(total.values())} cases in {seconds:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(total.items()))]
    lines += ["  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if " " in k)]
    lines += [f"  case {j}: {o}: {d[:400]}" for j, o, d in failures[:10]]
    return "\n".join(lines)


def test_fuzz_default_suite():
    start = time.perf_counter()
    counts, failures = fuzz(300, seed=0)
    report = _report(counts, failures, time.perf_counter() - start)
    print(report)
    assert not failures, report
    assert counts["loaded"] > 10 and counts["rejected"] > 100, report  # the mutations reach both outcomes
    for family in ("gguf-confused", "hf-confused", "quantized-confused"):  # and so do the type-confused ones
        assert counts[f"{family} loaded"] > 0 and counts[f"{family} rejected"] > 5, report


@pytest.mark.fuzz
def test_fuzz_long():
    n = int(os.environ.get("FUZZ_CASES", "10000"))
    start = time.perf_counter()
    counts, failures = fuzz(n, seed=int(os.environ.get("FUZZ_SEED", "1")), workers=int(os.environ.get("FUZZ_WORKERS", "1")))
    report = _report(counts, failures, time.perf_counter() - start)
    print(report)
    out = os.environ.get("FUZZ_REPORT")
    if out:
        Path(out).write_text(report + "\n")
    assert not failures, report
