"""Independent cells: keyed, run by a backend, each result written atomically by the driver.

A cell is one call `fn(**params)` whose result depends only on (fn, params). Its key is a
hash of both (plus whatever `ident` the caller adds: file identities, versions), so a rerun
finds a finished cell by name and skips it, and a changed input gets a new key instead of a
stale result. The backend only computes; the driver writes each result the moment it comes
back (`CellStore.save`, temp file + rename). Why the driver: tasks on other nodes need no
shared filesystem, a task killed halfway has written nothing, and a driver killed halfway
has lost only the cells in flight (docs/scale.md).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.io import progress, write_json

FORMAT = "attnlab-cell-1"


def canonical(obj) -> str:
    """Stable JSON of a cell's identity (sorted keys, tuples as lists, odd objects as str)."""
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def cell_key(fn: str, params: dict, ident: dict | None = None, readable: str = "") -> str:
    """`readable-<16 hex>`: the hash covers the function, every parameter and the extra identity."""
    digest = hashlib.sha256(canonical({"fn": fn, "params": params, "ident": ident or {}}).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in readable).strip("_")[:80]
    return f"{slug}-{digest}" if slug else digest


@dataclass
class Cell:
    """One task: fn is `module:function` (importable on every worker), params its keyword arguments."""
    fn: str
    params: dict
    ident: dict = field(default_factory=dict)
    readable: str = ""
    keyed: dict | None = None  # what the key covers instead of params (leaving out e.g. thread counts)
    func: Callable | None = field(default=None, compare=False, repr=False)  # local backend: call this, not fn

    @property
    def key(self) -> str:
        return cell_key(self.fn, self.params if self.keyed is None else self.keyed, self.ident, self.readable)

    def identity(self) -> dict:
        params = self.params if self.keyed is None else self.keyed
        return json.loads(canonical({"fn": self.fn, "params": params, "ident": self.ident}))


def resolve(fn: str) -> Callable:
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def execute(fn: str, params: dict, func: Callable | None = None) -> dict:
    """What a worker runs: the call, timed; -> {result, seconds, host, pid}. torch's threads are the process's: the
    command line's for the local backend, the task's environment (OMP_NUM_THREADS) for Ray's."""
    t0 = time.perf_counter()
    result = (func or resolve(fn))(**params)
    return {"result": result, "seconds": round(time.perf_counter() - t0, 4), "host": socket.gethostname(),
            "pid": os.getpid()}


class CellStore:
    """`<dir>/<key>.json` = {format, key, identity, result, seconds, host}; one file per finished cell."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, cell: Cell) -> Path:
        return self.root / f"{cell.key}.json"

    def load(self, cell: Cell) -> dict | None:
        """The stored record if it is this cell's (same identity), else None (absent, unreadable, stale)."""
        path = self.path(cell)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if record.get("identity") == cell.identity() and record.get("format") == FORMAT else None

    def save(self, cell: Cell, payload: dict) -> dict:
        record = {"format": FORMAT, "key": cell.key, "identity": cell.identity(), **payload}
        write_json(self.path(cell), record)
        return record


@dataclass
class Report:
    """What a run_cells call did: records in cell order, and how many were computed vs found."""
    records: list[dict]
    computed: int
    skipped: int
    seconds: float


def run_cells(cells: Iterable[Cell], store, backend=None, desc: str = "cells", threads: int = 1) -> Report:
    """Compute every cell not already in `store` on `backend` (default: serial, in this process).

    store: a CellStore, or any object with load(cell) -> record | None and save(cell, payload)
    -> record (stream keeps its own file layout this way).
    Results are saved as they arrive, in completion order; the bar counts cells (finished ones
    included). A cell that fails raises after the others in flight are saved."""
    from attnlab.scale.backends import LocalBackend
    cells = list(cells)
    backend = backend or LocalBackend()
    t0 = time.perf_counter()
    records: dict[str, dict] = {}
    todo = []
    for cell in cells:
        found = store.load(cell)
        if found is not None:
            records[cell.key] = found
        elif cell.key not in {c.key for c in todo}:
            todo.append(cell)
    skipped = len({c.key for c in cells}) - len(todo)
    with progress(len({c.key for c in cells}), desc, unit="cell") as bar:
        bar.update(skipped)
        for cell, payload in backend.run(todo, threads=threads):
            records[cell.key] = store.save(cell, payload)
            bar.update(1)
    return Report([records[c.key] for c in cells], computed=len(todo), skipped=skipped,
                  seconds=time.perf_counter() - t0)
