"""Saving and restoring (docs/guide/checkpoints.md): a TrainState whose
optimizer is jbps.optax.distributed, with and without compression, saved with
orbax (flax's default checkpointer) and flax's msgpack, moved between a job of
2 workers and one process and back; a resumed run equals one that never
stopped; a checkpoint restored into an optimizer of another compression is
converted, or refused in one line saying how."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jbps
from conftest import last_json, run_job, worker_script


def job(tmp_path, workers, *args):
    results = run_job([worker_script("checkpoint.py"), *args], workers=workers, servers=workers, timeout_s=240)
    for r in results:
        assert r.returncode == 0, f"worker {r.rank}:\n{r.stderr[-3000:]}"
    return [last_json(r.stdout) for r in results]


# The tests after the round trips save with msgpack: orbax's imports cost a job ~2 s.
MSGPACK = ("--format", "msgpack")


# Each format and each kind of optimizer state once (onebit's residuals and
# moments, plain optax's), in pairs: a job of 3 runs per case is CI's dearest.
@pytest.mark.parametrize("fmt,compression", [("orbax", "onebit"), ("msgpack", "none")])
def test_a_checkpoint_moves_between_two_workers_and_one_process_and_back(tmp_path, fmt, compression):
    first, second = str(tmp_path / f"a.{fmt}"), str(tmp_path / f"b.{fmt}")
    common = ["--compression", compression, "--format", fmt]
    trained = job(tmp_path, 2, "--steps", "6", "--save", first, *common)
    assert trained[0]["params"] == trained[1]["params"]  # every worker holds the same parameters
    # One process restores it exactly, trains on, and saves.
    alone = job(tmp_path, 1, "--steps", "0", "--restore", first, *common)[0]
    assert alone["step"] == 6 and alone["params"] == trained[0]["params"]
    job(tmp_path, 1, "--steps", "4", "--restore", first, "--save", second, *common)
    # And two workers take that up again.
    back = job(tmp_path, 2, "--steps", "3", "--restore", second, *common)
    assert [r["step"] for r in back] == [13, 13] and back[0]["params"] == back[1]["params"]
    assert all(np.isfinite(r["loss"]) for r in back)


def test_a_resumed_run_ends_where_one_that_never_stopped_ends(tmp_path):
    # Without compression every sum is exact and the state holds all there is:
    # 6 steps, a checkpoint, 4 more steps in a new job = 10 steps at once.
    ckpt = str(tmp_path / "mid")
    straight = job(tmp_path, 2, "--steps", "10")
    job(tmp_path, 2, "--steps", "6", "--save", ckpt, *MSGPACK)
    resumed = job(tmp_path, 2, "--steps", "4", "--restore", ckpt, *MSGPACK)
    assert resumed[0]["step"] == straight[0]["step"] == 10
    assert resumed[0]["params"] == straight[0]["params"]


@pytest.mark.parametrize("saved,now", [("onebit", "none"), ("none", "onebit"), ("onebit", "topk")])
def test_a_checkpoint_restores_into_an_optimizer_of_another_compression(tmp_path, saved, now):
    ckpt = str(tmp_path / "ckpt")
    job(tmp_path, 2, "--steps", "5", "--compression", saved, "--save", ckpt, *MSGPACK)
    resumed = job(
        tmp_path, 2, "--steps", "3", "--restore", ckpt, "--restore-compression", saved, "--compression", now, *MSGPACK
    )
    assert [r["step"] for r in resumed] == [8, 8] and np.isfinite(resumed[0]["loss"])


def test_a_state_of_the_other_compression_is_refused_saying_how_to_convert_it(session):
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32)}
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    plain = jbps.optax.distributed(optax.sgd(0.1), name="ckpt-plain")
    onebit = jbps.optax.distributed(optax.sgd(0.1), compression="onebit", name="ckpt-onebit")
    with pytest.raises(ValueError, match=r"holds error-feedback residuals.*keeps none.*switch_compression"):
        plain.update(grads, onebit.init(params), params)
    with pytest.raises(ValueError, match=r"has no error-feedback residuals.*needs them.*switch_compression"):
        onebit.update(grads, plain.init(params), params)
    # The conversion both ways: tx's own state, then with zero residuals for the compressed leaves.
    converted = jbps.optax.switch_compression(onebit.init(params), params, None)
    assert jax.tree_util.tree_structure(converted) == jax.tree_util.tree_structure(plain.init(params))
    back = jbps.optax.switch_compression(converted, params, "onebit")
    assert back.residuals["b"] is None and np.array_equal(np.asarray(back.residuals["w"]), np.zeros((64, 32)))


def test_the_onebit_state_holds_no_array_of_zero_size(session):
    # orbax refuses to save arrays of zero size: the leaves that travel as they
    # are have no residual at all (None), not an empty one.
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones(32), "n": jnp.ones(3, jnp.int32)}
    state = jbps.optax.distributed(optax.adam(1e-3), compression="onebit", name="ckpt-sizes").init(params)
    assert all(np.size(leaf) > 0 for leaf in jax.tree_util.tree_leaves(state))
    assert state.residuals["b"] is None and state.residuals["n"] is None


def test_an_nnx_optimizers_pure_dict_round_trips_through_orbax(session, tmp_path):
    # flax nnx: nnx.to_pure_dict of the model and its nnx.Optimizer (a onebit
    # one, with its residuals), saved and restored into a fresh pair.
    import inspect

    import orbax.checkpoint as ocp
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(40, 64, rngs=rngs)  # 2,560 values: travels compressed
            self.b = nnx.Linear(64, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    def make():
        model = Model(nnx.Rngs(0))
        tx = jbps.optax.distributed(optax.adam(1e-2), compression="onebit", name="nnx-ckpt")
        wrt = {"wrt": nnx.Param} if "wrt" in inspect.signature(nnx.Optimizer.__init__).parameters else {}
        return model, nnx.Optimizer(model, tx, **wrt)

    model, optimizer = make()

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        if "model" in inspect.signature(optimizer.update).parameters:  # flax >= 0.11
            optimizer.update(model, grads)
        else:
            optimizer.update(grads)
        return loss

    x, y = jnp.linspace(-1, 1, 320).reshape(8, 40), jnp.ones((8, 3))
    for _ in range(3):
        step(model, optimizer, x, y)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(tmp_path / "nnx"), nnx.to_pure_dict(nnx.state((model, optimizer))))
        checkpointer.wait_until_finished()
    model2, optimizer2 = make()
    state = nnx.state((model2, optimizer2))
    with ocp.StandardCheckpointer() as checkpointer:
        nnx.replace_by_pure_dict(state, checkpointer.restore(str(tmp_path / "nnx"), nnx.to_pure_dict(state)))
    nnx.update((model2, optimizer2), state)
    saved, restored = nnx.state((model, optimizer)), nnx.state((model2, optimizer2))
    for a, b in zip(jax.tree_util.tree_leaves(saved), jax.tree_util.tree_leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(float(step(model2, optimizer2, x, y)))  # and trains on
