"""jbps.optax.distributed and jbps.broadcast: against one process on the full
batch, against optax without jbps, and bit for bit across workers."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jbps
from conftest import last_json, run_job, worker_script

DEVICES = 4  # conftest gives the test process 4 host devices


# --- data-parallel equals one process on the full batch (real processes) ---


def _load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def reference_params(tmp_path_factory):
    """SGD and Adam, one process, the whole batch, no jbps."""
    out = str(tmp_path_factory.mktemp("reference") / "{opt}.npz")
    subprocess.run(
        [sys.executable, worker_script("optax_equivalence.py"), "--reference", "--out", out],
        check=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return {opt: _load(out.format(opt=opt, rank=0)) for opt in ("sgd", "adam")}


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_two_workers_end_where_one_process_on_the_full_batch_ends(tmp_path, reference_params, mode):
    # jit: one device per worker; pmap: two, each a quarter of the global batch.
    out = str(tmp_path / "{opt}-rank{rank}.npz")
    results = run_job(
        [worker_script("optax_equivalence.py"), "--mode", mode, "--out", out],
        workers=2,
        servers=2,
        devices=2 if mode == "pmap" else 1,
        timeout_s=150,
    )
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
    for opt, reference in reference_params.items():
        ranks = [_load(out.format(opt=opt, rank=r)) for r in range(2)]
        assert set(reference) == set(ranks[0]) == set(ranks[1])
        for name in reference:
            np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=f"{opt}: workers differ at {name}")
            np.testing.assert_allclose(ranks[0][name], reference[name], rtol=2e-5, atol=2e-6, err_msg=f"{opt} {name}")


# --- composition with optax, in one process over 4 local devices ---


def _grads_per_device(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "kernel": rng.standard_normal((DEVICES, 6, 3)).astype(np.float32),
            "bias": rng.standard_normal((DEVICES, 3)).astype(np.float32),
        },
        "head": rng.standard_normal((DEVICES, 5)).astype(np.float32),
    }


def _params():
    return {
        "dense": {"kernel": np.ones((6, 3), np.float32), "bias": np.zeros(3, np.float32)},
        "head": np.full(5, 0.5, np.float32),
    }


def _replicate(tree):
    return jax.tree_util.tree_map(lambda x: np.stack([x] * DEVICES), tree)


def _reference(tx, grads_per_step):
    """optax alone, on the mean over devices (what the job's pmean gives)."""
    params, state = _params(), tx.init(_params())
    for g in grads_per_step:
        mean = jax.tree_util.tree_map(lambda x: x.mean(0), g)
        updates, state = tx.update(mean, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture
def steps():
    return [_grads_per_device(s) for s in range(6)]


def _step_fn(tx):
    # pmap with a named axis, which distributed(..., axis_name="i") reduces over.
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.pmap(step, axis_name="i")


def _train(tx, steps):
    params = _replicate(_params())
    state = jax.pmap(tx.init, axis_name="i")(params)
    step = _step_fn(tx)
    for g in steps:
        params, state = step(params, state, g)
    return jax.tree_util.tree_map(lambda x: np.asarray(x[0]), params), state


def test_distributed_adam_matches_optax_on_the_mean_gradient(session, steps):
    got, state = _train(jbps.optax.distributed(optax.adam(0.05), axis_name="i"), steps)
    _close(got, _reference(optax.adam(0.05), steps))
    # The state is the wrapped optimizer's own, so checkpoints move between the two.
    plain = jax.tree_util.tree_structure(optax.adam(0.05).init(_params()))
    assert jax.tree_util.tree_structure(jax.tree_util.tree_map(lambda x: x[0], state)) == plain


def test_sum_instead_of_average(session, steps):
    got, _ = _train(jbps.optax.distributed(optax.sgd(0.01), axis_name="i", average=False), steps)
    summed = [jax.tree_util.tree_map(lambda x: x * DEVICES, g) for g in steps]
    _close(got, _reference(optax.sgd(0.01), summed))


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_multisteps_communicates_once_per_real_step(session, steps, inner):
    every = 3
    make = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(0.05)}[inner]
    tx = jbps.optax.MultiSteps(make(), every, axis_name="i")
    calls_before = jbps.engine_stats()["calls"]
    got, _ = _train(tx, steps)
    # One custom call per device per real step, none on the other mini-steps.
    assert jbps.engine_stats()["calls"] - calls_before == DEVICES * (len(steps) // every)
    _close(got, _reference(optax.MultiSteps(make(), every_k_schedule=every), steps))


def test_optax_multisteps_around_distributed_is_correct(session, steps):
    # Correct, but optax runs the inner update (and so the psum) every mini-step.
    tx = optax.MultiSteps(jbps.optax.distributed(optax.adam(0.05), axis_name="i"), every_k_schedule=3)
    got, _ = _train(tx, steps)
    _close(got, _reference(optax.MultiSteps(optax.adam(0.05), every_k_schedule=3), steps))


def test_multisteps_rejects_a_schedule():
    with pytest.raises(TypeError, match="every_k_schedule must be a positive int"):
        jbps.optax.MultiSteps(optax.sgd(0.1), lambda step: 2)


def test_masked_sends_only_the_masked_leaves(session, steps):
    mask = {"dense": {"kernel": True, "bias": False}, "head": True}
    tx = optax.masked(jbps.optax.distributed(optax.sgd(0.1), axis_name="i"), mask)
    bytes_before = jbps.engine_stats()["bytes_pushed"]
    _train(tx, steps)
    # Each worker sends the masked leaves once (each device a quarter), padded
    # to a multiple of the 4 devices: kernel 18 -> 20 floats, head 5 -> 8.
    masked_bytes = (20 + 8) * 4
    assert jbps.engine_stats()["bytes_pushed"] - bytes_before == masked_bytes * len(steps)


def test_inject_hyperparams(session, steps):
    tx = optax.inject_hyperparams(
        lambda learning_rate: jbps.optax.distributed(optax.sgd(learning_rate), axis_name="i")
    )(learning_rate=0.2)
    got, state = _train(tx, steps)
    assert float(state.hyperparams["learning_rate"][0]) == pytest.approx(0.2)
    _close(got, _reference(optax.sgd(0.2), steps))


def test_chain_with_psum_gradients_equals_distributed(session, steps):
    chained, _ = _train(
        optax.chain(jbps.optax.psum_gradients("i"), optax.clip_by_global_norm(1.0), optax.adam(0.05)), steps
    )
    _close(chained, _reference(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05)), steps))


