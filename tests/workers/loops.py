"""A worker of the loop family (tests/test_loops.py): training loops as users
write them, every step dispatched right after the last, nothing waiting for a
result until the end, over every local device.

For each API (--apis: pmap, shard_map, jit over NamedSharding'ed arrays) it
runs --steps steps of each kind of step:
  plain    psum of a float32 vector and an int32 one
  buckets  a tree of several leaves larger than the bucket size (several calls)
  bf16     the same psum with compression="bf16"
  optax    a flax MLP trained with jbps.optax.distributed(adam)
and checks the end state against an independent reference: numpy for the
psums (inputs are small integers, so the sums are exact), for optax one
process training on the whole global batch with plain optax, no jbps.

Where jbps.cpu_loop_deadlock says this jax's CPU runtime deadlocks such loops
(jax < 0.12, several local CPU devices), the loop waits for a step's result
every WAIT_EVERY steps, as the docs advise; --no-waits drops that wait (the
stress script uses it to show what the wait avoids).

Prints one JSON line: {"rank", "apis", "steps", "waits_every"}.
"""

import argparse
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jbps
from jbps import cpu_loop_deadlock

BUCKET_BYTES = 8 << 10
FEATURES, BATCH_PER_DEVICE = 8, 4


def shard_map_fn():
    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    return fn


class Mapped:
    """One API's way of running a per-device step: `step(fn)` maps fn (which
    sees one device's values and may psum over AXIS), `put` lays per-device
    values out for it, `get` brings them back as [device, ...] numpy."""

    AXIS = "i"

    def __init__(self, api, devices):
        self.api, self.devices = api, devices
        self.mesh = Mesh(np.array(jax.local_devices()), (self.AXIS,))

    @property
    def axis(self):
        # Under plain jit the partitioner, not jbps, sums over the local devices.
        return None if self.api == "jit" else self.AXIS

    def step(self, fn):
        if self.api == "pmap":
            return jax.pmap(fn, axis_name=self.AXIS)
        unstack = lambda t: jax.tree_util.tree_map(lambda x: x[0], t)  # noqa: E731
        stack = lambda t: jax.tree_util.tree_map(lambda x: x[None], t)  # noqa: E731
        if self.api == "shard_map":
            return jax.jit(
                shard_map_fn()(lambda t: stack(fn(unstack(t))), mesh=self.mesh, in_specs=P("i"), out_specs=P("i"))
            )
        return jax.jit(jax.vmap(fn), out_shardings=NamedSharding(self.mesh, P("i")))

    def put(self, tree):
        if self.api == "pmap":
            return tree
        return jax.device_put(tree, NamedSharding(self.mesh, P("i")))

    @staticmethod
    def get(tree):
        return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def inputs(rank, device):
    """This device's psum inputs: small integers, so every push (times the
    step's multiplier, at most 64) and every partial sum of up to 4 local
    devices is exact in float32 and bfloat16: XLA adds a worker's devices in
    the wire type (bf16) before the push, the server adds in float32."""
    rng = np.random.default_rng([7, rank, device])
    return {
        "v": rng.integers(-1, 2, size=1000).astype(np.float32),
        "n": rng.integers(-50, 50, size=37).astype(np.int32),
    }


def tree_inputs(rank, device):
    rng = np.random.default_rng([8, rank, device])
    return {
        "a": rng.integers(-2, 3, size=3000).astype(np.float32),
        "b": rng.integers(-2, 3, size=(64, 50)).astype(np.float32),
        "c": rng.integers(-2, 3, size=5000).astype(np.float32),
        "n": rng.integers(-50, 50, size=300).astype(np.int32),
    }


def psum_loop(m, make, steps, waits, rank, workers, **psum_args):
    """State (t, acc); each step adds psum(x * (t + 1)) to acc. Returns acc per device and its reference."""
    L = m.devices

    def one(state):
        t, x, acc = state
        mult = (t + 1).astype(jnp.int32)
        y = jbps.psum(jax.tree_util.tree_map(lambda v: v * mult.astype(v.dtype), x), m.axis, **psum_args)
        return t + 1, x, jax.tree_util.tree_map(lambda a, b: a + b, acc, y)

    mine = [make(rank, d) for d in range(L)]
    x = jax.tree_util.tree_map(lambda *v: np.stack(v), *mine)
    acc = jax.tree_util.tree_map(np.zeros_like, x)
    state = m.put((np.zeros(L, np.int32), x, acc))
    step = m.step(one)
    for i in range(steps):
        state = step(state)
        if waits and (i + 1) % waits == 0:
            jax.block_until_ready(state)
    got = m.get(state[2])

    # Reference: what each device should hold, sum over the steps of the step's sum.
    every = [[make(w, d) for d in range(L)] for w in range(workers)]
    bf16 = psum_args.get("compression") == "bf16"
    want = []
    for d in range(L):
        if m.api == "jit":  # plain jit: each device's value summed over the workers only
            parts = [every[w][d] for w in range(workers)]
        else:  # over the workers and the local devices
            parts = [every[w][e] for w in range(workers) for e in range(L)]
        want.append(jax.tree_util.tree_map(lambda *v: _steps_sum(v, steps, bf16), *parts))
    return got, want


