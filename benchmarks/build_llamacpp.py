"""Build llama.cpp (the speed and quality peer) two ways so that it runs on this machine: `make bench-llamacpp`.

Source: the llama-cpp-python source package on PyPI (its vendor/llama.cpp). CMake + Ninja, static
binaries llama-bench, llama-perplexity, llama-quantize, llama-simple, llama-tokenize and llama-server (the
batching peer of `attnlab serve`), built once per configuration in
~/.cache/attnlab/llamacpp and copied to `<prefix>/{native,generic}/bin` with a build.json (CMake flags,
whether batches above one token need `-ub 1`: see llamacpp.plan_builds and the AMX probe).

    python benchmarks/build_llamacpp.py                       # into build/llamacpp of this checkout
    python benchmarks/build_llamacpp.py --prefix /work/main/build/llamacpp --only native
    python benchmarks/build_llamacpp.py --only native --targets llama-bench,llama-quantize,llama-simple  # the speed peer
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402

CACHE = Path(os.environ.get("ATTNLAB_LLAMACPP_CACHE", Path.home() / ".cache" / "attnlab" / "llamacpp"))
TARGETS = ["llama-bench", "llama-perplexity", "llama-quantize", "llama-simple", "llama-tokenize", "llama-server"]
COMMON = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
          "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF"]


def source(version: str | None) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded with pip once and unpacked in the cache."""
    src = CACHE / "src"
    src.mkdir(parents=True, exist_ok=True)
    sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    if version:
        sdists = [s for s in sdists if s.name == f"llama_cpp_python-{version}.tar.gz"]
    if not sdists:
        spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python", spec,
                        "-d", str(src)], check=True)
        sdists = sorted(src.glob("llama_cpp_python-*.tar.gz"))
    sdist = sdists[-1]
    top = sdist.name[:-len(".tar.gz")]
    tree = src / top / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{top}/vendor/llama.cpp/")]
            tar.extractall(src, members=members, filter="data")
    return tree


def build(tree: Path, name: str, spec: dict, jobs: int, targets: list[str] = TARGETS) -> Path:
    """Configure and build one variant; returns a folder holding its binaries (cached by source and flags).
    Every variant reuses one build folder per source: reconfiguring changes the ISA flags, so the second
    variant reruns 77 of the 144 build steps (measured: common's objects are kept), not all of them."""
    key = hashlib.sha256(json.dumps([str(tree), COMMON, spec["cmake"], targets]).encode()).hexdigest()[:10]
    done = CACHE / "bins" / f"{name}-{key}"
    if all((done / t).exists() for t in targets):
        print(f"{name}: cached build {done}")
        return done
    out = CACHE / "build" / hashlib.sha256(str(tree).encode()).hexdigest()[:10]
    t = time.time()
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), *COMMON, *spec["cmake"]], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["nice", "-n", "10", "cmake", "--build", str(out), "-j", str(jobs), "--target", *targets],
                   check=True)
    tmp = done.with_name(done.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for target in targets:
        shutil.copy2(out / "bin" / target, tmp / target)
    shutil.rmtree(done, ignore_errors=True)
    tmp.rename(done)
    print(f"{name}: built in {time.time() - t:.0f} s ({' '.join(spec['cmake'])})")
    return done


def install(bins: Path, dest: Path, meta: dict, targets: list[str] = TARGETS) -> None:
    """Copy the binaries into dest/bin (a temporary folder renamed into place) and write build.json."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "bin").mkdir(parents=True)
    for t in targets:
        shutil.copy2(bins / t, tmp / "bin" / t)
    (tmp / "build.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def smoke(bin_dir: Path) -> str:
    """The binary starts on this CPU (no SIGILL at start-up): its --version line."""
    r = subprocess.run([str(bin_dir / "llama-bench"), "--help"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"{bin_dir}/llama-bench does not run here (exit {r.returncode})")
    return "ok"


def batch_dies(bin_dir: Path) -> bool:
    """The AMX probe that counts: a 32-token batch through the embedded model dies (a tile instruction the OS or
    the compiled code gets wrong), while -ub 1 runs. False where the embedded model is not installed."""
    try:
        from attnlab.model.files import resolve
        model = resolve("smollm2-135m")
    except Exception:  # noqa: BLE001 - the probe is optional
        return False
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", "1", "-p", "32", "-n", "0", "-r", "1"]
    if subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0:
        return False
    return subprocess.run(cmd + ["-ub", "1"], capture_output=True, timeout=300).returncode == 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix", type=Path, default=llamacpp.BUILD_ROOT, help="install root (default build/llamacpp)")
    p.add_argument("--only", choices=["native", "generic"], help="one build only")
    p.add_argument("--version", help="llama-cpp-python version (default: the newest cached/downloaded)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--targets", default=",".join(TARGETS), help="binaries to build (llama-bench among them)")
    args = p.parse_args(argv)
    print(llamacpp.header())
    tree = source(args.version)
    flags, granted = llamacpp.cpu_flags(), llamacpp.amx_granted()
    plans = llamacpp.plan_builds(flags, granted)
    for name, spec in plans.items():
        if args.only and name != args.only:
            continue
        targets = args.targets.split(",")
        if "llama-bench" not in targets:
            p.error("--targets must include llama-bench (the smoke test and the AMX probe run it)")
        bins = build(tree, name, spec, args.jobs, targets)
        meta = {"name": name, "source": str(tree), "version": tree.parent.parent.name, "cmake": spec["cmake"],
                "ub1": spec["ub1"], "note": spec["note"], "cpu": llamacpp.cpu_model()}
        install(bins, args.prefix / name, meta, targets)
        smoke(args.prefix / name / "bin")
        if not spec["ub1"] and batch_dies(args.prefix / name / "bin"):
            meta.update(ub1=True, note=spec["note"] + "; a 32-token batch dies, one token at a time runs: -ub 1")
            (args.prefix / name / "build.json").write_text(json.dumps(meta, indent=1) + "\n")
        print(f"{name}: {args.prefix / name / 'bin'} ({meta['note']}{'; run with -ub 1' if meta['ub1'] else ''})")


if __name__ == "__main__":
    main()
