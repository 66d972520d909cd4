"""The throughput benchmark to run first: a ResNet-style network (flax.linen,
basic residual blocks, batch norm) on synthetic images, pmapped over this
worker's local devices, gradients averaged over the job by
jbps.optax.distributed(optax.sgd(...), axis_name="batch").

    python examples/resnet_synthetic.py
    jbps run -n 2 --local-devices 2 python examples/resnet_synthetic.py
    mpirun -np 2 python examples/resnet_synthetic.py

Prints images/s per worker and over the job, and the communication share of
step time. Batch-norm statistics stay local to each device, as in Horovod.
"""

import argparse
import time
from functools import partial
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jbps


class BasicBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train):
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = norm()(nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    widths: Sequence[int]
    blocks_per_stage: int
    classes: int

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)))
        for stage, width in enumerate(self.widths):
            for block in range(self.blocks_per_stage):
                x = BasicBlock(width, strides=2 if stage and block == 0 else 1)(x, train)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class TrainState(train_state.TrainState):
    batch_stats: Any


def train_step(state, images, labels):
    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, images, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates["batch_stats"]

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)  # grads averaged over the job
    return state, loss


def replicate(tree, devices):
    return jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * devices), tree)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps, after one warm-up step")
    p.add_argument("--batch-size", type=int, default=32, help="images per device per step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--widths", default="32,64,128", help="channels of each stage")
    p.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    p.add_argument("--classes", type=int, default=100)
    args = p.parse_args()

    jbps.init()
    rank, workers, devices = jbps.rank(), jbps.size(), jax.local_device_count()
    model = ResNet([int(w) for w in args.widths.split(",")], args.blocks, args.classes)
    shape = (args.batch_size, args.image_size, args.image_size, 3)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros(shape, jnp.float32))
    variables = jbps.broadcast_parameters(variables)  # every worker starts from rank 0's
    tx = jbps.optax.distributed(optax.sgd(0.1, momentum=0.9), axis_name="batch")
    state = TrainState.create(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=tx
    )
    step = jax.pmap(train_step, axis_name="batch")
    # Placed on the devices as the step's own outputs are: from host arrays the first step would
    # compile a program for them, and the next a second one for its own outputs (5 s here, timed).
    state = jax.pmap(lambda s: s, axis_name="batch")(replicate(state, devices))

    rng = np.random.default_rng(rank)
    images = rng.standard_normal((devices,) + shape).astype(np.float32)
    labels = rng.integers(0, args.classes, (devices, args.batch_size)).astype(np.int32)
    state, loss = step(state, images, labels)  # compiles
    jax.block_until_ready(loss)
    busy, start = jbps.engine_stats()["busy_seconds"], time.perf_counter()
    for _ in range(args.steps):
        state, loss = step(state, images, labels)
    jax.block_until_ready(loss)
    elapsed = time.perf_counter() - start
    # Job-wide: a worker's own busy time also counts its waits for slower workers.
    share = jbps.communication_share(jbps.engine_stats()["busy_seconds"] - busy, elapsed)

    per_worker = args.steps * devices * args.batch_size / elapsed
    count = sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))
    print(
        f"worker {rank}: {per_worker:.1f} images/s on {devices} device(s); "
        f"communication {share.communication:.0%} of step time, waiting for slower workers {share.waiting:.0%}",
        flush=True,
    )
    if rank == 0:
        print(
            f"total: {per_worker * workers:.1f} images/s over {workers} worker(s) "
            f"({count:,} parameters, {args.steps} steps, final loss {float(loss[0]):.3f})"
        )
    jbps.shutdown()


if __name__ == "__main__":
    main()
