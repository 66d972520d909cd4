"""compression="bf16"/"fp16": float leaves travel as 16-bit floats, summed in
float32 by the servers, checked bitwise against numpy with real processes."""

import numpy as np
import pytest

import jbps
from conftest import last_json, run_job, worker_script


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_sums_equal_numpys_sum_of_the_rounded_inputs(compression):
    results = run_job(
        [worker_script("compressed_psum.py"), "--compression", compression],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": "60"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is None and rep["rounds"] == 3, rep


def test_workers_that_disagree_fail_naming_the_leaf():
    results = run_job(
        [
            worker_script("compressed_psum.py"),
            "--compression",
            "bf16",
            "--rounds",
            "1",
            "--compression-rank",
            "1",
            "--compression-there",
            "none",
        ],
        workers=2,
        servers=1,
        env={"JBPS_TIMEOUT_S": "30"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        err = last_json(r.stdout)["error"]
        assert err is not None and "jbps:" in err and "['b']" in err, err


def test_a_bad_compression_is_refused_naming_it(session):
    with pytest.raises(ValueError, match="compression must be None, 'bf16' or 'fp16', got 'int8'"):
        jbps.psum(np.ones(3, np.float32), compression="int8")


def test_one_worker_sum_is_the_rounded_input(session):
    x = np.linspace(-3, 3, 1001, dtype=np.float32) * 1.2345
    got = np.asarray(jbps.psum(x, compression="bf16"))
    import jax.numpy as jnp

    assert got.dtype == np.float32
    assert np.array_equal(got, np.asarray(x, jnp.bfloat16).astype(np.float32))
