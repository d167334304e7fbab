"""The kernels are built by the install and only loaded at run time: nothing compiles at import, a build of
other sources is never loaded, and where the kernels are missing the fallback is loud (an error under
ATTNLAB_REQUIRE_KERNELS, which CI sets)."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab.kernels import build, isa, ops

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")


def _python(code: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("ATTNLAB_NO_KERNELS", "ATTNLAB_REQUIRE_KERNELS")}
    env = {**base, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1", **env}  # CI's ATTNLAB_REQUIRE_KERNELS only if asked
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_an_import_compiles_nothing_and_loads_the_installed_build():
    lib = build.library()
    before = lib.stat().st_mtime
    code = ("import sys, time; t = time.perf_counter(); import attnlab; from attnlab.kernels import build, ops; "
            "assert ops.load(); import torch; torch.classes.attnlab.DecodeStep(64, 4, 2, 16, 96, 1e-5, 1); "
            "assert 'torch.utils.cpp_extension' not in sys.modules, 'the compiler module was imported'; "
            "print(build.library(), time.perf_counter() - t)")
    out = _python(code, ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    path, seconds = out.stdout.split()
    assert Path(path) == lib and lib.stat().st_mtime == before
    assert float(seconds) < 60  # import + load: a few seconds on a quiet machine


def test_the_library_is_named_after_its_sources(tmp_path):
    """A copy of the package whose sources differ by one comment finds no build of its own: it says so, warns,
    falls back; with ATTNLAB_REQUIRE_KERNELS=1 the same process fails instead."""
    shutil.copytree(ROOT / "attnlab", tmp_path / "attnlab", ignore=shutil.ignore_patterns("__pycache__"))
    step = tmp_path / "attnlab" / "kernels" / "step.cpp"
    step.write_text(step.read_text() + "\n// changed\n")
    code = ("import warnings; warnings.simplefilter('always'); from attnlab.kernels import build, isa; import torch; "
            "print(build.load(), isa.library_name('avx2', torch.__version__)); print(build.why())")
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    ok, name = out.stdout.splitlines()[0].split()
    assert ok == "False" and name != isa.library_name("avx2", torch.__version__)
    assert "of the current sources" in out.stdout and build.library().name in out.stdout  # names what it found
    assert "C++ kernels unavailable" in out.stderr  # the fallback is not silent
    out = _python(code, tmp_path, ATTNLAB_REQUIRE_KERNELS="1")
    assert out.returncode != 0 and "ATTNLAB_REQUIRE_KERNELS" in out.stderr


def test_the_build_choice():
    best = isa.supported()[-1]
    assert isa.to_build("auto") == sorted({"avx2", best}, key=list(isa.LEVELS).index)
    assert isa.to_build("none") == [] and isa.to_build("every") == list(isa.LEVELS)
    assert isa.to_build("all") == isa.supported() and isa.to_build("avx2, amx") == ["avx2", "amx"]
    with pytest.raises(ValueError, match="sse"):
        isa.to_build("sse")
    assert set(isa.to_build("auto")) <= set(build.built())  # what an install built by default is there


def test_only_the_binding_file_includes_torch():
    """Setup time: each source that includes torch's headers spends ~30 s of a 2-core machine per ISA variant parsing
    them, so the kernels are plain C++ and one file, bind.cpp, turns tensors into their Views (ops.h)."""
    kernels = ROOT / "attnlab" / "kernels"
    sources = set(isa.SOURCES) | set(isa.HEADERS)
    assert sources == {p.name for p in kernels.glob("*.cpp")} | {p.name for p in kernels.glob("*.h")}
    torch_users = {name for name in sources
                   if any(line.strip().startswith("#include") and any(t in line for t in ("<torch/", "<ATen/", "<c10/"))
                          for line in (kernels / name).read_text().splitlines())}
    assert torch_users == {"bind.cpp"}
