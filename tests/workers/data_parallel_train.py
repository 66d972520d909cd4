"""A worker that trains with jbps.value_and_grad inside a plain jax.jit over a
mesh, as a JAX program of today is written, and checks it against the same
program in this process without jbps: jax.value_and_grad on the whole job's
batch, one device.

Cases (one JSON line each: {"case", "ok", "detail", "ratio"}):
  1d    a 4-device "data" mesh, the batch placed with NamedSharding
  2d    a 2 x 2 ("data", "model") mesh, the hidden layer split over "model"
        (the partitioner's model parallelism), Auto axes
  2dx   the same under jax.set_mesh with Explicit axes (where jax has them)
"ratio": the bytes this worker pushed over the steps, over the bytes of the
gradients and the loss: 1 when each worker pushes its tree once, not once per
device.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jbps

GLOBAL_BATCH = 32
FEATURES, HIDDEN, OUT = 12, 16, 3
STEPS = 4


def init_params():
    rng = np.random.default_rng(7)
    return {
        "w1": (rng.standard_normal((FEATURES, HIDDEN)) * 0.3).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, OUT)) * 0.3).astype(np.float32),
    }


def batches():
    rng = np.random.default_rng(1234)
    for _ in range(STEPS):
        x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
        yield x, (x[:, :OUT] * 2.0 - x[:, OUT : 2 * OUT]).astype(np.float32)


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def explicit_loss(params, x, y):
    # Explicit sharding types a contraction over "model" as ambiguous, so this
    # model reads the split hidden layer with a mean, which it types.
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h.mean(axis=-1, keepdims=True) * params["w2"].sum(axis=0) - y) ** 2)


TX = optax.sgd(0.05, momentum=0.9)


def train(value_and_grad, loss_fn, params, data, place=lambda t: t):
    vg = value_and_grad(loss_fn)

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = vg(params, x, y)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = TX.init(params)
    values = []
    for x, y in data:
        params, opt_state, value = step(params, opt_state, *place((x, y)))
        values.append(value)
    return jax.device_get(params), [float(v) for v in values]


def tree_bytes(params):
    return sum(np.asarray(p).nbytes for p in jax.tree_util.tree_leaves(params)) + 4  # and the loss


def run_case(case, rank, size):
    devices = np.array(jax.local_devices()[:4])
    params = init_params()
    lo, hi = rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size
    mine = [(x[lo:hi], y[lo:hi]) for x, y in batches()]
    loss_fn = explicit_loss if case == "2dx" else loss
    before = jbps.engine_stats()["bytes_pushed"]
    if case == "1d":
        mesh = Mesh(devices, ("data",))
        batch = NamedSharding(mesh, P("data"))
        got, values = train(
            lambda f: jbps.value_and_grad(f, mesh=mesh),
            loss_fn,
            params,
            mine,
            place=lambda t: jax.device_put(t, batch),
        )
    elif case == "2d":
        mesh = Mesh(devices.reshape(2, 2), ("data", "model"))
        specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        got, values = train(lambda f: jbps.value_and_grad(f, mesh=mesh), loss_fn, placed, mine)
    elif case == "2dx":
        types = getattr(jax.sharding, "AxisType", None)
        if types is None or not hasattr(jax, "set_mesh"):
            return {"case": case, "ok": True, "detail": f"skipped: jax {jax.__version__} has no explicit sharding"}
        mesh = Mesh(devices.reshape(2, 2), ("data", "model"), axis_types=(types.Explicit, types.Explicit))
        with jax.set_mesh(mesh):
            placed = {k: jax.device_put(v, P(None, "model") if k == "w1" else P()) for k, v in params.items()}
            got, values = train(jbps.value_and_grad, loss_fn, placed, mine)
    else:
        raise SystemExit(f"unknown case {case!r}")
    pushed = jbps.engine_stats()["bytes_pushed"] - before
    want, want_values = train(jax.value_and_grad, loss_fn, params, list(batches()))
    worst = max(float(np.max(np.abs(np.asarray(got[k]) - want[k]))) for k in want)
    ratio = pushed / (STEPS * tree_bytes(params))
    ok = worst < 1e-5 and np.allclose(values, want_values, rtol=1e-5) and 0.99 <= ratio <= 1.1
    detail = f"largest parameter difference {worst:.2e}; losses {values} vs {want_values}; bytes ratio {ratio:.3f}"
    return {"case": case, "ok": bool(ok), "detail": detail, "ratio": ratio}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", help="1d, 2d or 2dx (repeatable; default all)")
    args = p.parse_args()
    jbps.init()
    if len(jax.local_devices()) < 4:
        sys.exit(f"needs 4 local devices, has {len(jax.local_devices())}")
    for case in args.case or ["1d", "2d", "2dx"]:
        sys.stdout.write(json.dumps(run_case(case, jbps.rank(), jbps.size())) + "\n")
        sys.stdout.flush()
    jbps.shutdown()


if __name__ == "__main__":
    main()
