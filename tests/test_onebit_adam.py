"""jbps.optax.onebit_adam: Adam whose step direction travels compressed
after an uncompressed warm-up. Its warm-up against optax's AdamW, the
compressed steps against the pieces they are made of (psum_with_feedback and
Adam's formula with nu frozen), the arguments it refuses, and a two-worker
fit whose workers end with the same parameters and a loss near AdamW's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jbps
from conftest import last_json, run_job, worker_script
from jbps.ops.psum import psum_with_feedback


def _problem(seed):
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(48, 32)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=32), jnp.float32),
    }
    grads = [
        jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(6)
    ]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_its_warm_up_is_adamw(session):
    params, grads = _problem(0)
    mine, _ = _run(jbps.optax.onebit_adam(0.01, warmup_steps=10, weight_decay=0.1, name="warm"), params, grads)
    ref, _ = _run(optax.adamw(0.01, weight_decay=0.1), params, grads)
    for a, b in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec", ["onebit", "topk"])
def test_after_the_warm_up_nu_stays_and_the_step_direction_travels_compressed(session, codec):
    # Two warm-up steps, then one compressed: its moments and update from the
    # pieces, with a psum of its own (a new name: the servers' residuals are
    # zero for both, as for any key's first round).
    params, grads = _problem(1)
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    tx = jbps.optax.onebit_adam(lr, warmup_steps=2, compression=codec, name=f"after-{codec}")
    warm_params, warm_state = _run(tx, params, grads[:2])
    updates, state = jax.jit(tx.update)(grads[2], warm_state, warm_params)
    before, after = warm_state[0], state[0]
    assert int(after.count) == 3
    for v0, v1 in zip(jax.tree_util.tree_leaves(before.nu), jax.tree_util.tree_leaves(after.nu)):
        assert np.array_equal(np.asarray(v0), np.asarray(v1))  # frozen
    denom = jax.tree_util.tree_map(lambda v: jnp.sqrt(v / (1 - b2**2)) + eps, before.nu)
    bound = (1 - b1) / np.sqrt(1 - b2)
    local = jax.tree_util.tree_map(
        lambda m, g, d: jnp.clip((b1 * m + (1 - b1) * g) / d, -bound, bound), before.mu, grads[2], denom
    )
    steps, residuals = jax.jit(
        lambda t, r: psum_with_feedback(t, r, average=True, compression=codec, name=f"after-{codec}-ref")
    )(local, before.residuals)
    # (XLA fuses the momentum differently in the two programs: the last bit may differ.)
    for got, want in zip(jax.tree_util.tree_leaves(after.residuals), jax.tree_util.tree_leaves(residuals)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.asarray(residuals["w"]).any()  # the kernel travels compressed, and something stayed behind
    mu = jax.tree_util.tree_map(jnp.multiply, steps, denom)
    for got, want in zip(jax.tree_util.tree_leaves(after.mu), jax.tree_util.tree_leaves(mu)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    expected = jax.tree_util.tree_map(
        lambda m, v: -lr * (m / (1 - b1**3)) / (jnp.sqrt(v / (1 - b2**2)) + eps), mu, before.nu
    )
    for got, want in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"warmup_steps": 0}, "warmup_steps must be a whole number of steps, at least 1, got 0"),
        ({"warmup_steps": 2.5}, "warmup_steps must be a whole number of steps, at least 1, got 2.5"),
        ({"warmup_steps": True}, "warmup_steps must be a whole number of steps, at least 1, got True"),
        ({"warmup_steps": 5, "b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
        ({"warmup_steps": 5, "b2": -0.1}, r"b2 must be in \[0, 1\), got -0.1"),
        (
            {"warmup_steps": 5, "compression": "fp16"},
            "compression must be 'onebit', 'topk' or 'topk:FRACTION', got 'fp16'",
        ),
        ({"warmup_steps": 5, "compression": "topk:2"}, "topk's fraction must be a number in"),
    ],
)
def test_bad_arguments_are_refused_when_it_is_built(kwargs, message):
    with pytest.raises(ValueError, match=f"^jbps.optax.onebit_adam: .*{message}"):
        jbps.optax.onebit_adam(0.01, **kwargs)


@pytest.mark.parametrize("codec", ["onebit", "topk"])
def test_two_workers_end_with_the_same_parameters_and_fit(codec):
    results = run_job([worker_script("onebit_adam_fit.py"), "--codec", codec], workers=2, servers=2, timeout_s=240)
    reports = [last_json(r.stdout) for r in results]
    for rep in reports:
        assert rep["error"] is None, rep
        assert rep["count"] == 300
    assert reports[0]["shared"] == reports[1]["shared"], reports  # parameters, mu, nu: bit for bit
    rep = reports[0]
    assert rep["after_warmup"] < rep["start"] / 100, rep
    if codec == "onebit":
        # The compressed steps go on down (measured 0.33 -> 0.011; AdamW in
        # float32 reaches 1e-4, the noise's floor).
        assert rep["final"] < rep["after_warmup"] / 10, rep
    else:
        # Top-k sends a coordinate's steps late and at once: on this fit at
        # this rate it stalls near the warm-up's loss (measured 0.53).
        assert rep["final"] < rep["start"] / 50, rep
