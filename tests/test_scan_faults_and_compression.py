"""jbps.scan with compression and under faults: bf16 and onebit sums as the
same steps one program a step; a lost or hung worker fails a scanned program
of several local devices once, naming the cause. (Kept apart from
test_scan.py, which CI runs on the oldest and newest jax too.)"""

import pytest

from conftest import last_json, run_job, worker_script
from test_scan import _run


@pytest.mark.parametrize("compression", ["bf16", "onebit"])
def test_scanned_steps_with_compression_train_as_one_program_a_step(compression):
    reports = _run("jit", 1, "--steps", "3", "--programs", "2", "--compression", compression)
    for r in reports:
        assert r["max_error"] < 1e-5, r
        assert r["loss_error"] < 1e-5, r
    assert len({r["checksum"] for r in reports}) == 1, reports


@pytest.mark.parametrize("hang", [False, True])
def test_a_lost_or_hung_worker_fails_every_devices_program_at_its_end(hang):
    # 2 local devices a worker, a survivor's program of 3 steps: it fails once,
    # naming the cause, within the psum timeout (no device left waiting for
    # another in an all-gather, which XLA:CPU would end by aborting the process).
    extra = ["--steps", "3", "--programs", "2", "--die-rank", "1"] + (["--hang"] if hang else [])
    results = run_job(
        [worker_script("scan_train.py"), "--mode", "pmap", *extra],
        workers=2,
        servers=2,
        devices=2,
        env={"JBPS_TIMEOUT_S": "4"},
        timeout_s=120,
    )
    survivor = results[0]
    assert survivor.returncode == 0, survivor.stderr[-4000:]
    report = last_json(survivor.stdout)
    assert report["program"] == 1, report
    if hang:
        assert "timed out after 4 s" in report["error"], report
    else:
        assert "worker 1" in report["error"], report
    assert report["after_s"] < 4 + 8, report