def _steps_sum(values, steps, bf16):
    """Sum over t = 1..steps of the psum of t * values: exact for these
    integers; with bf16 compression each step's sum of a float leaf is rounded
    to bfloat16 (the pushes, t * value, are exact in it)."""
    total = np.sum(np.stack(values).astype(np.float64), axis=0)
    acc = np.zeros_like(total)
    for t in range(1, steps + 1):
        step_sum = t * total
        if bf16 and values[0].dtype == np.float32:
            step_sum = step_sum.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        acc += step_sum
    return acc


def check_psum(name, got, want):
    for d, ref in enumerate(want):
        for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(ref)):
            np.testing.assert_array_equal(g[d], r.astype(g.dtype), err_msg=f"{name}: device {d}, leaf {path}")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.tanh(nn.Dense(16)(x)))


def batch(step, rank, device, workers, devices):
    """This device's share of step `step`'s global batch."""
    rng = np.random.default_rng([9, step])
    x = rng.standard_normal((workers * devices * BATCH_PER_DEVICE, FEATURES)).astype(np.float32)
    y = (x[:, :3] * 2.0 - x[:, 3:6]).astype(np.float32)
    i = (rank * devices + device) * BATCH_PER_DEVICE
    return x[i : i + BATCH_PER_DEVICE], y[i : i + BATCH_PER_DEVICE]


def loss(params, x, y):
    return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)


def optax_loop(m, steps, waits, rank, workers):
    L = m.devices
    params = MLP().init(jax.random.PRNGKey(0), jnp.zeros((1, FEATURES)))["params"]
    tx = jbps.optax.distributed(optax.adam(0.01), axis_name=m.axis)

    if m.api == "jit":
        # Plain jit over the mesh: the batch is sharded, the parameters replicated.
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        rep = NamedSharding(m.mesh, P())
        data = NamedSharding(m.mesh, P("i"))
        state = jax.device_put(state, rep)

        @jax.jit
        def step(state, x, y):
            return state.apply_gradients(grads=jax.grad(loss)(state.params, x, y))

        for i in range(steps):
            parts = [batch(i, rank, d, workers, L) for d in range(L)]
            x = jax.device_put(np.concatenate([p[0] for p in parts]), data)
            y = jax.device_put(np.concatenate([p[1] for p in parts]), data)
            state = step(state, x, y)
            if waits and (i + 1) % waits == 0:
                jax.block_until_ready(state)
        got = m.get(state.params)
    else:
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        state = m.put(jax.tree_util.tree_map(lambda v: np.stack([np.asarray(v)] * L), state))

        def one(state, x, y):
            return state.apply_gradients(grads=jax.grad(loss)(state.params, x, y))

        step = m.step(lambda s: one(*s)) if m.api == "shard_map" else jax.pmap(one, axis_name=m.AXIS)
        for i in range(steps):
            parts = [batch(i, rank, d, workers, L) for d in range(L)]
            x, y = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
            if m.api == "shard_map":
                state = step((state, m.put(x), m.put(y)))
            else:
                state = step(state, x, y)
            if waits and (i + 1) % waits == 0:
                jax.block_until_ready(state)
        got = jax.tree_util.tree_map(lambda v: v[0], m.get(state.params))

    # Reference: one process, one device, the whole global batch, plain optax.
    ref = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.01))
    ref_step = jax.jit(lambda s, x, y: s.apply_gradients(grads=jax.grad(loss)(s.params, x, y)))
    for i in range(steps):
        parts = [batch(i, w, d, workers, L) for w in range(workers) for d in range(L)]
        ref = ref_step(ref, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(ref.params)):
        np.testing.assert_allclose(g, np.asarray(r), rtol=2e-4, atol=2e-6, err_msg=f"optax: leaf {path}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--apis", default="pmap,shard_map,jit")
    p.add_argument("--kinds", default="plain,buckets,bf16,optax")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--no-waits", action="store_true", help="never wait between steps, whatever the jax")
    args = p.parse_args()

    jbps.init()
    rank, workers, L = jbps.rank(), jbps.size(), jax.local_device_count()
    waits = 0 if args.no_waits or not cpu_loop_deadlock.loops_need_waits() else cpu_loop_deadlock.WAIT_EVERY
    kinds = args.kinds.split(",")
    for api in args.apis.split(","):
        m = Mapped(api, L)
        for kind in kinds:
            name = f"{api}/{kind}"
            if kind == "optax":
                optax_loop(m, args.steps, waits, rank, workers)
                continue
            psum_args = {"name": name}
            make = inputs
            if kind == "buckets":
                psum_args["bucket_bytes"] = BUCKET_BYTES
                make = tree_inputs
            elif kind == "bf16":
                psum_args["compression"] = "bf16"
            got, want = psum_loop(m, make, args.steps, waits, rank, workers, **psum_args)
            check_psum(name, got, want)
    print(json.dumps({"rank": rank, "apis": args.apis.split(","), "steps": args.steps, "waits_every": waits}))
    jbps.shutdown()


if __name__ == "__main__":
    main()
