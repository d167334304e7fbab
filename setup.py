"""Builds attnlab's C++ kernels when the package is installed (`pip install .`, `pip install -e .`, a wheel).

Everything else about the package is in pyproject.toml. The kernels are one torch extension per ISA variant
(`attnlab/kernels/isa.py`: the same sources, the variant's -m flags); which variants are built is
ATTNLAB_BUILD_ISA (default 'auto': the avx2 floor and the best this CPU runs). Each library is named after
a hash of its sources, so a process never loads a build of other sources, and nothing compiles at import.
A compiler error fails the install; ATTNLAB_BUILD_ISA=none installs without kernels (every op then takes its
pure-torch fallback and `attnlab info` says so).
"""
import runpy
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "attnlab" / "kernels"
isa = runpy.run_path(str(KERNELS / "isa.py"))  # standard library only: attnlab itself is not importable yet


class BuildKernels(BuildExtension):
    """torch's BuildExtension (ninja when present, in parallel), keeping the build folder between installs so an
    unchanged source is not compiled again, and removing libraries of older sources from an in-place tree."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = str(HERE / "build" / "kernels")  # not pip's temporary folder: ninja's record survives

    def build_extension(self, ext):
        """Each variant's objects in a folder of its own (build/kernels/_ops_<variant>): the variants compile
        the same file names, and in one folder each overwrote the other's, so every build compiled them all."""
        self.build_temp = str(HERE / "build" / "kernels" / ext.name.rsplit(".", 1)[1].rsplit("_", 1)[0])
        super().build_extension(ext)

    def run(self):
        super().run()
        if self.inplace or getattr(self, "editable_mode", False):
            keep = {isa["library_name"](level, torch.__version__) for level in isa["to_build"]()}
            for old in KERNELS.glob("_ops_*.so"):
                if old.name.split(".")[0] not in keep:
                    old.unlink()


def extensions():
    out = []
    for level in isa["to_build"]():
        flags = list(isa["FLAGS"]) + list(isa["LEVELS"][level][1])
        out.append(CppExtension(
            f"attnlab.kernels.{isa['library_name'](level, torch.__version__)}",
            [f"attnlab/kernels/{name}" for name in isa["SOURCES"]],
            extra_compile_args=flags, extra_link_args=list(isa["LDFLAGS"]),
            depends=[f"attnlab/kernels/{name}" for name in isa["HEADERS"]]))
    return out


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildKernels.with_options(use_ninja=True)})
