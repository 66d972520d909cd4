"""jbps.optax.onebit_adam on every worker of the job: a least-squares fit
where each worker has its own rows. Prints one JSON line: a digest of the
final parameters and state (every worker must hold the same), the loss over
all rows at the start, after the warm-up and at the end, and the same fit's
final loss with float32 AdamW through jbps.optax.distributed (the reference).
"""

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jbps
from reporting import reported

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--warmup", type=int, default=60)
p.add_argument("--codec", default="onebit")
args = p.parse_args()
LR = 0.05

jbps.init()
rank, workers = jbps.rank(), jbps.size()
rng = np.random.default_rng(0)  # the same problem on every worker
truth = {"w": rng.normal(size=(64, 48)).astype(np.float32), "b": rng.normal(size=48).astype(np.float32)}
rows = rng.normal(size=(workers, 256, 64)).astype(np.float32)
targets = rows @ truth["w"] + truth["b"] + 0.01 * rng.normal(size=(workers, 256, 48)).astype(np.float32)
mine_x, mine_y = jnp.asarray(rows[rank]), jnp.asarray(targets[rank])


def loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def fit(tx):
    params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss)(params, mine_x, mine_y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    losses = []
    for i in range(args.steps):
        params, state = step(params, state)
        if i + 1 in (args.warmup, args.steps):
            losses.append(float(loss(params, jnp.asarray(rows.reshape(-1, 64)), jnp.asarray(targets.reshape(-1, 48)))))
    return params, state, losses


def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


with reported({"rank": rank}) as report:
    start = float(loss({"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}, rows.reshape(-1, 64), targets.reshape(-1, 48)))
    tx = jbps.optax.onebit_adam(LR, warmup_steps=args.warmup, compression=args.codec, name="fit")
    params, state, (after_warmup, final) = fit(tx)
    inner = state[0]
    # The job's moments and the parameters are the same on every worker; the
    # residuals are each worker's own.
    report.update(
        start=start,
        after_warmup=after_warmup,
        final=final,
        shared=digest((params, inner.count, inner.mu, inner.nu)),
        count=int(inner.count),
    )
    _, _, (_, report["adamw_final"]) = fit(jbps.optax.distributed(optax.adam(LR), name="fit-adamw"))
