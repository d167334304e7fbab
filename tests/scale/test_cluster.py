"""A real multi-node Ray cluster on this machine, loopback only (`make test-scale`; marker `cluster`).

Ray's own `ray.cluster_utils.Cluster`: a head with no CPUs and 2 one-CPU worker nodes, so every
cell runs on a worker. A sweep of 8 dynamics cells loses a worker node mid-sweep (its task is
retried elsewhere) and must equal the serial run; a driver killed mid-sweep resumes without
recomputing the cells it finished.
"""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only
ray = pytest.importorskip("ray")

from attnlab.scale import LocalBackend, RayBackend  # noqa: E402
from attnlab.scale.backends import node_addresses  # noqa: E402
from attnlab.scale.spec import Spec  # noqa: E402
from attnlab.cli.sweep_cells import run_sweep  # noqa: E402

SPEC = Spec("dynamics scan-snap", {"seed": list(range(8))}, {"quick": True, "iters": 8})
ROOT = Path(__file__).resolve().parents[2]


def comparable(rows):
    return [{k: v for k, v in r.items() if "runtime" not in k} for r in rows]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    workers = [c.add_node(num_cpus=1, node_ip_address="127.0.0.1") for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield c, workers
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    report, merged = run_sweep(SPEC, tmp_path_factory.mktemp("serial"), LocalBackend())
    assert report.computed == 8
    return comparable(merged["rows"])


def test_nodes_are_loopback(cluster):
    c, _ = cluster
    addresses = node_addresses(ray)
    assert len(addresses) == 3
    assert all(ipaddress.ip_address(a) in ipaddress.ip_network("127.0.0.0/8") for a in addresses), addresses
    assert ipaddress.ip_address(c.address.rsplit(":", 1)[0]).is_loopback  # the GCS too


def test_worker_node_removed_mid_sweep(cluster, serial, tmp_path):
    c, workers = cluster
    victim = workers[0]
    removed = threading.Event()

    def remove_when_first_cell_lands():  # both workers are busy then: the victim has a cell in flight
        while not list((tmp_path / "cells").glob("*.json")):
            time.sleep(0.05)
        c.remove_node(victim, allow_graceful=False)
        removed.set()

    t = threading.Thread(target=remove_when_first_cell_lands, daemon=True)
    t.start()
    report, merged = run_sweep(SPEC, tmp_path, RayBackend(address=c.address, max_retries=3))
    t.join(timeout=60)
    assert removed.is_set(), "the node was not removed during the sweep"
    assert report.computed == 8 and len(list((tmp_path / "cells").glob("*.json"))) == 8
    assert comparable(merged["rows"]) == serial  # every cell, equal to the serial run's
    # (which node finished which cell varies: when the survivor lands the first cell, the victim's
    # cell in flight is killed and retried on the survivor, and every cell may come from one node)
    workers.remove(victim)
    workers.append(c.add_node(num_cpus=1, node_ip_address="127.0.0.1"))  # back to 2 workers (main thread only)
    c.wait_for_nodes()


def test_driver_killed_mid_sweep_resumes(cluster, serial, tmp_path):
    c, _ = cluster
    spec = tmp_path / "spec.toml"
    spec.write_text('command = "dynamics scan-snap"\n[fixed]\nquick = true\niters = 8\n[axes]\nseed = [0, 1, 2, 3, 4, 5, 6, 7]\n')
    cmd = [sys.executable, "-m", "attnlab", "sweep", str(spec), "--backend", "ray", "--address", c.address,
           "--out", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    cells = tmp_path / "run" / "cells"
    deadline = time.time() + 240
    while len(list(cells.glob("*.json"))) < 2 and driver.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    before = {p.name: p.stat().st_mtime_ns for p in cells.glob("*.json")}
    assert 2 <= len(before) < 8, f"driver killed with {len(before)} cells done"
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{8 - len(before)} computed, {len(before)} already done" in result.stdout, result.stdout
    after = {p.name: p.stat().st_mtime_ns for p in cells.glob("*.json")}
    assert len(after) == 8 and all(after[n] == m for n, m in before.items())  # finished cells untouched
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    assert comparable(rows) == serial
