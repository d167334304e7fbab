"""Result files and progress bars shared by the library and the command line.

Results that matter are written atomically (temp file + rename), so a crash or Ctrl-C
never leaves half a file where a finished result is expected; they are created 0644
(mkstemp's 0600 would hide them from the other users of a shared machine).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm


def write_atomic(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call write(tmp_path) on a temporary file beside path, then rename it onto path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_json(path: str | os.PathLike, data) -> Path:
    """JSON with indent 2 and a trailing newline, written atomically."""
    return write_text(path, json.dumps(data, indent=2) + "\n")


def provenance(argv: list[str] | None) -> dict:
    """The command line, git commit and work-tree state a result was produced with (results name all three).

    ``dirty`` is True when tracked files of the attnlab package differ from the commit, so the
    commit alone does not reproduce the result (docs being edited do not count); ``commit`` is
    "unknown" outside a git checkout. Call it when the run starts.
    """
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True, timeout=30).stdout.strip()
    try:
        commit, dirty = git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no", "--", "."))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", None
    return {"command": "attnlab " + shlex.join(argv or []), "commit": commit, "dirty": dirty}


def run_record(argv: list[str] | None, seed, command: str | None = None) -> dict:
    """`provenance` plus the seed and the start time, taken when a run starts (not when it is published).

    ``command`` replaces the ``attnlab ...`` command line for scripts run another way
    (``python -m ...``); pass the result to `finish_record` when the run ends.
    """
    record = provenance(argv)
    if command is not None:
        record["command"] = command
    return {**record, "seed": seed, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "started_unix": math.floor(time.time() * 1000) / 1000}  # floored: never after the moment it was taken


def finish_record(record: dict) -> dict:
    """``record`` with the run's wall time (``wall_s``, from its start to now)."""
    return {**record, "wall_s": round(time.time() - record["started_unix"], 2)}


def write_tensors(path: str | os.PathLike, tensors: dict, fmt: str, config: dict) -> Path:
    """A safetensors file whose metadata names its format and the config that rebuilds its owner, atomically."""
    from safetensors.torch import save_file
    meta = {"format": fmt, "config": json.dumps(config)}
    return write_atomic(path, lambda tmp: save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
                                                    metadata=meta))


def read_tensors(path: str | os.PathLike, fmt: str, what: str) -> tuple[dict, dict]:
    """(tensors, config) of a `write_tensors` file; AttnlabError naming `what` if it holds another format."""
    from safetensors.torch import load_file, safe_open

    from attnlab.errors import AttnlabError
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != fmt:
        raise AttnlabError(f"{path} is not an attnlab {what} (format {meta.get('format')!r})")
    return load_file(str(path)), json.loads(meta["config"])


def _interactive() -> bool:
    return sys.stderr.isatty() or bool(os.environ.get("ATTNLAB_PROGRESS"))


def progress(total: int, desc: str, unit: str = "tok"):
    """A tqdm bar on stderr that stays quiet when stderr is not a terminal and ATTNLAB_PROGRESS is unset."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not _interactive(), leave=False, dynamic_ncols=True)


@contextmanager
def status(message: str):
    """`message ...` on stderr while a slow step (a model load) runs, then its seconds; shown where bars are."""
    show, start = _interactive(), time.perf_counter()
    if show:
        print(f"{message} ...", end="", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        if show:
            print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def save_figure(fig, path: str | os.PathLike, dpi: int = 110, **kw) -> str:
    """Lay out, write (making the folder) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi, **kw)
    plt.close(fig)
    return str(path)


def keyed_name(readable: str, ident: dict) -> str:
    """A result file's stem: a readable part and a hash of everything its numbers depend on (`ident`), so a
    rerun finds its own finished results and never mistakes another run's for them."""
    import hashlib
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{readable}-{digest}"
