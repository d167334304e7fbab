"""The description of one runnable theory-lab experiment (``attnlab dynamics <name>``).

Kept apart from ``registry`` so that experiment modules can describe themselves without
importing the registry, which imports them: the dependency runs one way only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Experiment:
    name: str
    help: str
    run: Callable  # (out: Path, seed: int, size: str, progress: bool, **options) -> dict
    summary: Callable[[dict], list[str]] | None = None  # metrics -> printable lines
    # extra CLI flags: (name, type, default, help); passed to run as keyword arguments
    options: tuple = ()
