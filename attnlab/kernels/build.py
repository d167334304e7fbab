"""Building and loading the C++ kernels (kernels.cpp with its SIMD arithmetic in kernels_simd.h:
quantized matmuls and row-sparse ops; attend.cpp: single-query attention over the KV cache).

Why a C++ kernel: the point of quantized weights is reading fewer bytes per token, which pays only if
dequantisation happens in registers. torch's own int4/int8 kernels want bf16 activations and are
compute-bound on AVX2 CPUs, and inductor turns a codebook lookup into scalar gathers. The kernels
multiply in integers, llama.cpp's way. The build needs a C++ compiler and AVX2; without them `load()`
is False and every op of `attnlab.kernels.ops` takes its pure-torch fallback.

One extension per ISA variant (`isa.LEVELS`: avx2, avxvnni, avx512, avx512vnni, amx), each in its own build
folder and .so, the same sources and op names: the compile flags pick the code paths (`#if
defined(__AVX512VNNI__)`). A process loads one, the best its CPU runs (`isa.best`, `ATTNLAB_ISA`
forces a lower one); `variant()` says which. Only the variant loaded is built, on first use.
"""
from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path

import torch

from attnlab.kernels import isa

_STATE: dict = {}
SOURCES = ("kernels.cpp", "attend.cpp", "repacked.cpp", "step.cpp", "sparse_cols.cpp", "glue.cpp", "causal.cpp")
# quantized matmuls; attention over the KV cache; matvecs over 16-row repacked weights; the native decode step;
# TEAL's column ops; a forward pass's elementwise glue; a prompt's causal attention (AVX-512 variants)
REPACK = ("avx512vnni", "amx")  # variants whose QuantLinear repacks int4/int8 weights (ATTNLAB_REPACK=0/1 overrides)
FLAGS = ("-O3",)  # + the variant's ISA flags (isa.LEVELS)
CACHE = Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab")) / "kernels"


def load() -> bool:
    """True once the extension is built and loaded: built at most once per process (kept under
    ~/.cache/attnlab/kernels, redone only when a source changes: ninja tracks the include); False
    without a compiler or AVX2, or with ATTNLAB_NO_KERNELS set. A bad ATTNLAB_ISA raises AttnlabError."""
    if "ok" not in _STATE:
        _STATE["ok"] = _build()
    return _STATE["ok"]


def variant() -> str | None:
    """The ISA variant the process runs ('avx2', 'avxvnni', 'avx512', 'avx512vnni', 'amx'), None without kernels."""
    return _STATE.get("isa") if load() else None


def wide() -> bool:
    """Whether the loaded variant has AVX-512 (the ops written for 16 lanes only: causal_attention)."""
    return _STATE.get("isa") is not None and "avx512f" in isa.LEVELS[_STATE["isa"]][0]


def repacks() -> bool:
    """Whether int4/int8 layers repack their weights for q4x_mm/q8x_mm: on the variants where that
    measured faster (REPACK), or as ATTNLAB_REPACK=1/0 says; never without kernels."""
    if not load():
        return False
    forced = os.environ.get("ATTNLAB_REPACK", "").strip()
    return forced == "1" if forced in ("0", "1") else _STATE["isa"] in REPACK


def _build() -> bool:
    if os.environ.get("ATTNLAB_NO_KERNELS"):
        return False
    level = isa.best()
    if level is None:
        return False
    try:
        from torch.utils.cpp_extension import load
        # one build folder per source folder: ninja rebuilds whenever the sources' paths change, so two
        # checkouts sharing a folder would rebuild each other's kernels on every load
        here = hashlib.sha1(str(Path(__file__).resolve().parent).encode()).hexdigest()[:10]
        build = CACHE / f"torch-{torch.__version__}-{here}-{level}"
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # left behind by a build that was killed: torch would wait on it forever
        if lock.exists() and time.time() - lock.stat().st_mtime > 600:
            lock.unlink(missing_ok=True)
        name = f"attnlab_qkernels_{level}"
        if not (build / f"{name}.so").exists():
            import sys
            print(f"attnlab: building the fused kernels for {level} (once per machine and torch version, "
                  "about a minute)", file=sys.stderr, flush=True)
        sources = [str(Path(__file__).with_name(f)) for f in SOURCES]
        flags = list(FLAGS) + list(isa.LEVELS[level][1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # OpenMP: without it at::parallel_for in the extension runs on one thread
                load(name=name, sources=sources, extra_cflags=flags + ["-fopenmp"],
                     extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False, is_python_module=False)
            except Exception:  # a compiler without OpenMP: single-threaded kernels rather than none
                load(name=name, sources=sources, extra_cflags=flags, build_directory=str(build),
                     verbose=False, is_python_module=False)
    except Exception as e:  # no compiler, no ninja, ...: fall back, say why once
        warnings.warn(f"attnlab: fused quantized kernels unavailable ({type(e).__name__}: {str(e)[:200]}); "
                      "using dequantise-then-matmul")
        return False
    _register_fakes()
    _STATE["isa"] = level
    return True


def _register_fakes() -> None:
    """Shapes for torch.compile: the ops are opaque to it but their outputs are [M, N] float32
    (matrix ops), [k] (rows_mv: one value per index) or [K] (rows_axpy: one weighted sum of rows)."""
    def fake(x, qs, *rest):
        return x.new_empty(x.shape[0], qs.shape[0])

    def fake_mv(x, w, *rest):
        return x.new_empty(rest[-1].shape[0])

    def fake_axpy(a, w, *rest):
        return a.new_empty(w.shape[1] * (2 if w.dtype == torch.uint8 else 1))
    for name in ("q4_mm", "lut4_mm", "q8_mm"):
        torch.library.register_fake(f"attnlab::{name}")(fake)
    for name in ("q4x_mm", "q8x_mm"):
        torch.library.register_fake(f"attnlab::{name}")(lambda x, w, n, *rest: x.new_empty(x.shape[0], n))
    for name in ("q4x_glu", "q8x_glu"):
        torch.library.register_fake(f"attnlab::{name}")(lambda x, w, n, *rest: x.new_empty(x.shape[0], n // 2))
    for name in ("f32", "q8", "q4"):
        torch.library.register_fake(f"attnlab::{name}_rows_mv")(fake_mv)
        torch.library.register_fake(f"attnlab::{name}_rows_axpy")(fake_axpy)
    torch.library.register_fake("attnlab::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake("attnlab::silu_mul")(lambda h: h.new_empty(*h.shape[:-1], h.shape[-1] // 2))
    torch.library.register_fake("attnlab::causal_attention")(lambda q, k, v, scale: torch.empty_like(q))
    torch.library.register_fake("attnlab::decode_attention")(lambda q, k, v, scale, *scales: torch.empty_like(q))
    torch.library.register_fake("attnlab::quantize_kv")(
        lambda x: (torch.empty_like(x, dtype=torch.int8), x.new_empty(*x.shape[:-1], x.shape[-1] // 32)))

