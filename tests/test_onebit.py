"""compression="onebit": a sign bit per value, a scale per block, error
feedback on the workers (in the optimizer state) and on the servers. Real
processes, checked against numpy: the sums bit for bit, the residuals, the
feedback's convergence, workers that disagree, and the errors users get.
The job tests run "topk" too, and "topk:0.05" (51 of 1024; its format: test_topk.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jbps
from conftest import last_json, run_job, worker_script
from jbps.ops import onebit


def exact_job(codec, mode, devices, rounds, *extra):
    """onebit_psum.py --check exact on 2 workers: each worker's report, checked for no error and every round run."""
    results = run_job(
        [worker_script("onebit_psum.py"), "--codec", codec, "--check", "exact", "--mode", mode, "--rounds", str(rounds)]
        + list(extra),
        workers=2,
        servers=2,
        devices=devices,
        env={"JBPS_TIMEOUT_S": "60"},
    )
    reports = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is None and rep["rounds"] == rounds, rep
        reports.append(rep)
    return reports


@pytest.mark.parametrize("codec", ["onebit", "topk", "topk:0.05"])
@pytest.mark.parametrize("mode,devices", [("jit", 1), ("pmap", 2)])
def test_sums_and_residuals_equal_numpys_decode_sum_encode(codec, mode, devices):
    for rep in exact_job(codec, mode, devices, 4):
        assert rep["topk_keep"] == {"onebit": None, "topk": 10, "topk:0.05": 51}[codec], rep


@pytest.mark.parametrize("codec", ["onebit", "topk"])
# calls: the large leaf's pieces (4, or 2 of a device's 9 MB), plus one for
# the rest of the tree (a bucket of its own: JBPS_BUCKET_BYTES).
@pytest.mark.parametrize("mode,devices,calls", [("jit", 1, 5), ("pmap", 2, 3)])
def test_a_large_leaf_sent_in_pieces_sums_as_numpy_with_residuals_going_in(codec, mode, devices, calls):
    # 18 MB of float32 (9 MB a device under pmap) travels as pieces of about
    # 4 MiB, each its own psum call; the residuals going in are not zeros, so
    # the encoders' adding them to the gradients is checked bit for bit too.
    for rep in exact_job(codec, mode, devices, 2, "--large", "--residuals"):
        assert rep["psum_calls"] == calls, rep


# (codec, rounds, the first round's error at least, the last's at most this
# fraction of it, rounds between the checks that it keeps falling). Topk
# sends 1% a round: each value about once in a hundred rounds, carried in the
# residuals meanwhile, so its mean closes in more slowly.
# Topk keeping 5% sends each value about once in twenty rounds.
FEEDBACK = [("onebit", 32, 0.3, 1 / 5, 4), ("topk", 256, 0.8, 1 / 3, 32), ("topk:0.05", 64, 0.8, 1 / 3, 8)]


@pytest.mark.parametrize("codec,rounds,first,shrink,every", FEEDBACK)
def test_error_feedback_makes_the_mean_of_the_sums_approach_the_true_sum(codec, rounds, first, shrink, every):
    # The same gradients every round: one round's compressed sum is far off;
    # with the residuals carried (workers' and servers'), the mean over rounds
    # closes in. Without feedback it would stay where the first round was.
    results = run_job(
        [worker_script("onebit_psum.py"), "--codec", codec, "--check", "feedback", "--rounds", str(rounds)],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": "60"},
    )
    reports = []
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        reports.append(last_json(r.stdout))
        assert reports[-1]["error"] is None and reports[-1]["rounds"] == rounds, reports[-1]
    errors = reports[0]["relative_errors"]
    assert reports[1]["relative_errors"] == errors  # every worker got the same sums
    assert errors[0] > first, errors  # one round alone is coarse...
    assert errors[-1] < errors[0] * shrink, errors  # ...the feedback recovers what it dropped
    assert all(b < a for a, b in zip(errors[every::every], errors[2 * every :: every])), errors


