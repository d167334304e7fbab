"""Keep the server's RSS near what it counts: glibc's allocator told to give freed memory back.

Why: measured under load (issue 61; SmolLM2, Quest, 8 concurrent conversations), RSS stood 389 MiB above
the model plus the cache bytes the sessions counted, and `malloc_trim(0)` brought it to 37 MiB above:
part of it freed and kept by glibc (caches of evicted conversations, prefill activations), whose threshold
for serving large blocks from mmap rises to 32 MiB after the first such block is freed, after which big
buffers come from the heaps and their pages stay (the rest was live: `SessionStore.free`). So the server
fixes the mmap threshold (blocks of `MMAP_BYTES` and more, a layer's key or value buffer among them, are
always mapped, and unmapped when freed),
keeps two arenas (each thread otherwise may get its own heap), and trims the heaps after requests end (at
most once per `every` seconds, on a worker thread, never the event loop's). Elsewhere than glibc this is
a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger("attnlab.serve")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt parameters (malloc.h)
MMAP_BYTES = 256 << 10
_libc, _configured = None, False


def libc():
    """glibc, or None (another C library: nothing to tune)."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _libc = False
    return _libc or None


def configure() -> bool:
    """Fix the mmap threshold at MMAP_BYTES and allow two arenas (once per process); True where it applied."""
    global _configured
    lib = libc()
    if lib is None:
        return False
    if not _configured:
        _configured = bool(lib.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) and lib.mallopt(M_ARENA_MAX, 2)
                           and lib.mallopt(M_TRIM_THRESHOLD, 4 * MMAP_BYTES))
    return _configured


class Trimmer:
    """`soon()` when memory may have been freed (a request ended): a thread of its own trims the heaps at most
    once per `every` seconds, and once more after the last call (what a finished request frees, its reply
    and cache once unreferenced, is freed a little after it ends).

    `stats()` (admin /health) is read from what that thread last measured: the allocator's view is taken
    there, after each trim, never on the event loop: `mallinfo2` walks every free chunk of every arena,
    measured 2-57 ms on a server under load, so asking it per /health held every other reply that long."""

    def __init__(self, every: float = 1.0):
        self.every, self.lib = every, libc()
        self.dirty, self.thread, self.trims = threading.Event(), None, 0
        self.heap, self.slowest = {}, 0.0  # heap() after the last trim; the longest trim (seconds)

    def soon(self) -> None:
        if self.lib is None:
            return
        self.dirty.set()
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="attnlab-trim", daemon=True)
            self.thread.start()

    def run(self) -> None:
        while True:
            self.dirty.wait()
            time.sleep(self.every)  # let this burst of frees happen; then one trim covers them
            self.dirty.clear()
            start = time.perf_counter()
            self.lib.malloc_trim(0)
            self.slowest = max(self.slowest, time.perf_counter() - start)
            self.heap = heap()
            self.trims += 1  # after the heap's reading: a reader that sees this trim sees its reading

    def stats(self) -> dict:
        """Trims so far, the longest one's milliseconds, and the heap's used and free MiB as of the last one."""
        return {"trims": self.trims, "trim_ms_max": round(1e3 * self.slowest, 1), **self.heap}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def heap() -> dict:
    """The allocator's view (glibc >= 2.33, else {}): MiB in use (heaps and mapped blocks) and free in the heaps
    (free pages given back by a trim still count as free here, not in RSS)."""
    lib = libc()
    if lib is None or not hasattr(lib, "mallinfo2"):
        return {}
    lib.mallinfo2.restype = _MallInfo2
    m, mib = lib.mallinfo2(), 1 << 20
    return {"used_mib": round((m.uordblks + m.hblkhd) / mib, 1), "free_mib": round(m.fordblks / mib, 1)}
