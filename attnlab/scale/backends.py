"""Where cells run: `LocalBackend` (serial, in this process, no Ray) and `RayBackend`.

Both yield (cell, payload) as cells finish; a cell that raises does not stop the others,
the run raises one AttnlabError at the end naming the failures. Ray is imported lazily: the
library never needs it (`pip install 'attnlab[scale]'`).

Loopback: a Ray instance this module starts (no address, or a 127.x address) binds its
control plane and every node to 127.0.0.1. Ray picks the machine's network interface by
default; `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` in the environment before `import ray` is what
makes it use loopback (passing `_node_ip_address` alone did not). A real multi-node cluster
(`--address HOST:PORT` of a `ray start --head`) is joined as it is.
"""
from __future__ import annotations

import ipaddress
import os
import sys
import time

from attnlab.errors import AttnlabError
from attnlab.scale.cells import execute

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
NEED_RAY = "--backend ray needs Ray: pip install 'attnlab[scale]' (or pip install 'ray[default]')"


def _fail(errors: list[tuple[str, str]]) -> None:
    if errors:
        key, msg = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise AttnlabError(f"{len(errors)} cell(s) failed{more}; {key}: {msg}; finished cells are saved, "
                           "rerun to retry the rest")


class LocalBackend:
    """Serial, in-process: the default, and the reference a cluster run must equal."""
    name = "local"

    def run(self, cells, threads: int = 1):
        errors = []
        for cell in cells:
            try:
                payload = execute(cell.fn, cell.params, cell.func)  # threads: this process's, set by its command
            except (AttnlabError, OSError) as e:  # anything else is a bug: its traceback stays
                errors.append((cell.key, " ".join(str(e).split()) or type(e).__name__))
                continue
            yield cell, payload
        _fail(errors)

    def close(self) -> None:
        pass


def is_loopback(address: str | None) -> bool:
    """None/'local' (a fresh local instance) or a 127.x / localhost address."""
    if address in (None, "", "local"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def import_ray(loopback: bool = True, need: str = NEED_RAY):
    """`ray`, with the loopback switch set first when this process starts or joins a local instance;
    AttnlabError(need) when Ray is not installed."""
    if loopback:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise AttnlabError(need) from None
    if loopback:  # imported before the variable was set: the constant Ray read at import decides
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False
    return ray


def node_addresses(ray) -> list[str]:
    return [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]


def assert_loopback(ray) -> None:
    bad = [a for a in node_addresses(ray) if not ipaddress.ip_address(a).is_loopback]
    if bad:
        raise AttnlabError(f"Ray nodes outside loopback: {', '.join(bad)} (set {LOOPBACK_ENV}=0 before Ray starts)")


def _task(fn: str, params: dict) -> dict:
    import ray
    return {**execute(fn, params), "node": ray.get_runtime_context().get_node_id()}


class RayBackend:
    """Cells as Ray tasks: `cpus` CPUs each, retried up to `max_retries` times on another
    worker when theirs dies (a cell's own exception is not retried: it would fail again).

    address: None starts a local Ray instance (`num_cpus` CPUs, or a `local_nodes`-node
    cluster of `cpus_per_node` each, head with no CPUs); 'auto' or HOST:PORT joins one."""
    name = "ray"

    def __init__(self, address: str | None = None, cpus: float = 1, max_retries: int = 3,
                 num_cpus: int | None = None, local_nodes: int = 0, cpus_per_node: int = 1):
        self.address, self.cpus, self.max_retries = address, cpus, max_retries
        self.loopback = is_loopback(address) and address != "auto" or local_nodes > 0
        self.ray = import_ray(self.loopback)
        self.cluster, self._owned = None, False
        ray = self.ray
        if ray.is_initialized():
            return
        t0 = time.perf_counter()
        kw = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}} if self.loopback else None
        if local_nodes:
            from ray.cluster_utils import Cluster
            self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
            for _ in range(local_nodes):
                self.cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1")
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, runtime_env=env, **kw)
        elif address in (None, "", "local"):
            ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", runtime_env=env, **kw)
        else:
            ray.init(address=address, **kw)
        self._owned = True
        self.start_seconds = time.perf_counter() - t0
        if self.loopback:
            assert_loopback(ray)

    def run(self, cells, threads: int = 1):
        ray = self.ray
        env = {"env_vars": {"OMP_NUM_THREADS": str(threads)}} if threads else None  # torch's threads in the task
        remote = ray.remote(_task).options(num_cpus=self.cpus, max_retries=self.max_retries, retry_exceptions=False,
                                           runtime_env=env)
        refs = {remote.remote(c.fn, c.params): c for c in cells}
        pending, errors = list(refs), []
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                try:
                    payload = ray.get(ref)
                except ray.exceptions.RayError as e:
                    cause = getattr(e, "cause", None) or e
                    errors.append((refs[ref].key, " ".join(str(cause).split())[:300] or type(e).__name__))
                    continue
                yield refs[ref], payload
        _fail(errors)

    def close(self) -> None:
        if self._owned:
            self.ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
            self._owned = False


def make_backend(name: str, address: str | None = None, cpus: float = 1, max_retries: int = 3,
                 local_nodes: int = 0, num_cpus: int | None = None):
    if name == "local":
        if address or local_nodes:
            raise AttnlabError("--address and --local-nodes need --backend ray")
        return LocalBackend()
    if name == "ray":
        return RayBackend(address, cpus=cpus, max_retries=max_retries, local_nodes=local_nodes, num_cpus=num_cpus)
    raise AttnlabError(f"unknown backend {name!r}; choose local or ray")
