"""A worker of tests/test_places.py: its programs traced in an order of its
own, as an elastic job's newcomer traces its step while the others hold
theirs. Three jitted functions psum without a name: `step` (a tree of two
leaves), `metrics` (a scalar and a vector, at two call sites) and `evaluate`
(a scalar, of `metrics`' first signature but at its own call site). The worker
of rank --eval-first-rank lowers `evaluate` and `metrics` before anything else
runs. Then --steps rounds of the three, dispatched back to back, each on
values of this worker's rank and the round, every result checked against
numpy afterwards.

Prints one JSON line: {"rank", "names": {function: [its psums' names in
program order]}, "wrong", "steps"}."""

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def psum_names(lowered_text):
    """The tensor names of a lowered module's jbps_psum custom calls, in program order."""
    calls = [line for line in lowered_text.splitlines() if "stablehlo.custom_call @jbps_psum" in line]
    return [re.search(r'names = "([^"]*)"', line).group(1) for line in calls]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval-first-rank", type=int, default=-1)
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()

    @jax.jit
    def step(w, b):
        return jbps.psum({"w": w * 2.0, "b": b + 1.0})

    @jax.jit
    def metrics(loss, hist):
        return jbps.psum(loss), jbps.psum(hist)

    @jax.jit
    def evaluate(acc):
        return jbps.psum(acc * 3.0)

    w0, b0 = jnp.zeros((64, 8), jnp.float32), jnp.zeros((8,), jnp.float32)
    scalar, vector = jnp.float32(0), jnp.zeros((4,), jnp.float32)
    programs = [("evaluate", evaluate, (scalar,)), ("metrics", metrics, (scalar, vector)), ("step", step, (w0, b0))]
    if rank != args.eval_first_rank:
        programs.reverse()
    names = {name: psum_names(f.lower(*inputs).as_text()) for name, f, inputs in programs}

    def value(i, shape):
        return jnp.full(shape, float(rank + 1 + 10 * i), jnp.float32)

    out = []
    for i in range(args.steps):  # dispatched back to back, checked after the loop
        out.append(
            (step(value(i, (64, 8)), value(i, (8,))), metrics(value(i, ()), value(i, (4,))), evaluate(value(i, ())))
        )
    wrong = 0
    for i, (summed, (loss, hist), acc) in enumerate(out):
        total = sum(r + 1 + 10 * i for r in range(size))
        expected = [
            (summed["w"], 2.0 * total),
            (summed["b"], total + size),
            (loss, total),
            (hist, total),
            (acc, 3.0 * total),
        ]
        wrong += sum(not np.allclose(np.asarray(got), want) for got, want in expected)
    print(json.dumps({"rank": rank, "names": names, "wrong": wrong, "steps": len(out)}), flush=True)
    jbps.shutdown()


if __name__ == "__main__":
    main()
