"""`attnlab train` under torchrun: 2 gloo processes follow the 1-process curve, and resume (marker `cluster`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--tokenizer", "char", "--dim", "16", "--layers", "1", "--heads", "1", "--hidden", "32", "--context", "16",
        "--batch", "8", "--lr", "3e-3", "--eval-every", "1", "--eval-batches", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    from attnlab.data import corpus
    d = tmp_path_factory.mktemp("text")
    (d / "train.txt").write_text(corpus("shakespeare:hamlet")[:20000])
    (d / "val.txt").write_text(corpus("shakespeare:macbeth")[:2000])
    return ["--corpus", str(d / "train.txt"), "--val-corpus", str(d / "val.txt")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "attnlab", "train", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def curve(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


def test_two_processes_match_one_and_resume(texts, tmp_path):
    from attnlab.cli import main
    assert main(["train", *TINY, *texts, "--steps", "20", "--ckpt-every", "10", "--out", str(tmp_path / "one")]) == 0
    one = curve(tmp_path / "one")
    torchrun(2, [*TINY, *texts, "--steps", "20", "--ckpt-every", "10", "--out", str(tmp_path / "two")])
    two = curve(tmp_path / "two")
    assert len(one) == len(two) == 20
    assert one[-1] < one[0] - 0.3  # it learns
    assert two == pytest.approx(one, rel=1e-4, abs=1e-5)  # same global batch, gradients averaged over ranks
    # a DDP run stopped at step 10 and resumed continues the same curve
    torchrun(2, [*TINY, *texts, "--steps", "10", "--ckpt-every", "5", "--out", str(tmp_path / "resumed")])
    assert len(curve(tmp_path / "resumed")) == 10
    torchrun(2, [*TINY, *texts, "--steps", "20", "--ckpt-every", "5", "--out", str(tmp_path / "resumed"), "--resume"])
    resumed = curve(tmp_path / "resumed")
    assert resumed == pytest.approx(two, rel=1e-4, abs=1e-5)
    assert len(list((tmp_path / "two" / "checkpoints").iterdir())) >= 1  # rank 0 wrote them


def test_batch_must_split_over_ranks():
    import torch

    from attnlab.errors import AttnlabError
    from attnlab.train.ddp import shard
    x = torch.arange(12).view(6, 2)
    assert shard(x, 2, 1).tolist() == [[6, 7], [8, 9], [10, 11]]
    with pytest.raises(AttnlabError, match="does not split over 4"):
        shard(x, 4, 0)
