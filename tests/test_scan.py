"""jbps.scan: several training steps in one program. The same parameters as
plain optax on every worker's batch, on one device and on several; the next
step's forward pass runs while the previous step's last sums still travel
(read from a debug callback and the engine's trace); steps that break
lax.scan's contract are named at trace time. (Compression and faults:
test_scan_faults_and_compression.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbps
from conftest import last_json, run_job, worker_script


def _run(mode, devices, *extra, env=None, timeout_s=240):
    results = run_job(
        [worker_script("scan_train.py"), "--mode", mode, *extra],
        workers=2,
        servers=2,
        devices=devices,
        env={"JBPS_TIMEOUT_S": "60", **(env or {})},
        timeout_s=timeout_s,
    )
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
    return [last_json(r.stdout) for r in results]


@pytest.mark.parametrize("mode,devices", [("jit", 1), ("pmap", 2)])
def test_scanned_steps_train_as_plain_optax_on_every_batch(mode, devices):
    reports = _run(mode, devices, "--steps", "3", "--programs", "2")
    for r in reports:
        # adam on the mean gradient of 2 workers x devices batches, 6 steps
        assert r["max_error"] < 1e-5, r
        assert r["loss_error"] < 1e-5, r
    assert len({r["checksum"] for r in reports}) == 1, reports


def test_the_next_steps_forward_pass_runs_before_the_last_sums_are_back(tmp_path):
    # One device a worker (with several, XLA:CPU runs the devices' all-gathers
    # in program order: the first layer's waits for every other bucket's).
    # A last layer of 32 x 131072 (16 MiB of float32) in chunks of 16 KiB: its
    # sums, the lowest priority, come back 100-200 ms after the small first
    # layer's, which the next step's forward pass needs first (with each
    # psum's buckets joined, the marks came 1-15 ms after the last sums).
    env = {"JBPS_TRACE_DIR": str(tmp_path), "JBPS_PARTITION_BYTES": "16384"}
    mode, devices = "jit", 1
    reports = _run(mode, devices, "--steps", "3", "--programs", "2", "--last-width", "131072", "--marks", env=env)
    for r in reports:
        assert r["max_error"] < 1e-5, r
        back = r["sums_back"]
        assert len(r["marks"]) == devices * len(back) == devices * 6, r
        # Each step's marks, one a device (a step's come before the next step's:
        # that one's forward pass needs this one's sums of every device).
        marks = [max(r["marks"][s * devices : (s + 1) * devices]) for s in range(6)]
        for prog in range(2):
            # The first layer of step s ran before step s - 1's last sum was back: its update
            # waited for its own sum only. Without the overlap that never happens (the step
            # needs every sum); with it, in at least one of each program's later steps: on a
            # loaded machine a starved forward pass can come after a step's last sums (a CI
            # run here saw one of 4 steps 0.2 s late).
            ahead = [marks[s] < back[s - 1] for s in (prog * 3 + 1, prog * 3 + 2)]
            assert any(ahead), (prog, marks, back)
        # Across programs the next program starts once this one has ended.
        assert min(r["marks"][3 * devices : 4 * devices]) > back[2], (marks, back)


def _step(carry, x):
    return carry + x, carry * 2


def test_scan_outside_jit_matches_lax_scan():
    xs = jnp.arange(5.0)
    carry, ys = jbps.scan(_step, jnp.float32(1), xs)
    ref_carry, ref_ys = jax.lax.scan(_step, jnp.float32(1), xs)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(ref_ys))
    np.testing.assert_allclose(np.asarray(carry), np.asarray(ref_carry))


def test_a_step_that_changes_its_carry_is_named_at_trace_time():
    def widen(carry, x):
        return {"w": carry["w"].astype(jnp.float16), "n": carry["n"] + 1}, None

    with pytest.raises(TypeError, match=r"step 0 changed carry leaf \['w'\] from float32\[3\] to float16\[3\]"):
        jax.jit(lambda c: jbps.scan(widen, c, length=2))({"w": jnp.zeros(3), "n": jnp.int32(0)})

    def drop(carry, x):
        return {"w": carry["w"]}, None

    with pytest.raises(TypeError, match=r"returned a carry without leaf \['n'\]"):
        jax.jit(lambda c: jbps.scan(drop, c, length=2))({"w": jnp.zeros(3), "n": jnp.int32(0)})


@pytest.mark.parametrize(
    "xs,length,message",
    [
        ({"a": jnp.zeros((3, 2)), "b": jnp.zeros((4,))}, None, "differ in their leading axis"),
        (jnp.zeros((3,)), 4, "length=4 but xs has 3 steps"),
        (None, None, "give length= when xs has no leaves"),
        (jnp.float32(1), None, "is a scalar"),
        (None, 0, "length must be a positive int"),
    ],
)
def test_bad_steps_or_length_get_one_clear_line(xs, length, message):
    with pytest.raises(ValueError, match=message):
        jbps.scan(_step, jnp.float32(0), xs, length=length)


def _sgd(carry, x):
    grads = jbps.psum({"g": carry["w"] * x, "h": carry["w"] + x}, bucket_bytes=4)  # two buckets
    return {"w": carry["w"] - 0.1 * grads["g"] - 0.01 * grads["h"]}, grads["g"].sum()


def test_a_psum_under_a_nested_jit_is_summed_but_said_not_overlapped(session, recwarn):
    init, xs = {"w": jnp.arange(4.0)}, jnp.arange(3.0)[:, None] * jnp.ones((3, 4))
    ref = jax.lax.scan(_sgd, init, xs)  # one worker: each sum is the value itself
    got = jax.jit(lambda c, x: jbps.scan(_sgd, c, x))(init, xs)
    np.testing.assert_allclose(np.asarray(got[0]["w"]), np.asarray(ref[0]["w"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-6)
    assert not [w for w in recwarn if "jbps.scan" in str(w.message)]
    nested = jax.jit(lambda c, x: jbps.scan(jax.jit(_sgd), c, x))(init, xs)
    np.testing.assert_allclose(np.asarray(nested[0]["w"]), np.asarray(ref[0]["w"]), rtol=1e-6)
    assert [w for w in recwarn if "traced under a nested jit" in str(w.message)]
