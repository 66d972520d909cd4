"""Shared fixtures. In-process tests get 4 host devices and a real summation
server running on threads of the test process (real sockets on loopback)."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import jbps
from jbps import _core

# The checkout, last on the path: its benchmarks/ (the lab: local and emulated
# clusters, the peers) are found there, while `import jbps` stays the installed package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.append(REPO)

from benchmarks import emulated_job  # noqa: E402
from benchmarks.local_cluster import _REPO_ROOT, LocalCluster, last_json_line  # noqa: E402

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def job_free_env(**extra):
    """This environment without any job variables, importing the jbps under
    test (PYTHONPATH first), plus `extra`: for processes a test starts itself."""
    pythonpath = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return emulated_job.job_free_env(**{"PYTHONPATH": pythonpath, **extra})


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", help="run the long soak (2,000 rounds; also JBPS_SOAK=1)")


@pytest.fixture
def server():
    """A one-worker summation server on a free loopback port."""
    srv = _core.Server("127.0.0.1:0", 1, keep_alive=True)
    yield f"127.0.0.1:{srv.port}"
    srv.stop()


@pytest.fixture
def session(server):
    """jbps initialised as the only worker of a job, shut down afterwards."""
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, timeout_s=20) as s:
        yield s


def worker_script(name):
    return os.path.join(WORKERS, name)


def run_job(script_args, *, workers, servers, devices=1, env=None, env_per_rank=None, timeout_s=180):
    """Runs a multi-process job; returns the WorkerResults (asserting none timed out)."""
    with LocalCluster(
        workers, servers, local_devices=devices, timeout_s=timeout_s, env=env, python=sys.executable
    ) as cluster:
        return cluster.run_workers(script_args, env_per_rank=env_per_rank)


def last_json(text):
    report = last_json_line(text)
    assert report is not None, f"no JSON line in output:\n{text[-2000:]}"
    return report


def check_results(results, rounds):
    """Every worker of a random_trees.py job passed its numpy checks, ran every
    round, and got bitwise the same sums as the others."""
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
    reports = [last_json(r.stdout) for r in results]
    assert [rep["rounds"] for rep in reports] == [rounds] * len(results)
    digests = {rep["digest"] for rep in reports}
    assert len(digests) == 1, f"workers got different sums: {reports}"


def _emulated_hosts_unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no iproute2), or None."""
    from benchmarks.emulated_network import NetworkError, check_tools

    try:
        check_tools()
    except NetworkError as exc:
        return str(exc)
    return None


# Tests across emulated hosts (benchmarks/emulated_network.py): skipped, saying why, where they cannot run.
needs_emulated_hosts = pytest.mark.skipif(
    _emulated_hosts_unavailable() is not None, reason=_emulated_hosts_unavailable() or ""
)


# What each test file needs, as markers (`pytest -m ...` picks; README, Tests):
#   unit       one process: the in-process engine and a server on threads, or pure Python
#   cluster    real server and worker processes on this machine (jbps run, LocalCluster, mpirun)
#   multihost  emulated hosts: network namespaces (root and iproute2)
#   gpu        a CUDA device
#   packaging  wheels, checkouts, the build files, Bazel
#   docs       the documentation: its links, commands and build
# and `slow`: the tests that take more than about 20 s on 2 cores (SLOW below).
FILE_MARKERS = {
    "test_api.py": "unit",
    "test_bazel_smoke.py": "packaging",
    "test_bench_latency.py": "cluster",
    "test_bench_network.py": "multihost",
    "test_bench_smoke.py": "cluster",
    "test_binding.py": "cluster",
    "test_buckets.py": "cluster",
    "test_build_sources.py": "packaging",
    "test_checkout.py": "packaging",
    "test_compression.py": "cluster",
    "test_cuda_build.py": "packaging",
    "test_cuda_gpu.py": "gpu",
    "test_docs.py": "docs",
    "test_engine_units.py": "unit",
    "test_errors.py": "cluster",
    "test_examples.py": "cluster",
    "test_faults.py": "cluster",
    "test_fresh_outputs.py": "unit",
    "test_hostile_input.py": "cluster",
    "test_keep_alive.py": "unit",
    "test_launch.py": "cluster",
    "test_lax_conformance.py": "cluster",
    "test_loops.py": "cluster",
    "test_mixed_transports.py": "cluster",
    "test_models.py": "unit",
    "test_multihost.py": "multihost",
    "test_onebit.py": "cluster",
    "test_onebit_adam.py": "cluster",
    "test_optax.py": "cluster",
    "test_partition.py": "unit",
    "test_portable_kernels.py": "cluster",
    "test_psum_cluster.py": "cluster",
    "test_scheduling.py": "cluster",
    "test_shm.py": "cluster",
    "test_shutdown.py": "cluster",
    "test_soak.py": "cluster",
    "test_sum_kernels.py": "unit",
    "test_topk.py": "unit",
    "test_wheel.py": "packaging",
}
# Node ids (or their start) of the tests over about 20 s each on 2 cores (pytest --durations=0).
SLOW: tuple[str, ...] = ()


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name not in FILE_MARKERS:
            raise pytest.UsageError(f"tests/conftest.py: {name} has no entry in FILE_MARKERS (what it needs)")
        item.add_marker(getattr(pytest.mark, FILE_MARKERS[name]))
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
