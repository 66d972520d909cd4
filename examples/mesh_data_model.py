"""Data and model parallelism on a 2-D mesh: a small MLP learning a random
teacher network, its batch split over "data" (the workers times a local
axis), its hidden layer split over "model" (the other local axis, Megatron
style: the first layer's columns, the second's rows, a lax.psum over "model"
joining them). Gradients are averaged with jbps.pmean over "data" only: over
the local data devices and every worker, each model shard apart.

    python examples/mesh_data_model.py
    jbps run -n 2 --local-devices 4 python examples/mesh_data_model.py
    mpirun -np 2 python examples/mesh_data_model.py

Every worker then trains the same model on one device, on the whole batch of
the job, and checks the parameters against the distributed run's. Prints the
loss going down, that check, and the communication share of step time.
"""

import argparse
import os
import sys
import time

# Four CPU devices when none are set (jbps run --local-devices sets its own).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jbps  # noqa: E402

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # older jax (0.5) has it in jax.experimental
    from jax.experimental.shard_map import shard_map

# How each parameter is split: hidden units over "model", nothing over "data".
PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def init_params(key, dims):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (dims[0], dims[1])) / np.sqrt(dims[0]),
        "b1": jnp.zeros(dims[1]),
        "w2": jax.random.normal(k2, (dims[1], dims[2])) / np.sqrt(dims[1]),
        "b2": jnp.zeros(dims[2]),
    }


def forward(params, x):
    """On one device: its rows of the batch, its hidden units. On one device
    holding every hidden unit (the reference) the psum is left out."""
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def make_batch(seed, step, worker, batch, teacher):
    x = np.random.default_rng([seed, step, worker]).standard_normal((batch, teacher["w1"].shape[0]))
    x = x.astype(np.float32)
    return x, np.asarray(forward(teacher, x) + teacher["b2"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=int, default=2, help="devices the hidden layer is split over")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--dims", default="16,64,4", help="input, hidden, output")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dims = [int(d) for d in args.dims.split(",")]

    jbps.init()
    rank, workers = jbps.rank(), jbps.size()
    devices = jax.local_devices()
    if len(devices) % args.model or dims[1] % args.model:
        sys.exit(f"--model {args.model} must divide the {len(devices)} local devices and the hidden size {dims[1]}")
    local_data = len(devices) // args.model
    if args.batch_size % local_data:
        sys.exit(f"--batch-size {args.batch_size} must split over the {local_data} local data devices")
    mesh = Mesh(np.array(devices).reshape(local_data, args.model), ("data", "model"))

    def device_forward(params, x):
        return lax.psum(forward(params, x), "model") + params["b2"]

    predict = shard_map(device_forward, mesh=mesh, in_specs=(PARAM_SPECS, P("data")), out_specs=P("data"))

    def loss_fn(params, x, y):  # this worker's share of the batch
        return jnp.mean((predict(params, x) - y) ** 2)

    # Each local data device holds this worker's whole gradient (jax's AD has
    # summed it over the local "data" axis already), so the mean over "data"
    # (local devices and workers) is the mean of the workers' gradients: the
    # gradient of the job's mean loss. The result is typed replicated over
    # "data", which the out_specs state (shard_map checks it).
    average = shard_map(lambda g: jbps.pmean(g, "data"), mesh=mesh, in_specs=(PARAM_SPECS,), out_specs=PARAM_SPECS)
    tx = optax.sgd(args.lr, momentum=0.9)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(average(grads), opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    teacher = init_params(jax.random.PRNGKey(args.seed + 1), dims)
    start_params = init_params(jax.random.PRNGKey(args.seed), dims)  # the same on every worker
    shardings = {k: NamedSharding(mesh, s) for k, s in PARAM_SPECS.items()}
    params = jax.device_put(start_params, shardings)
    opt_state = tx.init(params)
    losses, busy, start = [], None, None
    for i in range(args.steps):
        x, y = make_batch(args.seed, i, rank, args.batch_size, teacher)
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
        if i == 0:  # timing from the second step: the first compiles (the loss does not wait for the psum)
            jax.block_until_ready(params)
            busy, start = jbps.engine_stats()["busy_seconds"], time.perf_counter()
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - start
    comm = jbps.engine_stats()["busy_seconds"] - busy
    print(
        f"worker {rank}: mesh data {local_data} x model {args.model} on each of {workers} worker(s); "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; communication {100 * comm / max(elapsed, 1e-9):.0f}% "
        f"of step time",
        flush=True,
    )

    # One process, one device, the job's whole batch: what the run must equal.
    @jax.jit
    def reference_step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jnp.mean((forward(p, x) + p["b2"] - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    ref, ref_state = start_params, tx.init(start_params)
    for i in range(args.steps):
        batches = [make_batch(args.seed, i, w, args.batch_size, teacher) for w in range(workers)]
        ref, ref_state = reference_step(
            ref, ref_state, np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])
        )
    diff = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(ref))
    )
    scale = max(float(jnp.max(jnp.abs(b))) for b in jax.tree.leaves(ref))
    ok = diff <= 1e-4 * scale
    print(
        f"worker {rank}: parameters vs one process on the whole batch: max difference {diff:.2e} "
        f"({'match' if ok else 'MISMATCH'})",
        flush=True,
    )
    jbps.shutdown()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
