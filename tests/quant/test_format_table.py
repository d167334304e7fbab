"""The table of weight formats is the one place that knows a format by name: no code outside
attnlab/quant/kinds.py compares a weight format's name (==, !=, in a literal tuple/set/list, match/case,
startswith/endswith, a dict literal indexed as a switch). Read with `ast`, so strings in docstrings,
messages and data do not count, only comparisons."""
import ast
from pathlib import Path

import pytest

import attnlab
from attnlab.quant import kinds

LIBRARY = Path(attnlab.__file__).resolve().parent
TABLE = LIBRARY / "quant" / "kinds.py"
# the table's vocabulary (formats, GGUF block types, any case) and the row/column ops' former one
QUANT_TYPES = {n.lower() for n, t in kinds.GGUF.items() if t.decode is not None}
FLOAT_TYPES = {n for n, t in kinds.GGUF.items() if t.dtype is not None}  # as GGUF spells them ("bf16" is a dtype)
FORMER = {"f32", "q8", "q4", "q4g"}


def is_format_name(value) -> bool:
    return isinstance(value, str) and (value in kinds.KINDS or value.lower() in QUANT_TYPES or value in FLOAT_TYPES
                                       or value in FORMER)


def _names(node) -> list[str]:
    """Format names a comparison's operand holds: a string, or a literal tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return [node.value] if is_format_name(node.value) else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [n for e in node.elts for n in _names(e)]
    return []


def format_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) for every comparison with a weight format's name in source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                found += [(node.lineno, n) for n in _names(operand)]
        elif isinstance(node, ast.match_case):
            found += [(node.pattern.lineno, n) for p in ast.walk(node.pattern) if isinstance(p, ast.MatchValue)
                      for n in _names(p.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith", "removeprefix", "removesuffix")):
            found += [(node.lineno, n) for a in node.args for n in _names(a)]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):  # {"int8": ..., ...}[kind]
            found += [(node.lineno, n) for k in node.value.keys if k is not None for n in _names(k)]
    return found


def test_no_format_name_is_compared_outside_the_table():
    hits = [f"{path.relative_to(LIBRARY.parent)}:{line}: {name!r}"
            for path in sorted(LIBRARY.rglob("*.py")) if path != TABLE
            for line, name in format_comparisons(path.read_text())]
    assert not hits, "weight formats compared by name outside attnlab/quant/kinds.py:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    'if p.kind == "int4": pass', 'ok = "kmeans" != kind', 'x = kind in ("int8", "int4")', 'x = k not in {"Q4_0"}',
    'x = name in ["q6_k"]', 'x = args.method.startswith("kmeans")', 'x = {"int8": 1, "int4": 2}[kind]',
    'x = kind == "q4g"', 'x = t == "F16"', 'match kind:\n    case "Q8_0":\n        pass'])
def test_the_scan_finds_each_way_of_comparing(line):
    assert format_comparisons(line), line


@pytest.mark.parametrize("line", [
    'x = KINDS[p.kind].bits', '"""int8 and int4 codes"""', 'raise ValueError("not int4")', 'x = spec in ("fp32", "bf16")',
    'x = {"int8": 1}', 'x = kind in KINDS', 'f(kind="int4")'])
def test_the_scan_leaves_data_and_messages_alone(line):
    assert not format_comparisons(line), line


def test_every_format_has_its_functions():
    """Each entry answers for itself: a format round-trips through its own quantizer, dequantizer, spec text and
    stored tensors; a repacked one through its own pack / unpack."""
    import torch
    from attnlab.quant import QuantSpec
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for name, fmt in kinds.KINDS.items():
        spec = QuantSpec.parse(name)
        assert str(QuantSpec.parse(str(spec))) == str(spec) and spec.method == name
        p = spec.quantize(w)
        assert p.kind == name and fmt.dequantize(p).shape == w.shape
        assert set(fmt.stored(32, 64, p.group)) == set(p.tensors()), name
        if fmt.pack is not None:
            wp, layout = fmt.pack(p, False)
            back = fmt.unpack(wp, 32, 64, p.group, False, layout)
            assert torch.equal(back.dequantize(), p.dequantize()), name
            assert fmt.nbytes(32, 64, p.group, False, layout) <= wp.numel()


def test_quantize_command_spells_bits_only_for_formats_that_take_them():
    from attnlab.quant import QuantSpec
    assert QuantSpec.text("kmeans", 3, 64) == "kmeans:3:64" and QuantSpec.text("kmeans-naive", 2, None) == "kmeans-naive:2"
    assert QuantSpec.text("int4", 3, 64) == "int4:64" and QuantSpec.text("int8", None, None) == "int8"
    assert str(QuantSpec.parse(QuantSpec.text("kmeans", 3, 64))) == "kmeans:3:64"
