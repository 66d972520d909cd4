"""A worker of the elastic tests (tests/test_elastic.py) whose optimizer
compresses with error feedback: a small MLP trained with
jbps.optax.distributed(optax.adam(...), compression=--compression) inside
jbps.elastic.run, one batch per worker and step drawn from (step, rank).

Prints one JSON line when each generation's training function starts
({"start", "rank", "size", "residuals"}), one before each commit ({"saving":
step, "residuals"}: what it saves) and one after it ({"step", "rank", "size",
"residuals", "params"}), then {"done", "params"}: "residuals" is the
sha256 of this worker's error-feedback residuals (its own encodings' unsent
part) with "residuals_abs" their absolute sum, "params" the sha256 of the
parameters. --die-at STEP kills this process (SIGKILL) before that step, once
per --die-file (created first).
"""

import argparse
import hashlib
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jbps
import jbps.elastic
import jbps.optax
from elastic_hold import add_arguments as add_hold_arguments, hold


def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--die-at", type=int)
    p.add_argument("--die-file")
    add_hold_arguments(p)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((32, 32)) * 0.3).astype(np.float32) for _ in range(3)]
    tx = jbps.optax.distributed(optax.adam(1e-2), compression=args.compression)

    def loss(ps, x):
        h = x
        for w in ps:
            h = jnp.tanh(h @ w)
        return jnp.mean((h - 0.5) ** 2)

    @jax.jit
    def step(ps, opt, x):
        updates, opt = tx.update(jax.grad(loss)(ps, x), opt, ps)
        return optax.apply_updates(ps, updates), opt

    state = jbps.elastic.State(params=params, opt=tx.init(params), step=0)

    def residuals():
        return {
            "residuals": digest(state.opt.residuals),
            "residuals_abs": float(
                sum(np.abs(np.asarray(r, np.float64)).sum() for r in jax.tree_util.tree_leaves(state.opt.residuals))
            ),
        }

    @jbps.elastic.run
    def train(state):
        rank, size = jbps.rank(), jbps.size()
        print(json.dumps({"start": state.step, "rank": rank, "size": size, **residuals()}), flush=True)
        while state.step < args.steps:
            if args.die_at is not None and state.step == args.die_at:
                try:
                    os.close(os.open(args.die_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    os.kill(os.getpid(), signal.SIGKILL)
                except FileExistsError:
                    pass
            x = np.random.default_rng([state.step, rank]).standard_normal((16, 32)).astype(np.float32)
            state.params, state.opt = step(state.params, state.opt, x)
            time.sleep(args.step_seconds)
            state.step += 1
            print(json.dumps({"saving": state.step, **residuals()}), flush=True)  # what commit() saves
            state.commit()
            line = {"step": state.step, "rank": rank, "size": size, "params": digest(state.params), **residuals()}
            print(json.dumps(line), flush=True)
            hold(state, args)

    train(state)
    print(json.dumps({"done": True, "params": digest(state.params)}), flush=True)


if __name__ == "__main__":
    main()
