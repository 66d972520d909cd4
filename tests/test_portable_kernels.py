"""The portable loops behind every hand-written AVX2 kernel (xla_ext/multiversion.h): with
JBPS_CPU_BASELINE=1 a job of real workers and servers runs them instead, and every result must
be the vector kernels' bit for bit (tests/workers/kernel_paths.py saves them)."""

import numpy as np
import pytest

from conftest import last_json, run_job, worker_script


def test_the_portable_loops_give_the_bits_of_the_vector_kernels(tmp_path):
    # JBPS_CPU_BASELINE=1 turns the hand-written AVX2 kernels off (multiversion.h):
    # the casts, onebit's and topk's codecs and the servers' decode-add and encode
    # with feedback must then give, bit for bit, what the vector kernels give.
    files = {}
    for baseline in ("0", "1"):
        path = tmp_path / f"baseline{baseline}.npz"
        results = run_job(
            [worker_script("kernel_paths.py"), str(path)], workers=2, servers=2, env={"JBPS_CPU_BASELINE": baseline}
        )
        reports = [last_json(r.stdout) for r in results]
        assert all(r.returncode == 0 and rep["error"] is None for r, rep in zip(results, reports)), [
            (rep, r.stderr[-2000:]) for r, rep in zip(results, reports)
        ]
        avx2 = {rep["avx2"] for rep in reports}
        if baseline == "1":
            assert avx2 == {False}
        elif avx2 == {False}:
            pytest.skip("this CPU has no AVX2: only the portable loops run here")
        files[baseline] = np.load(path)
    assert sorted(files["0"].files) == sorted(files["1"].files)
    for name in files["0"].files:
        vector, portable = files["0"][name], files["1"][name]
        assert vector.shape == portable.shape and vector.tobytes() == portable.tobytes(), name
