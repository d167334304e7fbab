"""llama.cpp as the peer: the CPU it runs on, which builds work there, and reading llama-bench's output.

Shared by `build_llamacpp.py` (make bench-llamacpp), `decode_speed.py` and `decode_kl.py`. Builds live
under `<root>/build/llamacpp/<name>/bin` with a `build.json` beside them saying how they were configured and
whether batches above one token need `-ub 1` (a native build on a CPU with AMX that the OS does not grant).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from attnlab.kernels.isa import SHOWN_FLAGS, amx_granted, cpu_flags, cpu_model, shown_flags  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = ROOT / "build" / "llamacpp"

# ggml's CMake switches for the ISA extensions a generic (GGML_NATIVE=OFF) build may use: cpuinfo flag -> option
GENERIC_FLAGS = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C",
                 "bmi2": "GGML_BMI2", "avx512f": "GGML_AVX512", "avx512_vbmi": "GGML_AVX512_VBMI",
                 "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16", "avx_vnni": "GGML_AVX_VNNI"}


def plan_builds(flags: set[str], granted: bool) -> dict[str, dict]:
    """The two builds to time and how to run them. native: -march=native (ggml repacks weights for its
    AVX-512 VNNI / AMX path); when the CPU has AMX but the OS forbids tiles, batches above one token die with
    SIGILL, so it runs with `-ub 1` (recorded, not hidden). generic: the CPU's ISA flags, AMX off."""
    amx_cpu = "amx_tile" in flags
    # GCC 12 drops the stores that fill ggml's AMX tile configuration before `ldtilecfg` (dead-store elimination
    # does not see the intrinsic read them; RTL dead-store elimination): the native build then dies with a general
    # protection fault on its first batch. -fno-dse keeps them.
    native = {"cmake": ["-DGGML_NATIVE=ON"] + (["-DCMAKE_C_FLAGS=-fno-dse", "-DCMAKE_CXX_FLAGS=-fno-dse"]
                                               if amx_cpu and granted else []),
              "ub1": amx_cpu and not granted,
              "note": ("AMX in the CPU but not granted by the OS: batches > 1 token need -ub 1"
                       if amx_cpu and not granted else "AMX " + ("granted" if amx_cpu else "absent"))}
    generic = {"cmake": ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in flags else 'OFF'}"
                                                 for flag, opt in GENERIC_FLAGS.items()]
               + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
               "ub1": False, "note": "ISA flags of the CPU, AMX off"}
    return {"native": native, "generic": generic}


def header() -> str:
    """The lines every benchmark run starts with: CPU model, its ISA flags, AMX permission, attnlab's variant."""
    flags = cpu_flags()
    shown = " ".join(shown_flags()) or "none of " + " ".join(SHOWN_FLAGS)
    lines = [f"CPU: {cpu_model()} ({_count_cpus()} logical CPUs)", f"ISA flags: {shown}"]
    if "amx_tile" in flags:
        lines.append(f"AMX tiles granted by the OS: {amx_granted()}")
    lines.append(f"attnlab kernel variant: {attnlab_variant()}")
    return "\n".join(lines)


def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5, clock=None) -> float:
    """GB/s of a float32 sum over `gib` GiB at `threads` torch threads (median of `repeats`; torch's thread count
    restored): the ceiling of a decode step, which streams its weights from memory once per token. clock: wall
    time by default; `time.thread_time` at 1 thread counts only the time this thread ran (a shared machine)."""
    import statistics
    import time

    import torch
    clock = clock or time.perf_counter
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(int(gib * 2 ** 28))
        buf.sum()
        times = []
        for _ in range(repeats):
            start = clock()
            buf.sum()
            times.append(clock() - start)
        return buf.numel() * 4 / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)


def bandwidths(threads=(1, 2), gib: float = 1.0) -> dict[int, float]:
    """{threads: read_bandwidth} at 1 and 2 threads (every decode benchmark prints them: bandwidth_line)."""
    return {t: read_bandwidth(t, gib) for t in threads}


def bandwidth_line(bw: dict[int, float], gib: float = 1.0) -> str:
    return f"read bandwidth (float32 sum over {gib:g} GiB): " + ", ".join(
        f"{g:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t, g in sorted(bw.items()))


def token_bytes(path) -> int:
    """Bytes of weights one decode step reads from a GGUF file: every tensor, but only one row of the token
    table where the file has its own output head (the table is then read one row per token)."""
    import gguf
    tensors = gguf.GGUFReader(str(path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def bound_fraction(tok_s: float, bytes_per_token: float, gbs: float) -> float:
    """tok/s as a fraction of the bandwidth limit, gbs * 1e9 / bytes_per_token tokens per second."""
    return tok_s * bytes_per_token / (gbs * 1e9)


def _count_cpus() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def attnlab_variant() -> str:
    """The kernel build attnlab chose, if attnlab.kernels.build reports it (engineer A's function)."""
    try:
        from attnlab.kernels import build
    except Exception as e:  # noqa: BLE001 - a header line, never fatal
        return f"unknown ({type(e).__name__})"
    for name in ("variant", "chosen_variant", "isa_variant", "selected_variant", "best_variant"):
        fn = getattr(build, name, None)
        if callable(fn):
            try:
                return str(fn())
            except Exception as e:  # noqa: BLE001
                return f"unknown ({e})"
    return "AVX2 (single build; no variant dispatch in this revision)"


def installed(root: Path = BUILD_ROOT) -> dict[str, dict]:
    """Builds present under root: name -> build.json (with "bin" added), only those whose binaries exist."""
    out = {}
    for name in ("native", "generic"):
        meta = root / name / "build.json"
        if meta.exists() and (root / name / "bin" / "llama-bench").exists():
            out[name] = {**json.loads(meta.read_text()), "bin": str(root / name / "bin")}
    return out


def find_builds(root: Path | None = None) -> dict[str, dict]:
    """This checkout's builds, else the main checkout's (shared by every worktree)."""
    for r in ([root] if root else [BUILD_ROOT, Path("/work/main/build/llamacpp")]):
        got = installed(r)
        if got:
            return got
    return {}


def parse_bench(text: str) -> list[dict]:
    """llama-bench `-o json` output -> one row per test: threads, flash, depth, n_prompt, n_gen, ub, tok/s
    (mean and standard deviation over its repetitions) and the per-repetition samples."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output")
    rows = []
    for r in json.loads(text[start:]):
        rows.append({"threads": int(r["n_threads"]), "flash": int(r.get("flash_attn", 0)) == 1,
                     "depth": int(r.get("n_depth", 0)), "n_prompt": int(r["n_prompt"]), "n_gen": int(r["n_gen"]),
                     "ub": int(r.get("n_ubatch", 0)), "tps": float(r["avg_ts"]), "tps_sd": float(r.get("stddev_ts", 0)),
                     "samples": [float(s) for s in r.get("samples_ts", [])]})
    return rows


def best_per_cell(rows: list[dict]) -> dict[tuple, dict]:
    """The faster of flash attention on/off for each (threads, depth, prompt, gen) cell."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["threads"], r["depth"], r["n_prompt"], r["n_gen"])
        if key not in best or r["tps"] > best[key]["tps"]:
            best[key] = r
    return best


def run_bench(build: dict, model: str, args: list[str], timeout: float = 1800) -> list[dict]:
    """One llama-bench call (JSON output) on a build; `-ub 1` added where the build needs it."""
    cmd = [str(Path(build["bin"]) / "llama-bench"), "-m", str(model), "-o", "json", *args]
    if build.get("ub1") and "-ub" not in args:
        cmd += ["-ub", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
    return parse_bench(out.stdout)
