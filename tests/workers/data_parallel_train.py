"""A worker that trains with jbps.value_and_grad inside a plain jax.jit over a
mesh, as a JAX program of today is written, and checks it against the same
program in this process without jbps: jax.value_and_grad on the whole job's
batch, one device.

Cases (one JSON line each: {"case", "ok", "detail", "ratio"}):
  1d    a 4-device "data" mesh, the batch placed with NamedSharding
  2d    a 2 x 2 ("data", "model") mesh, the hidden layer split over "model"
        (the partitioner's model parallelism), Auto axes
  2dx   the same under jax.set_mesh with Explicit axes (where jax has them)
  random-SEED  an MLP of random depth and widths on a random mesh of one of
        these kinds, of 1 to 4 devices (mesh_of)
"ratio": the bytes this worker pushed over the steps, over the bytes of the
gradients and the loss: 1 when each worker pushes its tree once, not once per
device.
"""

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jbps

GLOBAL_BATCH = 32
STEPS = 4
# The fixed cases, and random models on random meshes (seeded: the same in every run).
CASES = ["1d", "2d", "2dx"] + [f"random-{seed}" for seed in range(6)]


@dataclasses.dataclass(frozen=True)
class Model:
    """An MLP: tanh layers of `hidden` widths; the first is the one split over
    "model" on a 2-D mesh."""

    features: int = 12
    hidden: tuple = (16,)
    out: int = 3
    seed: int = 7


FIXED = Model()


def random_model(seed: int, model_axis: int) -> Model:
    rng = np.random.default_rng(seed)
    hidden = tuple(int(rng.integers(1, 5)) * 4 * model_axis for _ in range(int(rng.integers(1, 4))))
    return Model(features=int(rng.integers(4, 20)), hidden=hidden, out=int(rng.integers(1, 5)), seed=seed)


def init_params(model: Model = FIXED):
    rng = np.random.default_rng(model.seed)
    widths = (model.features,) + model.hidden
    params = {}
    for i, (a, b) in enumerate(zip(widths, widths[1:]), 1):
        params[f"w{i}"] = (rng.standard_normal((a, b)) * 0.3).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    params["out"] = (rng.standard_normal((widths[-1], model.out)) * 0.3).astype(np.float32)
    return params


def batches(model: Model = FIXED):
    rng = np.random.default_rng(1234 + model.seed)
    for _ in range(STEPS):
        x = rng.standard_normal((GLOBAL_BATCH, model.features)).astype(np.float32)
        yield x, np.tanh(x[:, : model.out] * 2.0 - x[:, -model.out :]).astype(np.float32)


def _hidden(params, x, first=1):
    """The tanh layers from layer `first` on."""
    for i in range(first, len(params) // 2 + 1):
        x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
    return x


def loss(params, x, y):
    return jnp.mean((_hidden(params, x) @ params["out"] - y) ** 2)


def explicit_loss(params, x, y):
    # Explicit sharding types a contraction over "model" as ambiguous, so this
    # model reads the split first layer with a mean, which it types.
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = h.mean(axis=-1, keepdims=True) * jnp.ones((1, params["w1"].shape[1]))
    return jnp.mean((_hidden(params, h, first=2) @ params["out"] - y) ** 2)


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


def mesh_of(case: str):
    """(kind, devices along "data", along "model", model) of a case: the
    fixed ones, or random-SEED: a random model on a random mesh of up to 4
    devices (1-D data, 2-D data x model, or 2-D with Explicit axes)."""
    if not case.startswith("random-"):
        return case, (4, 1) if case == "1d" else (2, 2), FIXED
    seed = int(case.split("-", 1)[1])
    rng = np.random.default_rng([seed, 99])
    kind = ["1d", "2d", "2dx"][int(rng.integers(3))]
    shape = (int(rng.choice([1, 2, 4])), 1) if kind == "1d" else ((2, 2), (1, 2), (2, 1))[int(rng.integers(3))]
    return kind, shape, random_model(seed, shape[1])


def run_case(case, rank, size):
    kind, (data, model_axis), model = mesh_of(case)
    devices = np.array(jax.local_devices()[: data * model_axis])
    params = init_params(model)
    lo, hi = rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size
    mine = [(x[lo:hi], y[lo:hi]) for x, y in batches(model)]
    loss_fn = explicit_loss if kind == "2dx" else loss
    before = jbps.engine_stats()["bytes_pushed"]
    if kind == "1d":
        mesh = Mesh(devices, ("data",))
        batch = NamedSharding(mesh, P("data"))
        got, values = train(
            lambda f: jbps.value_and_grad(f, mesh=mesh),
            loss_fn,
            params,
            mine,
            place=lambda t: jax.device_put(t, batch),
        )
    elif kind == "2d":
        mesh = Mesh(devices.reshape(data, model_axis), ("data", "model"))
        specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
        if len(model.hidden) == 1:
            specs["out"], specs["w2"] = P("model", None), P()
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, P()))) for k, v in params.items()}
        got, values = train(lambda f: jbps.value_and_grad(f, mesh=mesh), loss_fn, placed, mine)
    elif kind == "2dx":
        types = getattr(jax.sharding, "AxisType", None)
        if types is None or not hasattr(jax, "set_mesh"):
            return {"case": case, "ok": True, "detail": f"skipped: jax {jax.__version__} has no explicit sharding"}
        mesh = Mesh(devices.reshape(data, model_axis), ("data", "model"), axis_types=(types.Explicit, types.Explicit))
        with jax.set_mesh(mesh):
            placed = {k: jax.device_put(v, P(None, "model") if k == "w1" else P()) for k, v in params.items()}
            got, values = train(jbps.value_and_grad, loss_fn, placed, mine)
    else:
        raise SystemExit(f"unknown case {case!r}")
    pushed = jbps.engine_stats()["bytes_pushed"] - before
    want, want_values = train(jax.value_and_grad, loss_fn, params, list(batches(model)))
    worst = max(float(np.max(np.abs(np.asarray(got[k]) - want[k]))) for k in want)
    ratio = pushed / (STEPS * tree_bytes(params))
    ok = worst < 1e-5 and np.allclose(values, want_values, rtol=1e-5) and 0.99 <= ratio <= 1.1
    detail = (
        f"{kind} mesh {data}x{model_axis}, {model}: largest parameter difference {worst:.2e}; "
        f"losses {values} vs {want_values}; bytes ratio {ratio:.3f}"
    )
    return {"case": case, "ok": bool(ok), "detail": detail, "ratio": ratio}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", help="1d, 2d, 2dx or random-SEED (repeatable; default CASES)")
    args = p.parse_args()
    jbps.init()
    if len(jax.local_devices()) < 4:
        sys.exit(f"needs 4 local devices, has {len(jax.local_devices())}")
    for case in args.case or CASES:
        sys.stdout.write(json.dumps(run_case(case, jbps.rank(), jbps.size())) + "\n")
        sys.stdout.flush()
    jbps.shutdown()


if __name__ == "__main__":
    main()
