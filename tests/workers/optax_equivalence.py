"""Data-parallel training with jbps.optax.distributed must equal training on
the whole batch in one process.

As a worker of a job (the default): initialise with a seed of its own rank,
take rank 0's parameters with jbps.broadcast_parameters, then train a flax
TrainState on its share of every global batch (each local device a share of
that under --mode pmap). With --reference: no jbps at all, one process, one
device, the whole batch, seed 0. Either way the final parameters go to --out
(.npz) for the test to compare.
"""

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

GLOBAL_BATCH = 32
FEATURES = 12


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(16)(x))
        x = nn.tanh(nn.Dense(16)(x))
        return nn.Dense(3)(x)


def batches(steps):
    """The global batches, identical in every process."""
    rng = np.random.default_rng(1234)
    for _ in range(steps):
        x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
        yield x, (x[:, :3] * 2.0 - x[:, 3:6]).astype(np.float32)


def optimizer(name):
    return {"sgd": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(0.01)}[name]


def loss_fn(params, apply_fn, x, y):
    return jnp.mean((apply_fn({"params": params}, x) - y) ** 2)


def grad_step(state, x, y):
    grads = jax.grad(loss_fn)(state.params, state.apply_fn, x, y)
    return state.apply_gradients(grads=grads)


def replicate(tree, devices):
    """One copy per local device, stacked for pmap (device_put_replicated is
    gone from newer jax)."""
    return jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * devices), tree)


def init_params(seed):
    return MLP().init(jax.random.PRNGKey(seed), jnp.zeros((1, FEATURES)))["params"]


def reference(args, opt):
    state = train_state.TrainState.create(apply_fn=MLP().apply, params=init_params(0), tx=optimizer(opt))
    step = jax.jit(grad_step)
    for x, y in batches(args.steps):
        state = step(state, x, y)
    return state.params


def train(args, opt):
    import jbps

    rank, workers = jbps.rank(), jbps.size()
    params = jbps.broadcast_parameters(init_params(seed=rank))  # different until broadcast
    per_worker = GLOBAL_BATCH // workers
    if args.mode == "jit":
        tx = jbps.optax.distributed(optimizer(opt))
        state = train_state.TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)
        step = jax.jit(grad_step)
        for x, y in batches(args.steps):
            mine = slice(rank * per_worker, (rank + 1) * per_worker)
            state = step(state, x[mine], y[mine])
        params = state.params
    else:
        devices = jax.local_device_count()
        tx = jbps.optax.distributed(optimizer(opt), axis_name="d")
        state = train_state.TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)
        state = replicate(state, devices)
        step = jax.pmap(grad_step, axis_name="d")
        for x, y in batches(args.steps):
            mine = slice(rank * per_worker, (rank + 1) * per_worker)
            shape = (devices, per_worker // devices)
            state = step(state, x[mine].reshape(shape + x.shape[1:]), y[mine].reshape(shape + y.shape[1:]))
        replicas = jax.device_get(state.params)
        for leaf in jax.tree_util.tree_leaves(replicas):  # every local device holds the same parameters
            for d in range(1, devices):
                np.testing.assert_array_equal(leaf[0], leaf[d])
        params = jax.tree_util.tree_map(lambda a: a[0], replicas)
    return jax.block_until_ready(params)  # shutdown() fails psums still queued in XLA


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--opts", default="sgd,adam", help="optimizers to train with, one after the other")
    p.add_argument("--mode", choices=("jit", "pmap"), default="jit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reference", action="store_true")
    p.add_argument(
        "--out", required=True, help="where to write the final parameters (.npz); {opt} and {rank} are replaced"
    )
    args = p.parse_args()
    rank = 0
    if not args.reference:
        import jbps

        jbps.init()
        rank = jbps.rank()
    for opt in args.opts.split(","):
        params = reference(args, opt) if args.reference else train(args, opt)
        flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(args.out.format(opt=opt, rank=rank), **flat)
    if not args.reference:
        jbps.shutdown()


if __name__ == "__main__":
    main()
