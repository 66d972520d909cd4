"""The CUDA handler on a real GPU: 2 worker processes sharing the one GPU,
summation servers on the host, random trees against numpy. Skipped, saying
why, where jax has no GPU backend or jbps was built without CUDA."""

import functools
import os
import subprocess
import sys

import pytest

import jbps
from conftest import check_results, last_json, run_job, worker_script


@functools.lru_cache(maxsize=None)
def _gpu_backend() -> str | None:
    """None when a fresh process's jax (not forced to CPU) has a GPU; else why not."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        return f"jax failed to start: {proc.stderr[-500:]}"
    backend = proc.stdout.split()[-1]
    return None if backend == "gpu" else f"jax has no GPU backend here (default backend: {backend})"


def _skip_without_gpu():
    if not jbps.has_cuda_support():
        pytest.skip("jbps was built without the CUDA handler (JBPS_CUDA / CUDA toolkit not found)")
    why = _gpu_backend()
    if why is not None:
        pytest.skip(why)


# Both workers share the GPU: neither may take most of its memory up front.
GPU_ENV = {
    "JAX_PLATFORMS": "cuda",
    "XLA_FLAGS": "",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "JBPS_PARTITION_BYTES": "65536",
    "JBPS_TIMEOUT_S": "60",
}


def _gpu_job(script_args, extra_env=None):
    env = dict(GPU_ENV, **(extra_env or {}))
    # LocalCluster forces workers onto the CPU; the per-rank env wins over that.
    return run_job(script_args, workers=2, servers=2, devices=1, env_per_rank={0: env, 1: env}, timeout_s=300)


@pytest.mark.parametrize("mode", ["jit", "pmap"])
@pytest.mark.parametrize("wait", ["stream", "host", "sync"])
def test_random_trees_on_the_gpu_match_numpy(mode, wait):
    _skip_without_gpu()
    extra = {"stream": {}, "host": {"JBPS_CUDA_HOST_WAIT": "1"}, "sync": {"JBPS_CUDA_SYNC": "1"}}[wait]
    rounds = 4
    results = _gpu_job([worker_script("random_trees.py"), "--rounds", str(rounds), "--mode", mode], extra)
    check_results(results, rounds)
    assert [last_json(r.stdout)["backend"] for r in results] == ["gpu", "gpu"]


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_random_trees_in_buckets_on_side_streams_match_numpy(mode):
    """Small buckets: each bucket's call on a stream of its own (jbps/ops/side_stream.py)."""
    _skip_without_gpu()
    rounds = 4
    results = _gpu_job(
        [worker_script("random_trees.py"), "--rounds", str(rounds), "--mode", mode], {"JBPS_BUCKET_BYTES": "4096"}
    )
    check_results(results, rounds)


def test_the_compiled_step_starts_every_bucket_before_it_waits_for_one(tmp_path):
    """XLA:GPU makes each bucket's call an async start/done pair: every start
    comes before the first done in the step's schedule, and the backward
    pass's kernels are scheduled between the first and the last start."""
    _skip_without_gpu()
    script = [worker_script("overlap_step.py"), "--bucket-bytes", "262144", "--steps", "2", "--schedule"]
    for r in _gpu_job(script, {"JBPS_TRACE_DIR": str(tmp_path)}):
        assert r.returncode == 0, r.stderr[-3000:]
        schedule = last_json(r.stdout)["schedule"]
        starts, dones, others = schedule["starts"], schedule["dones"], schedule["others"]
        assert len(starts) == len(dones) == schedule["custom_calls"] >= 3, schedule
        assert max(starts) < min(dones), schedule
        assert any(starts[0] < i < starts[-1] for i in others), schedule


def test_engine_error_fails_the_next_psum():
    _skip_without_gpu()
    for r in _gpu_job([worker_script("cuda_deferred.py")]):
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["first_error"] is None, rep
        assert "an earlier psum failed" in rep["second_error"] and "mismatched['b']" in rep["second_error"], rep
        assert rep["recovered"], rep


def test_engine_error_fails_the_op_itself_with_cuda_sync():
    _skip_without_gpu()
    for r in _gpu_job([worker_script("mismatch.py"), "--what", "shape"], {"JBPS_CUDA_SYNC": "1"}):
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is not None and "mismatched['b']" in rep["error"], rep
        assert rep["recovered"], rep
