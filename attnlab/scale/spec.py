"""A sweep spec: which `attnlab` command, the axes of the grid and the fixed options.

TOML (or YAML):
    command = "stream"                      # the words after `attnlab`
    [fixed]                                 # options every cell gets
    tokens = 256
    [axes]                                  # the grid: every combination is one cell
    policy = ["window", "sink", "h2o", "sink_h2o"]
    budget = [32, 64, 128]
    [plot]                                  # optional: the figure's axes
    x = "budget"
    y = "ppl"
    hue = "policy"
Option names are the command's long options without `--` (`n-sink` or `n_sink`); `true`
passes a flag, `false` leaves it out; a value "A" of key "_" is a positional argument.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.errors import AttnlabError

# options that never change a cell's numbers: left out of its key (threads: results are
# bitwise reproducible at a fixed thread count, and a sweep fixes it for every cell)
NOT_IN_KEY = {"threads", "out", "json", "no-progress", "plot", "sweep-plot", "force", "save-every", "debug"}


@dataclass
class Spec:
    command: list[str]
    axes: dict[str, list] = field(default_factory=dict)
    fixed: dict[str, object] = field(default_factory=dict)
    plot: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.command, str):
            self.command = self.command.split()
        if not self.command:
            raise AttnlabError("sweep spec: no command (e.g. command = \"stream\")")
        self.axes = {_name(k): _as_list(k, v) for k, v in self.axes.items()}
        self.fixed = {_name(k): v for k, v in self.fixed.items()}
        both = set(self.axes) & set(self.fixed)
        if both:
            raise AttnlabError(f"sweep spec: {', '.join(sorted(both))} both an axis and fixed")

    def grid(self) -> list[dict]:
        """Every combination of the axes, in axis order (the first axis varies slowest)."""
        names = list(self.axes)
        return [dict(zip(names, values)) for values in itertools.product(*self.axes.values())] or [{}]

    def argv(self, params: dict) -> list[str]:
        """The command line of one cell (fixed options first, then its axis values)."""
        argv, positional = list(self.command), []
        for name, value in {**self.fixed, **params}.items():
            if name == "_":
                positional += [str(v) for v in (value if isinstance(value, list) else [value])]
            elif value is True:
                argv.append(f"--{name}")
            elif value is False or value is None:
                continue
            else:
                argv += [f"--{name}", _text(value)]
        return argv + positional


def _name(key: str) -> str:
    return str(key).strip().lstrip("-").replace("_", "-") if key != "_" else "_"


def _text(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_text(v) for v in value)
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _as_list(key, value) -> list:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise AttnlabError(f"sweep spec: axis {key!r} is empty")
    return values


def _scalar(text: str):
    """Command-line values: ints and floats as numbers, true/false as flags, the rest as text."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_assignments(items: list[str], what: str, split: bool) -> dict:
    """['budget=32,64', ...] -> {'budget': [32, 64]} (axes: split on commas) or {'tokens': 256}."""
    out = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise AttnlabError(f"{what} wants NAME=VALUE, got {item!r}")
        out[_name(name)] = [_scalar(v) for v in value.split(",") if v.strip()] if split else _scalar(value)
        if split and not out[_name(name)]:
            raise AttnlabError(f"{what} {item!r} has no values")
    return out


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise AttnlabError(f"cannot read sweep spec {path}: {e.strerror or e}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            import tomllib
            data = tomllib.loads(text)
    except Exception as e:  # noqa: BLE001  (any parser's error is the user's file)
        raise AttnlabError(f"sweep spec {path} does not parse: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise AttnlabError(f"sweep spec {path} is not a table")
    unknown = set(data) - {"command", "axes", "fixed", "plot"}
    if unknown:
        raise AttnlabError(f"sweep spec {path}: unknown keys {', '.join(sorted(unknown))} "
                           "(expected command, axes, fixed, plot)")
    return Spec(data.get("command") or [], dict(data.get("axes") or {}), dict(data.get("fixed") or {}),
                dict(data.get("plot") or {}))
