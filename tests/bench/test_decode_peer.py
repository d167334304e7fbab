"""benchmarks/decode_peer.py: ours alone on the embedded file, the record names its run and its bound fractions."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ours_alone_writes_a_record_with_bound_fractions(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("decode_peer", ROOT / "benchmarks" / "decode_peer.py")
        peer = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(peer)
        out = tmp_path / "peer.json"
        assert peer.main(["--files", "smollm2-135m", "--threads", "1", "--depths", "16,32", "--steps", "2",
                          "--rounds", "2", "--no-llamacpp", "--bandwidth-gib", "0.0625", "--json", str(out)]) == 0
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("python benchmarks/decode_peer.py") and rec["seed"] == 0
    assert {"commit", "dirty", "cpu", "bandwidth_gbs"} <= set(rec)
    (run,) = rec["runs"]
    assert run["threads"] == 1 and len(run["samples"]["ours"]["16"]) == 2
    for cell in run["cells"].values():  # tok/s over the limit the file's bytes and the measured bandwidth allow
        assert cell["ours"] > 0 and cell["ours_bound"] == cell["ours"] / cell["limit_tok_s"]
        assert cell["peer"] is None and cell["ratio"] is None
    assert "| ours |" in capsys.readouterr().out
