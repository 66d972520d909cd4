"""A worker of tests/test_places.py: one traced psum at several places of
one compiled program (a jitted helper that calls jbps.psum, used inside
another jit). Each case is checked against numpy:

- "chain": under pmap over the local devices, the helper twice, the second
  on the first's sum (the places run one after the other on every worker);
- "cond": under pmap, the helper in both branches of a lax.cond (one place
  a step), 6 steps dispatched back to back;
- "race": under jit, the helper at three places: the first, then two more,
  one on the first's sum and one on another psum's, so XLA starts those two
  in the order their operands' sums came back, which differs between
  workers from step to step. --steps steps dispatched back to back, then
  each one's sums checked; the error, if one raised;
- "after": a psum of its own afterwards.

Prints one JSON line: {"rank", "chain", "cond", "race_wrong", "race_error",
"race_steps", "after"}."""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jbps

SIZE = 4096


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    k = jax.local_device_count()
    axis = "d"

    @jax.jit
    def helper(x):
        return jbps.psum(x, axis_name=axis)  # traced once: one psum, one name

    def mapped(f):
        return jax.pmap(f, axis_name=axis)

    def data(value):
        return jnp.full((k, SIZE), value, jnp.float32) + jnp.arange(k, dtype=jnp.float32)[:, None]

    def total(value):
        """The psum over every worker's devices of data(value(rank))."""
        return sum(value(r) * k + k * (k - 1) / 2 for r in range(size))

    report = {"rank": rank}

    chain = mapped(lambda a: helper(helper(a) * 2.0))
    got = np.asarray(chain(data(1.0 + rank)))
    want = 2.0 * total(lambda r: 1.0 + r) * k * size
    report["chain"] = bool(np.allclose(got, want))

    cond = mapped(lambda a, b, pick: jax.lax.cond(pick[0] > 0, lambda: helper(a), lambda: helper(b * 3.0)))
    picks = [jnp.full((k, 1), step % 2, jnp.int32) for step in range(6)]
    outs = [cond(data(1.0 + rank), data(10.0 * (rank + 1)), pick) for pick in picks]  # back to back
    wants = [total(lambda r: 1.0 + r) if step % 2 else 3.0 * total(lambda r: 10.0 * (r + 1)) for step in range(6)]
    report["cond"] = all(bool(np.allclose(np.asarray(got), want)) for got, want in zip(outs, wants))

    @jax.jit
    def plain(x):
        return jbps.psum(x)  # the same, over the workers alone

    def race(a, b):
        x = plain(a)
        y = jbps.psum(b, name="other")
        # Work beside the psums, so that XLA:CPU runs the program as a graph (a small
        # program's few thunks run one after another, in program order).
        beside = [jnp.sin(a * i) @ jnp.ones((SIZE, 4)) for i in range(1, 8)]
        # Which of these two places comes first follows which sum above came back first.
        return plain(x * 2.0), plain(y * 3.0), beside

    racing = jax.jit(race)
    a, b = jnp.full(SIZE, 1.0 + rank), jnp.full(SIZE, 1000.0 * (rank + 1))
    sa, sb = sum(1.0 + r for r in range(size)), sum(1000.0 * (r + 1) for r in range(size))
    wrong, error, steps = 0, None, 0
    try:
        outs = [racing(a, b)[:2] for _ in range(args.steps)]  # back to back
        for x, y in outs:
            if not (np.allclose(np.asarray(x), 2.0 * sa * size) and np.allclose(np.asarray(y), 3.0 * sb * size)):
                wrong += 1
            steps += 1
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    report.update(race_wrong=wrong, race_error=error, race_steps=steps)

    after = mapped(lambda a: jbps.psum(a, axis_name=axis, name="after"))
    report["after"] = bool(np.allclose(np.asarray(after(data(5.0 + rank))), total(lambda r: 5.0 + r)))
    jbps.shutdown()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
