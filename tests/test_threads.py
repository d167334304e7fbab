"""Threads are the engine's attribute, set once; torch's global count is set in one place, the command line's edge."""
from __future__ import annotations

import re
from pathlib import Path

import attnlab

ROOT = Path(attnlab.__file__).parent


def test_one_set_num_threads_call_site_in_the_library():
    sites = [(p.relative_to(ROOT).as_posix(), n) for p in sorted(ROOT.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bset_num_threads\b", line)]
    assert [path for path, _ in sites] == ["cli/__init__.py"], sites