@pytest.mark.parametrize("codec,other", [("onebit", None), ("onebit", "topk"), ("topk", "topk:0.05")])
def test_workers_that_disagree_on_compression_fail_naming_the_leaf(codec, other):
    # Worker 1 sends uncompressed, or through the other codec, or topk keeping another amount.
    extra = ["--codec", codec] + (["--disagree-codec", other] if other else [])
    results = run_job(
        [worker_script("onebit_psum.py"), "--check", "exact", "--rounds", "1", "--disagree", "1"] + extra,
        workers=2,
        servers=1,
        env={"JBPS_TIMEOUT_S": "30"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        err = last_json(r.stdout)["error"]
        # The tree check names the first leaf that travels differently, 'big', with what each
        # worker sent: onebit vs float32, onebit vs topk, or topk's 10 vs 51 of 1024.
        assert err is not None and "jbps:" in err and "['big']" in err, err
        if other is None:
            assert "onebit" in err, err
        else:
            named = {"topk": "topk[5000]", "topk:0.05": "topk(51/1024)[5000]"}
            assert f"{codec}[5000]" in err and named[other] in err, err


def test_encoding_keeps_the_invariant_and_the_format():
    rng = np.random.default_rng(3)
    x = rng.normal(size=3 * onebit.BLOCK).astype(np.float32) * np.float32(10.0) ** rng.uniform(-2, 2)
    old = rng.normal(size=x.size).astype(np.float32)
    counts = np.array([onebit.BLOCK, onebit.BLOCK, 100])
    x[2 * onebit.BLOCK + 100 :] = 0  # padding
    old[2 * onebit.BLOCK + 100 :] = 0
    corrected = x + old
    records, sent = jax.device_get(onebit.encode(jnp.asarray(corrected), jnp.asarray(counts)))
    new = corrected - sent
    # What was sent plus the new residual is the input plus the old residual
    # (up to float32 rounding at the scale of the largest of them).
    ulp = np.spacing(np.float32(max(np.abs(sent).max(), np.abs(corrected).max())))
    np.testing.assert_allclose(sent + new, x + old, rtol=0, atol=2 * ulp)
    assert np.array_equal(jax.device_get(onebit.decode(jnp.asarray(records))), sent)
    # The record: scale (mean |value| of the values it holds), count, sign bits.
    assert records.shape == (3, onebit.RECORD_BYTES) and records.dtype == np.uint8
    blocks = corrected.reshape(3, onebit.BLOCK)
    for b, n in enumerate(counts):
        scale = records[b, :4].view(np.float32)[0]
        assert records[b, 4:8].view(np.uint32)[0] == n
        np.testing.assert_allclose(scale, np.abs(blocks[b, :n]).mean(), rtol=1e-5)
        signs = np.unpackbits(records[b, 8:], bitorder="little")
        assert np.array_equal(signs[:n], blocks[b, :n] < 0) and not signs[n:].any()
        assert np.array_equal(sent.reshape(3, -1)[b, n:], np.zeros(onebit.BLOCK - n, np.float32))


def test_the_cpu_encoder_writes_the_records_of_the_xla_one():
    # On XLA:CPU the workers run the servers' encoder (a custom call, in
    # place), elsewhere XLA ops. Where a block's mean |value| is exact (values
    # on a grid) the records are the same bit for bit; elsewhere only the
    # scale's last bit may differ (summed in double, not float32). What is
    # left is the values less what the records decode to, on both; batched too.
    rng = np.random.default_rng(5)
    grid = (rng.integers(-511, 512, size=(3, 8 * onebit.BLOCK)) / 1024 * 2.0**-3).astype(np.float32)
    grid[1, 100:300] = -0.0
    noisy = (rng.normal(size=(3, 8 * onebit.BLOCK)) * 10.0 ** rng.uniform(-3, 3, size=(3, 1))).astype(np.float32)
    counts = np.array([[onebit.BLOCK] * 7 + [100]] * 3, np.int32)
    for x in (grid, noisy):  # a partial last block holds padding (zeros) after its count
        x[:, 7 * onebit.BLOCK + 100 :] = 0
    for x, exact in ((grid, True), (noisy, False)):
        xs, cs = jnp.asarray(x), jnp.asarray(counts)
        cpu = [np.asarray(a) for a in jax.jit(jax.vmap(onebit._extract_cpu))(xs, cs)]
        xla = [np.asarray(a) for a in jax.jit(jax.vmap(onebit._extract_xla))(xs, cs)]
        assert cpu[0].shape == xla[0].shape == (3, 8, onebit.RECORD_BYTES)
        assert np.array_equal(cpu[0][:, :, 4:], xla[0][:, :, 4:])  # counts and signs
        scale_cpu, scale_xla = cpu[0][:, :, :4].copy().view(np.float32), xla[0][:, :, :4].copy().view(np.float32)
        if exact:
            assert np.array_equal(cpu[0], xla[0])
        else:
            np.testing.assert_allclose(scale_cpu, scale_xla, rtol=3e-7)
        for row in range(3):
            sent = np.asarray(jax.jit(onebit._decode_cpu)(jnp.asarray(cpu[0][row])))
            assert np.array_equal(
                sent.view(np.uint32), np.asarray(onebit._decode_xla(jnp.asarray(cpu[0][row]))).view(np.uint32)
            )
            assert np.array_equal(cpu[1][row], x[row] - sent)
            records, decoded = jax.jit(onebit.encode)(xs[row], cs[row])
            assert np.array_equal(np.asarray(records), cpu[0][row]) and np.array_equal(np.asarray(decoded), sent)


def test_psum_refuses_onebit_pointing_at_the_optimizer(session):
    with pytest.raises(
        ValueError, match=r"needs optimizer state: use jbps.optax.distributed\(tx, compression='onebit'\)"
    ):
        jbps.psum(np.ones(3, np.float32), compression="onebit")
    choices = "None, 'bf16', 'fp16', 'onebit', 'topk' or 'topk:FRACTION'"
    with pytest.raises(ValueError, match=f"compression must be {choices}, got 'twobit'"):
        jbps.optax.distributed(optax.sgd(0.1), compression="twobit")
    with pytest.raises(ValueError, match=f"MultiSteps: compression must be {choices}, got 'x'"):
        jbps.optax.MultiSteps(optax.sgd(0.1), 2, compression="x")


def test_optimizer_state_holds_a_residual_per_compressed_leaf(session):
    params = {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32), "steps": jnp.zeros(4, jnp.int32)}
    tx = jbps.optax.distributed(optax.sgd(0.1), compression="onebit")
    state = tx.init(params)
    assert isinstance(state, jbps.optax.FeedbackState)
    shapes = jax.tree_util.tree_map(lambda r: r.shape, state.residuals)
    # Small and integer leaves travel as they are: no residual (None, which a checkpoint skips).
    assert shapes == {"kernel": (64, 32), "bias": None, "steps": None}
    grads = {
        "kernel": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32),
        "bias": jnp.full(32, 0.5),
        "steps": jnp.zeros(4, jnp.int32),
    }
    updates, state = jax.jit(tx.update)(grads, state, params)
    # One worker: the sum is onebit of the gradient; the residual what it lost.
    assert np.array_equal(np.asarray(updates["bias"]), np.full(32, -0.05, np.float32))
    lost = np.asarray(state.residuals["kernel"])
    np.testing.assert_allclose(np.asarray(updates["kernel"]) / -0.1 + lost, np.asarray(grads["kernel"]), atol=1e-6)
    assert np.abs(lost).max() > 0.1
    # A residual of the wrong shape names its leaf.
    bad = state._replace(residuals=dict(state.residuals, kernel=jnp.zeros((3,))))
    with pytest.raises(
        ValueError, match=r"onebit residual of leaf \['kernel'\] is float32\[3\], expected float32\[64, 32\]"
    ):
        tx.update(grads, bad, params)


