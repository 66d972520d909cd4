"""A small CNN on scikit-learn's 8x8 digits (bundled, no download), trained
data-parallel with jbps: flax.linen, a TrainState whose optimizer is
jbps.optax.distributed(optax.adam(...)), and rank 0's initial parameters
broadcast to every worker.

    python examples/mnist_flax.py                  # alone: one worker
    jbps run -n 2 python examples/mnist_flax.py    # two workers on this machine
    mpirun -np 2 python examples/mnist_flax.py     # the same under MPI
    jbps run -n 2 python examples/mnist_flax.py --compression onebit --optimizer sgd
                                                   # gradients at 1/25.6 of their bytes
    jbps run -n 2 python examples/mnist_flax.py --compression onebit
                                                   # Adam: jbps.optax.onebit_adam (1-bit Adam)

Every worker trains on its share of each global batch; the gradients are
averaged over the job by the summation servers, so each worker applies the
same update and the parameters stay identical. Prints the test accuracy.

The servers' closing lines show uneven loads (with 2 servers, about 265 and 41
MiB): chunks are the unit of routing, and this model's largest tensor, the
first Dense kernel (512 KiB), is smaller than a partition (JBPS_PARTITION_BYTES,
1 MiB on one host by default), so it travels whole to one server.
JBPS_PARTITION_BYTES=256K splits it (about 136 and 170 MiB).
"""

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jbps


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


def load_data(seed):
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (N, 8, 8, 1) in [0, 1]
    return train_test_split(
        images, digits.target.astype(np.int32), test_size=0.2, random_state=seed, stratify=digits.target
    )


def loss_fn(params, apply_fn, x, y):
    logits = apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, x, y)
    return state.apply_gradients(grads=grads), loss  # the optimizer averages grads over the job


@jax.jit
def accuracy(state, x, y):
    return jnp.mean(jnp.argmax(state.apply_fn({"params": state.params}, x), -1) == y)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over the workers")
    p.add_argument(
        "--compression",
        metavar="{bf16,fp16,onebit,topk,topk:FRACTION}",
        default=None,
        help="gradients on the wire (default: float32 as computed); topk:0.05 keeps 51 of every 1024 "
        "values, where topk keeps 10 (jbps.optax.distributed checks the value)",
    )
    p.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="sgd: with momentum 0.9 (what onebit compression suits best)",
    )
    p.add_argument("--lr", type=float, default=None, help="default: 2e-3 for adam, 0.05 for sgd")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    jbps.init()
    rank, workers = jbps.rank(), jbps.size()
    if args.batch_size % workers:
        p.error(f"--batch-size {args.batch_size} does not split over {workers} workers")
    x_train, x_test, y_train, y_test = load_data(args.seed)
    per_worker = args.batch_size // workers

    model = CNN()
    params = model.init(jax.random.PRNGKey(args.seed), x_train[:1])["params"]
    order = jbps.forward_order(params)  # from init's insertion order: first layers are sent first
    params = jbps.broadcast_parameters(params)  # every worker starts from rank 0's parameters
    steps_per_epoch = len(x_train) // args.batch_size
    if args.optimizer == "adam" and args.compression not in (None, "bf16", "fp16"):
        # onebit, topk: Adam's first moment travels compressed after a warm-up of a fifth of the steps
        warmup = max(1, round(args.epochs * steps_per_epoch * 0.2))
        tx = jbps.optax.onebit_adam(args.lr or 2e-3, warmup_steps=warmup, priority=order, compression=args.compression)
    else:
        opt = optax.adam(args.lr or 2e-3) if args.optimizer == "adam" else optax.sgd(args.lr or 0.05, momentum=0.9)
        tx = jbps.optax.distributed(opt, priority=order, compression=args.compression)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    # A bar on a terminal only (disable=None: tqdm's test for one); piped, as
    # under jbps run, its redraws would pile up into one long line, so rank 0
    # prints a line per epoch instead.
    progress = tqdm(
        total=args.epochs * steps_per_epoch, disable=None if rank == 0 else True, desc=f"{workers} worker(s)"
    )
    busy_before, start = jbps.engine_stats()["busy_seconds"], time.perf_counter()
    for epoch in range(args.epochs):
        order = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))  # same on every worker
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            mine = batch[rank * per_worker : (rank + 1) * per_worker]
            state, loss = train_step(state, x_train[mine], y_train[mine])
            progress.update()
        progress.set_postfix(epoch=epoch + 1, loss=f"{float(loss):.3f}")
        if rank == 0 and progress.disable:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {float(loss):.3f}", flush=True)
    jax.block_until_ready(state.params)
    elapsed = time.perf_counter() - start
    share = jbps.communication_share(jbps.engine_stats()["busy_seconds"] - busy_before, elapsed)  # job-wide
    progress.close()

    test_accuracy = float(accuracy(state, x_test, y_test))
    if rank == 0:
        print(
            f"workers {workers}, {args.epochs} epochs of {steps_per_epoch} steps in {elapsed:.1f} s; "
            f"communication {share.communication:.0%} of step time"
        )
        print(f"test accuracy {test_accuracy:.4f}")
    jbps.shutdown()


if __name__ == "__main__":
    main()
