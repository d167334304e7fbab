"""The fused kernels (kernels.cpp, its SIMD arithmetic in kernels_simd.h; attend.cpp, single-query
attention over the KV cache), built on first use, with a pure-torch fallback.

Why a C++ kernel: the point of quantized weights is reading fewer bytes per token,
which pays only if dequantisation happens in registers. torch's own int4/int8
kernels want bf16 activations and are compute-bound on AVX2 CPUs, and inductor
turns a codebook lookup into scalar gathers (5 ms for a 1536x576 matvec, 40x
slower than float). The kernels multiply in integers, llama.cpp's way. The build needs a
C++ compiler and AVX2; without them `available()` is False and every format falls
back to dequantise-then-matmul, the same numbers, only slower.
"""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch

_STATE: dict = {}
SOURCES = ("kernels.cpp", "attend.cpp")  # quantized matmuls; single-query attention over the KV cache
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c")
CACHE = Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab")) / "kernels"


def available() -> bool:
    """True once the extension is built and loaded (built at most once per process; the build is
    kept under ~/.cache/attnlab/kernels and redone only when kernels.cpp or kernels_simd.h changes:
    ninja tracks the include)."""
    if "ok" not in _STATE:
        _STATE["ok"] = _build()
    return _STATE["ok"]


def ready() -> bool:
    """True if the extension is already loaded; never builds (safe inside a forward or a trace)."""
    return _STATE.get("ok", False)


def _build() -> bool:
    if os.environ.get("ATTNLAB_NO_KERNELS"):
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    try:
        from torch.utils.cpp_extension import load
        build = CACHE / f"torch-{torch.__version__}"
        build.mkdir(parents=True, exist_ok=True)
        lock = build / "lock"  # left behind by a build that was killed: torch would wait on it forever
        if lock.exists() and time.time() - lock.stat().st_mtime > 600:
            lock.unlink(missing_ok=True)
        if not (build / "attnlab_qkernels.so").exists():
            import sys
            print("attnlab: building the fused kernels (once per machine and torch version, about a minute)",
                  file=sys.stderr, flush=True)
        sources = [str(Path(__file__).with_name(f)) for f in SOURCES]
        flags = list(FLAGS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:  # OpenMP: without it at::parallel_for in the extension runs on one thread
                load(name="attnlab_qkernels", sources=sources, extra_cflags=flags + ["-fopenmp"],
                     extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False, is_python_module=False)
            except Exception:  # a compiler without OpenMP: single-threaded kernels rather than none
                load(name="attnlab_qkernels", sources=sources, extra_cflags=flags, build_directory=str(build),
                     verbose=False, is_python_module=False)
    except Exception as e:  # no compiler, no ninja, ...: fall back, say why once
        warnings.warn(f"attnlab: fused quantized kernels unavailable ({type(e).__name__}: {str(e)[:200]}); "
                      "using dequantise-then-matmul")
        return False
    _register_fakes()
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
    for name in ("f32", "q8", "q4"):
        torch.library.register_fake(f"attnlab::{name}_rows_mv")(fake_mv)
        torch.library.register_fake(f"attnlab::{name}_rows_axpy")(fake_axpy)
    torch.library.register_fake("attnlab::decode_attention")(lambda q, k, v, scale, *scales: torch.empty_like(q))
    torch.library.register_fake("attnlab::quantize_kv")(
        lambda x: (torch.empty_like(x, dtype=torch.int8), x.new_empty(*x.shape[:-1], x.shape[-1] // 32)))


def q4_mm(x, qs, scale, min_, group):
    return torch.ops.attnlab.q4_mm(x, qs, scale, min_, group)


def lut4_mm(x, qs, lut, lut_scale, group):
    return torch.ops.attnlab.lut4_mm(x, qs, lut, lut_scale, group)


def q8_mm(x, q, scale, group):
    return torch.ops.attnlab.q8_mm(x, q, scale, group)


# Row-sparse ops (Deja Vu's sparse MLP) are called as torch.ops.attnlab.{f32,q8,q4}_rows_{mv,axpy} through
# attnlab.sparsity.rows: idx [k] int64 selects rows of a weight [N, K] (q4: codes [N, K/2]);
# *_rows_mv(x [K]) -> [k] = (w[idx] @ x), *_rows_axpy(a [k]) -> [K] = sum_j a_j w[idx_j].
