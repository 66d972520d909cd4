"""The digits CNN as a JAX program of today is written: flax nnx, a mesh of the
machine's devices with a "data" axis, the batch placed with NamedSharding, a
plain nnx.jit step and nnx.Optimizer; no psum anywhere. jbps enters in one
line: jax.value_and_grad becomes jbps.value_and_grad, which averages the loss
and the gradients over the data axis's devices and every worker of the job.

    python examples/mnist_nnx_mesh.py                                   # alone
    jbps run -n 2 --local-devices 2 python examples/mnist_nnx_mesh.py   # 2 workers x 2 devices
    mpirun -np 2 python examples/mnist_nnx_mesh.py

Needs flax >= 0.11 (nnx modules are pytrees there) and jax.set_mesh (jax >= 0.7).
Prints the loss per epoch and the test accuracy.
"""

import argparse
import os
import time

# Two CPU devices when none are set (jbps run --local-devices sets its own).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import jbps  # noqa: E402


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(4 * 4 * 64, 128, rngs=rngs)
        self.dense2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        return self.dense2(nnx.relu(self.dense1(x.reshape((x.shape[0], -1)))))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = jbps.value_and_grad(loss_fn)(model, x, y)  # was: nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(model(x), -1) == y)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split over every device of the job")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    jbps.init()
    rank, workers = jbps.rank(), jbps.size()
    mesh = jax.make_mesh((jax.local_device_count(),), ("data",))
    per_worker = args.batch_size // workers
    if args.batch_size % workers or per_worker % jax.local_device_count():
        p.error(f"--batch-size {args.batch_size} does not split over {workers} workers x {mesh.size} devices")
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int32), test_size=0.2, random_state=args.seed, stratify=digits.target
    )

    with jax.set_mesh(mesh):
        model = CNN(nnx.Rngs(args.seed))
        nnx.update(model, jbps.broadcast_parameters(nnx.state(model)))  # every worker starts from rank 0's
        optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
        batch = NamedSharding(mesh, P("data"))
        steps_per_epoch = len(x_train) // args.batch_size
        start = time.perf_counter()
        for epoch in range(args.epochs):
            order = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))  # same on every worker
            for step in range(steps_per_epoch):
                mine = order[step * args.batch_size : (step + 1) * args.batch_size]
                mine = mine[rank * per_worker : (rank + 1) * per_worker]
                loss = train_step(model, optimizer, *jax.device_put((x_train[mine], y_train[mine]), batch))
                if step % 8 == 7:  # jax < 0.12 can deadlock multi-device steps sent back to back (docs/guide/loops.md)
                    jax.block_until_ready(loss)
            if rank == 0:
                print(f"epoch {epoch + 1}/{args.epochs}: loss {float(loss):.3f}", flush=True)
        elapsed = time.perf_counter() - start
        test_accuracy = float(accuracy(model, x_test, y_test))
    if rank == 0:
        print(f"workers {workers} x {mesh.size} devices, {args.epochs} epochs in {elapsed:.1f} s")
        print(f"test accuracy {test_accuracy:.4f}")
    jbps.shutdown()


if __name__ == "__main__":
    main()
