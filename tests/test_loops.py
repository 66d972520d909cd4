"""The loop family: training loops as users run them, every step dispatched
right after the last, nothing waiting between them (tests/workers/loops.py):
pmap, shard_map and jit over NamedSharding'ed arrays; 1, 2 and 4 local
devices; 1, 2 and 3 workers; plain psums, buckets, bf16 compression and a
flax step with jbps.optax.distributed; every end state checked against numpy
or a one-process optax run.

Where jax's CPU runtime deadlocks such loops (jax < 0.12 with several local
devices: jbps/cpu_loop_deadlock.py) the worker waits for a step's result every
few steps, as jbps's warning and docs/guide/loops.md advise; elsewhere nothing
waits. tests/stress_loops.py runs the family many times."""

import pytest

from conftest import last_json, run_job, worker_script

JOBS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 2)]  # (workers, local devices)


@pytest.mark.parametrize("workers,devices", JOBS, ids=[f"{w}w-{d}d" for w, d in JOBS])
def test_loops_dispatched_back_to_back_finish_with_numpy_sums(workers, devices):
    results = run_job(
        [worker_script("loops.py")],
        workers=workers,
        servers=2,
        devices=devices,
        env={"JBPS_TIMEOUT_S": "60"},
        timeout_s=300,
    )
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
        report = last_json(r.stdout)
        assert report["apis"] == ["pmap", "shard_map", "jit"] and report["steps"] == 48
