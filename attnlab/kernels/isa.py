"""Which instruction sets this CPU (and its OS) runs, and which kernel variant to build for it.

Why: one extension built for the best ISA the machine has (AVX-512 VNNI's `vpdpbusd` multiplies 64
int8 pairs per instruction, four times AVX2's maddubs+madd), AVX2 + FMA + F16C the portable floor.
The flags come from /proc/cpuinfo, which Linux fills only with what the kernel enabled in XCR0, so
AVX-512 is listed only where the OS saves its registers. AMX needs one more step: the OS grants its
tile data per process (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), so the `amx` variant (avx512vnni plus tile
multiplies for inputs of 16 rows and more: prefill) counts as supported only where that grant succeeds.
`ATTNLAB_ISA=avx2|avxvnni|avx512|avx512vnni|amx` forces a variant (an error if the CPU lacks it).

This module is also what `setup.py` reads to build the variants when the package is installed, before
attnlab is importable: it imports the standard library only (the error class is imported where raised).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
from pathlib import Path

# the C++ sources of every variant: the torch binding (the only one including torch's headers); quantized matmuls; attention over the KV cache; matvecs over 16-row repacked
# weights, the embedding gather from them and the repacking at load; the native decode step; TEAL's column ops;
# a forward pass's elementwise glue; a prompt's causal attention; Quest's pages
SOURCES = ("bind.cpp", "kernels.cpp", "attend.cpp", "repacked.cpp", "repacked_rows.cpp", "repack_load.cpp",
           "step.cpp", "sparse_cols.cpp", "glue.cpp", "causal.cpp", "quest.cpp")
HEADERS = ("ops.h", "step.h", "kernels_simd.h", "attend.h", "quest.h", "repacked_layout.h", "repacked_isa.h",
           "repacked_amx.h", "repacked_blocks.h")
FLAGS = ("-O3", "-fopenmp")  # + the variant's ISA flags (LEVELS); OpenMP: the parallel loops (ops.h) and the step's team
LDFLAGS = ("-fopenmp",)
# variant -> (cpuinfo flags it needs, compiler flags), best last
LEVELS = {
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "avxvnni": (("avx2", "fma", "f16c", "avx_vnni"), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni")),
    "avx512": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
               ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")),
    "avx512vnni": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
                   ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni")),
    "amx": (("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "amx_tile",
             "amx_int8", "amx_bf16"), ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                                       "-mavx512dq", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-mamx-bf16")),
}
_CACHE: dict = {}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere: no kernels then)."""
    if "flags" not in _CACHE:
        flags: set[str] = set()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
        except OSError:
            pass
        _CACHE["flags"] = frozenset(flags)
    return _CACHE["flags"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def amx_granted() -> bool:
    """True if the CPU has AMX and the OS grants this process its tile data (Linux >= 5.16)."""
    if "amx" not in _CACHE:
        ok = False
        if {"amx_tile", "amx_int8"} <= cpu_flags() and platform.machine() == "x86_64":
            try:  # syscall(SYS_arch_prctl = 158, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18)
                ok = ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
            except (OSError, AttributeError):
                ok = False
        _CACHE["amx"] = ok
    return _CACHE["amx"]


def supported() -> list[str]:
    """The variants this machine runs, best last."""
    have = cpu_flags()
    return [name for name, (need, _) in LEVELS.items() if set(need) <= have and (name != "amx" or amx_granted())]


def best() -> str | None:
    """The variant to build: ATTNLAB_ISA if set (checked), else the best supported; None below AVX2."""
    from attnlab.errors import AttnlabError
    forced = os.environ.get("ATTNLAB_ISA", "").strip().lower()
    ok = supported()
    if forced:
        if forced not in LEVELS:
            raise AttnlabError(f"ATTNLAB_ISA={forced!r} is not one of {', '.join(LEVELS)}")
        if forced not in ok:
            missing = sorted(set(LEVELS[forced][0]) - cpu_flags())
            if not missing:  # amx: in the CPU, refused by the OS
                raise AttnlabError(f"ATTNLAB_ISA={forced}: the OS does not grant this process AMX tiles")
            raise AttnlabError(f"ATTNLAB_ISA={forced}: this CPU lacks {' '.join(missing)}")
        return forced
    return ok[-1] if ok else None


# the ISA flags benchmark headers print (what the kernels and llama.cpp's builds can use)
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
               "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def shown_flags() -> list[str]:
    """The SHOWN_FLAGS this CPU has."""
    return [f for f in SHOWN_FLAGS if f in cpu_flags()]


def describe() -> str:
    """One line for benchmark headers: CPU model, the ISA flags that matter, AMX grant."""
    flags = " ".join(shown_flags())
    amx = "granted" if amx_granted() else "not granted" if "amx_tile" in cpu_flags() else "absent"
    return f"{cpu_model()}; {flags}; AMX {amx}"


def sources_hash(torch_version: str) -> str:
    """Eight hex digits naming what a build is made of (sources, headers, flags, torch): a library built from
    other sources has another name, so a stale build is never loaded (`build.load` says so instead)."""
    h = hashlib.sha1(torch_version.encode())
    here = Path(__file__).resolve().parent
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    h.update(repr((FLAGS, LDFLAGS, LEVELS)).encode())
    return h.hexdigest()[:8]


def library_name(level: str, torch_version: str) -> str:
    """The extension's module name inside attnlab.kernels (`_ops_<variant>_<sources_hash>`)."""
    return f"_ops_{level}_{sources_hash(torch_version)}"


def to_build(choice: str | None = None) -> list[str]:
    """The variants an install builds: ATTNLAB_BUILD_ISA = 'auto' (default: the avx2 floor and the best this CPU
    runs, the two the tests check), 'all' (every variant this CPU runs), 'every' (all five, for a wheel another
    CPU will use: compiling needs no such CPU), 'none', or a comma list. Empty below AVX2."""
    choice = (choice if choice is not None else os.environ.get("ATTNLAB_BUILD_ISA", "auto")).strip().lower() or "auto"
    ok = supported()
    if choice == "none":
        return []
    if choice == "auto":
        return sorted({"avx2", ok[-1]}, key=list(LEVELS).index) if ok else []
    if choice == "all":
        return ok
    if choice == "every":
        return list(LEVELS)
    names = [n.strip() for n in choice.split(",") if n.strip()]
    bad = [n for n in names if n not in LEVELS]
    if bad:
        raise ValueError(f"ATTNLAB_BUILD_ISA: {', '.join(bad)} not among auto, all, every, none, {', '.join(LEVELS)}")
    return names