def test_multisteps_sends_each_real_steps_mean_through_onebit(session):
    # MultiSteps with onebit: the k-th mini-step's mean goes through the same
    # onebit psum and feedback as distributed() would send it (one worker here,
    # so the sum is the encoding of that mean); the other mini-steps send nothing.
    every = 3
    params = {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32)}
    rng = np.random.default_rng(0)
    grads = [
        {
            "kernel": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
            "bias": jnp.asarray(rng.standard_normal(32), jnp.float32),
        }
        for _ in range(3 * every)
    ]
    ms = jbps.optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every, compression="onebit", name="ms")
    ref = jbps.optax.distributed(optax.sgd(0.1, momentum=0.9), compression="onebit", name="ref")
    ms_state, ref_state = ms.init(params), ref.init(params)
    assert isinstance(ms_state.inner_opt_state, jbps.optax.FeedbackState)
    ms_update, ref_update = jax.jit(ms.update), jax.jit(ref.update)
    calls = jbps.engine_stats()["calls"]
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    acc = zeros
    for i, g in enumerate(grads):
        updates, ms_state = jax.block_until_ready(ms_update(g, ms_state, params))
        acc = jax.tree_util.tree_map(lambda a, x: a + (x - a) / jnp.float32(i % every + 1), acc, g)
        if i % every < every - 1:
            for u in jax.tree_util.tree_leaves(updates):
                assert not np.asarray(u).any()
            continue
        real_steps = (i + 1) // every  # one call per real step, and the reference's before this one
        assert jbps.engine_stats()["calls"] - calls == real_steps + (real_steps - 1)
        expected, ref_state = jax.block_until_ready(ref_update(acc, ref_state, params))
        acc = zeros
        for name in params:
            np.testing.assert_allclose(np.asarray(updates[name]), np.asarray(expected[name]), rtol=1e-5, atol=1e-6)
            got, want = ms_state.inner_opt_state.residuals[name], ref_state.residuals[name]
            if want is None:  # a leaf too small for onebit keeps no residual
                assert got is None, name
                continue
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(ms_state.inner_opt_state.residuals["kernel"])).max() > 0.1  # onebit did lose something
