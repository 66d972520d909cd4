"""A worker of the checkpoint tests (tests/test_checkpoints.py): trains a
flax MLP with jbps.optax.distributed(optax.adam, compression=...) for --steps
steps, resuming from --restore when given, and saving to --save (rank 0).

--format orbax: the TrainState through orbax's StandardCheckpointer (flax's
default); msgpack: flax.serialization's bytes. --restore-compression: the
compression the checkpoint was saved with, when it differs from --compression
(the state is restored as that optimizer made it, then converted with
jbps.optax.switch_compression). Every worker trains on its share of the same
global batches, step by step (the step number is in the state), so a run
resumed from a checkpoint sees the batches a run without one would.

Prints one JSON line: {"rank", "step", "loss", "params": {path: [values]}}.
"""

import argparse
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from flax.training import train_state

import jbps

BATCH, FEATURES = 16, 12


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(48)(x))  # a 12 x 48 kernel: 576 values, too few to compress
        x = nn.tanh(nn.Dense(64)(x))  # 48 x 64 = 3072 values: travels compressed
        return nn.Dense(3)(x)


def batch(step, rank, workers):
    rng = np.random.default_rng([5, step])
    x = rng.standard_normal((BATCH * workers, FEATURES)).astype(np.float32)
    y = (x[:, :3] * 2.0 - x[:, 3:6]).astype(np.float32)
    return x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]


def loss_fn(params, x, y):
    return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)


def make_state(compression, name):
    params = MLP().init(jax.random.PRNGKey(0), jnp.zeros((1, FEATURES)))["params"]
    tx = jbps.optax.distributed(optax.adam(1e-2), compression=compression, name=name)
    return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)


def save(state, path, fmt):
    if fmt == "orbax":
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.abspath(path), state)
            checkpointer.wait_until_finished()
    else:
        with open(path, "wb") as f:
            f.write(serialization.to_bytes(state))


def restore(target, path, fmt):
    if fmt == "orbax":
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(os.path.abspath(path), target)
    with open(path, "rb") as f:
        return serialization.from_bytes(target, f.read())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--compression", default=None)
    p.add_argument("--restore-compression", default="same")
    p.add_argument("--restore")
    p.add_argument("--save")
    p.add_argument("--format", choices=("orbax", "msgpack"), default="orbax")
    args = p.parse_args()
    compression = None if args.compression in (None, "none") else args.compression
    saved_with = compression if args.restore_compression == "same" else args.restore_compression
    saved_with = None if saved_with == "none" else saved_with

    jbps.init()
    rank, workers = jbps.rank(), jbps.size()
    state = make_state(compression, "ckpt")
    if args.restore:
        # As the optimizer that saved it made it, then as this one needs it.
        target = make_state(saved_with, "ckpt")
        restored = restore(target, args.restore, args.format)
        opt_state = jbps.optax.switch_compression(restored.opt_state, restored.params, compression)
        state = state.replace(step=restored.step, params=restored.params, opt_state=opt_state)

    @jax.jit
    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    loss = None
    for _ in range(args.steps):
        x, y = batch(int(state.step), rank, workers)
        state, loss = train_step(state, x, y)
    state = jax.block_until_ready(state)
    if args.save and rank == 0:
        save(state, args.save, args.format)
    flat = {
        jax.tree_util.keystr(k): np.asarray(v).ravel()[:8].tolist()
        for k, v in jax.tree_util.tree_leaves_with_path(state.params)
    }
    print(
        json.dumps(
            {"rank": rank, "step": int(state.step), "loss": None if loss is None else float(loss), "params": flat}
        )
    )
    jbps.shutdown()


if __name__ == "__main__":
    main()