def test_distributed_optimizer_alias():
    assert jbps.DistributedOptimizer is jbps.optax.distributed


# --- broadcast ---


@pytest.mark.parametrize("modes,devices,x64", [("eager,jit,host", 1, True), ("pmap", 2, False)])
def test_broadcast_gives_every_worker_the_roots_bits(modes, devices, x64):
    # Each worker checks its bits against the root's tree rebuilt by numpy.
    env = {"JAX_ENABLE_X64": "1"} if x64 else None
    results = run_job(
        [worker_script("broadcast_check.py"), "--root", "1", "--modes", modes],
        workers=3,
        servers=2,
        devices=devices,
        env=env,
        timeout_s=120,
    )
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
    reports = [last_json(r.stdout) for r in results]
    for mode in modes.split(","):
        assert len({rep["digests"][mode] for rep in reports}) == 1
    assert reports[0]["leaves"] == (13 if x64 else 10)


def test_broadcast_keeps_negative_zero_and_nan_payloads(session):
    bits = np.array([0x80000000, 0x7FC00123, 0xFFFFFFFF, 1], np.uint32)
    tree = {"f32": bits.view(np.float32), "bf16": np.array([-0.0, np.nan], jnp.bfloat16), "b": np.array([True])}
    got = jax.device_get(jbps.broadcast(tree))
    assert np.asarray(got["f32"]).view(np.uint32).tolist() == bits.tolist()
    assert np.asarray(got["bf16"]).tobytes() == tree["bf16"].tobytes()
    assert got["b"].dtype == np.bool_ and got["b"].tolist() == [True]


def test_broadcast_rejects_a_bad_root_and_dtype_naming_them(session):
    with pytest.raises(ValueError, match="root 1 is out of range for 1 workers"):
        jbps.broadcast({"w": np.ones(3, np.float32)}, root=1)
    with pytest.raises(TypeError, match=r"root must be a worker rank"):
        jbps.broadcast({"w": np.ones(3, np.float32)}, root="0")
    with pytest.raises(TypeError, match=r"leaf \['c'\] has dtype complex64"):
        jbps.broadcast({"w": np.ones(3, np.float32), "c": np.ones(2, np.complex64)})
