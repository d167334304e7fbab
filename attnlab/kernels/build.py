"""Loading the C++ kernels that were built when the package was installed (`setup.py`).

Why a C++ kernel: the point of quantized weights is reading fewer bytes per token, which pays only if
dequantisation happens in registers. torch's own int4/int8 kernels want bf16 activations and are
compute-bound on AVX2 CPUs, and inductor turns a codebook lookup into scalar gathers. The kernels
multiply in integers, llama.cpp's way.

One library per ISA variant (`isa.LEVELS`: avx2, avxvnni, avx512, avx512vnni, amx), the same sources and op
names: the compile flags pick the code paths (`#if defined(__AVX512VNNI__)`). A process loads one, the best its
CPU runs that was built (`isa.best`; `ATTNLAB_ISA` forces one). Nothing is compiled here: a library is named
after a hash of the sources it was built from (`isa.library_name`), so after a source changes the old build is
not loaded and `why()` says to rebuild (`make kernels`, or `pip install -e .` again). Without kernels every op
of `attnlab.kernels.ops` takes its pure-torch fallback, with one warning that says why; with
ATTNLAB_REQUIRE_KERNELS=1 (CI sets it) that is an error instead.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import isa

_STATE: dict = {}
HERE = Path(__file__).resolve().parent
REPACK = ("avx512vnni", "amx")  # variants whose QuantLinear repacks int4/int8 weights (ATTNLAB_REPACK=0/1 overrides)
REBUILD = "run `make kernels` in a checkout, or reinstall attnlab (`pip install -e .`)"


def load() -> bool:
    """True once a built variant is loaded (at most once per process). False with ATTNLAB_NO_KERNELS set, below
    AVX2, or when no library of the current sources is installed: then one warning says why, or, with
    ATTNLAB_REQUIRE_KERNELS=1, AttnlabError. A bad ATTNLAB_ISA raises AttnlabError."""
    if "ok" not in _STATE:
        _STATE["ok"] = _load()
        if not _STATE["ok"]:
            required = os.environ.get("ATTNLAB_REQUIRE_KERNELS", "").strip() not in ("", "0")
            if required and not os.environ.get("ATTNLAB_NO_KERNELS"):
                del _STATE["ok"]
                raise AttnlabError(f"ATTNLAB_REQUIRE_KERNELS is set but the C++ kernels are unavailable: {_STATE['why']}")
            if not os.environ.get("ATTNLAB_NO_KERNELS"):
                warnings.warn(f"attnlab: C++ kernels unavailable ({_STATE['why']}); every op runs its pure-torch "
                              "fallback, many times slower", stacklevel=2)
    return _STATE["ok"]


def why() -> str:
    """Why the kernels are not loaded ('' when they are)."""
    load()
    return _STATE.get("why", "")


def variant() -> str | None:
    """The ISA variant the process runs ('avx2', 'avxvnni', 'avx512', 'avx512vnni', 'amx'), None without kernels."""
    return _STATE.get("isa") if load() else None


def library() -> Path | None:
    """The loaded library's file, None without kernels."""
    return _STATE.get("path") if load() else None


def built() -> dict[str, Path]:
    """variant -> library file, for every variant installed from the current sources."""
    out = {}
    for level in isa.LEVELS:
        stem = isa.library_name(level, torch.__version__)
        found = sorted(HERE.glob(f"{stem}.*so"))
        if found:
            out[level] = found[0]
    return out


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


def _load() -> bool:
    if os.environ.get("ATTNLAB_NO_KERNELS"):
        _STATE["why"] = "ATTNLAB_NO_KERNELS is set"
        return False
    best = isa.best()
    if best is None:
        _STATE["why"] = f"this CPU lacks {' '.join(isa.LEVELS['avx2'][0])} (the kernels' floor)"
        return False
    have = built()
    forced = bool(os.environ.get("ATTNLAB_ISA", "").strip())
    runnable = [best] if forced else list(reversed(isa.supported()))
    level = next((v for v in runnable if v in have), None)
    if level is None:
        stale = sorted(p.name for p in HERE.glob("_ops_*.so"))
        _STATE["why"] = (f"no {best} build of the current sources in {HERE}"
                         + (f" (only builds of other sources or variants: {', '.join(stale)})" if stale else "")
                         + f"; {REBUILD} (ATTNLAB_BUILD_ISA={best} for this variant)")
        return False
    if level != best:
        warnings.warn(f"attnlab: this CPU runs the {best} kernels but only {level} is built; {REBUILD}",
                      stacklevel=3)
    try:
        torch.ops.load_library(str(have[level]))
    except OSError as e:  # a library that does not load (another torch, a truncated file) is not a silent fallback
        _STATE["why"] = f"{have[level].name} does not load ({str(e)[:200]}); {REBUILD}"
        return False
    _register_fakes()
    _STATE.update(isa=level, path=have[level])
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
    for name in ("f32_rows_mv", "q8_rows_mv", "q4_rows_mv"):
        torch.library.register_fake(f"attnlab::{name}")(fake_mv)
    for name in ("f32_rows_axpy", "q8_rows_axpy", "q4_rows_axpy"):
        torch.library.register_fake(f"attnlab::{name}")(fake_axpy)
    torch.library.register_fake("attnlab::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    torch.library.register_fake("attnlab::silu_mul")(lambda h: h.new_empty(*h.shape[:-1], h.shape[-1] // 2))
    torch.library.register_fake("attnlab::causal_attention")(lambda q, k, v, scale: torch.empty_like(q))
    torch.library.register_fake("attnlab::decode_attention")(lambda q, k, v, scale, *scales: torch.empty_like(q))
    torch.library.register_fake("attnlab::quantize_kv")(
        lambda x: (torch.empty_like(x, dtype=torch.int8), x.new_empty(*x.shape[:-1], x.shape[-1] // 32)))
