"""benchmarks/llamacpp.py: the build plan under each AMX situation, llama-bench's JSON, -ub 1 where needed."""
from __future__ import annotations

import importlib.util
import json
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("llamacpp", ROOT / "benchmarks" / "llamacpp.py")
llamacpp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(llamacpp)

AVX512 = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize("flags, granted, ub1", [
    (AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}, False, True),   # the OS forbids tiles: prefill would SIGILL
    (AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}, True, False),
    (AVX512, False, False),                                          # no AMX at all: nothing to fall back from
    ({"avx", "avx2", "fma", "f16c"}, False, False),
])
def test_plan_falls_back_to_ub1_only_where_amx_is_forbidden(flags, granted, ub1):
    plan = llamacpp.plan_builds(flags, granted)
    assert plan["native"]["ub1"] is ub1 and plan["generic"]["ub1"] is False
    assert "-DGGML_NATIVE=ON" in plan["native"]["cmake"]
    generic = plan["generic"]["cmake"]
    assert "-DGGML_NATIVE=OFF" in generic and "-DGGML_AMX_INT8=OFF" in generic
    assert ("-DGGML_AVX512=ON" in generic) == ("avx512f" in flags)
    assert ("-DGGML_AVX512_VNNI=ON" in generic) == ("avx512_vnni" in flags)
    assert "-DGGML_AVX2=ON" in generic


def test_amx_probe_answers_without_crashing():
    assert llamacpp.amx_granted() in (True, False)
    assert "ISA flags:" in llamacpp.header()


ROW = {"build_commit": "abc", "n_threads": 2, "n_prompt": 0, "n_gen": 32, "n_depth": 1024, "flash_attn": 1,
       "n_ubatch": 512, "avg_ts": 54.4, "stddev_ts": 0.5, "samples_ts": [54.0, 54.8]}


def test_parse_bench_and_best_of_flash_modes():
    rows = llamacpp.parse_bench("load: noise before the JSON\n" + json.dumps([ROW, {**ROW, "flash_attn": 0,
                                                                                       "avg_ts": 50.0}]))
    assert rows[0] == {"threads": 2, "flash": True, "depth": 1024, "n_prompt": 0, "n_gen": 32, "ub": 512,
                       "tps": 54.4, "tps_sd": 0.5, "samples": [54.0, 54.8]}
    assert rows[1]["flash"] is False
    best = llamacpp.best_per_cell(rows)
    assert list(best) == [(2, 1024, 0, 32)] and best[(2, 1024, 0, 32)]["flash"] is True
    with pytest.raises(ValueError):
        llamacpp.parse_bench("error: no model")


def fake_bench(tmp_path: Path) -> Path:
    """A stand-in llama-bench that reports its own arguments as n_ubatch (1 when -ub 1 was passed)."""
    exe = tmp_path / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/usr/bin/env python3\nimport json, sys\na = sys.argv\n"
                   f"row = {ROW!r}\nrow['n_ubatch'] = int(a[a.index('-ub') + 1]) if '-ub' in a else 512\n"
                   "print(json.dumps([row]))\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe.parent


def test_run_bench_adds_ub1_only_for_builds_that_need_it(tmp_path):
    bin_dir = fake_bench(tmp_path)
    assert llamacpp.run_bench({"bin": str(bin_dir), "ub1": True}, "m.gguf", ["-p", "0"])[0]["ub"] == 1
    assert llamacpp.run_bench({"bin": str(bin_dir), "ub1": False}, "m.gguf", ["-p", "0"])[0]["ub"] == 512


def test_installed_builds_are_found_by_their_build_json(tmp_path):
    fake_bench(tmp_path / "native")
    (tmp_path / "native" / "build.json").write_text(json.dumps({"name": "native", "ub1": True}))
    (tmp_path / "generic").mkdir()  # no binaries (a failed build): not offered
    (tmp_path / "generic" / "build.json").write_text(json.dumps({"name": "generic", "ub1": False}))
    found = llamacpp.installed(tmp_path)
    assert list(found) == ["native"] and found["native"]["ub1"] is True
    assert found["native"]["bin"] == str(tmp_path / "native" / "bin")


def _gguf(path, tensors):
    """A GGUF file of float32 tensors {name: rows x cols}, nothing else."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_token_bytes_reads_one_row_of_an_untied_table(tmp_path):
    layer = {"blk.0.ffn_up.weight": (64, 32), "token_embd.weight": (100, 32)}
    tied = _gguf(tmp_path / "tied.gguf", layer)
    untied = _gguf(tmp_path / "untied.gguf", {**layer, "output.weight": (100, 32)})
    assert llamacpp.token_bytes(tied) == (64 + 100) * 32 * 4        # the table is the head: read whole
    assert llamacpp.token_bytes(untied) == (64 + 100) * 32 * 4      # the head read, the table not


def test_bound_fraction_and_bandwidth():
    import torch
    assert llamacpp.bound_fraction(10.0, 1e9, 20.0) == pytest.approx(0.5)  # 10 tok/s of 1 GB at 20 GB/s
    before = torch.get_num_threads()
    bw = llamacpp.read_bandwidth(1, gib=1 / 64, repeats=2)
    assert bw > 0 and torch.get_num_threads() == before
    assert "GB/s at 1 thread, " in llamacpp.bandwidth_line({1: 10.0, 2: 18.0})
