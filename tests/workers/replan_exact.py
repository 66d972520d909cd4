"""A worker of the re-plan test (tests/test_replan.py): a training-like loop of
bucketed psums over every local device, dispatched back to back (each step's
input depends on the last step's sums), during which this worker announces
new splits at steps of its own (--announce: one step list per rank), as the
rate follower does (jbps/replan.py) but at chosen moments. Every sum is
checked against numpy; then more steps, blocking, measure the bytes each
server got under the last split, and where one psum routed to server 0 alone
goes, with fixed routes (the follower's probe) and without. Prints one JSON line."""

import argparse
import functools
import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jbps
from jbps import link_rate
from jbps.extension import load_core

LEAVES = (4096, 70_000, 1000, 130_000)  # float32 elements: several buckets of 256 KiB, several chunks each


def data(step, rank, device):
    rng = np.random.default_rng([step, rank, device])
    return [rng.integers(-8, 8, n).astype(np.float32) for n in LEAVES]  # exact sums in float32


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--announce", required=True, help="per rank, ';'-separated: steps (comma-separated)")
    p.add_argument("--splits", required=True, help="JSON list of splits, announced in order")
    p.add_argument("--measure-steps", type=int, default=6)
    args = p.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # that deadlock's warning: the loop waits every 8 steps
    jbps.init()
    core = load_core()
    rank, size, devices = jbps.rank(), jbps.size(), jax.local_device_count()
    at = [int(s) for s in args.announce.split(";")[rank].split(",") if s]
    splits = json.loads(args.splits)

    @functools.partial(jax.pmap, axis_name="i")
    def step(last, grads):
        # 0 * last: the step waits for the last one's sums, as a training step does.
        return jbps.psum([g + 0 * last for g in grads], "i", name="grads")

    def inputs(s):
        per = [data(s, rank, d) for d in range(devices)]
        return [np.stack([per[d][i] for d in range(devices)]) for i in range(len(LEAVES))]

    def want(s):
        return [
            sum(data(s, r, d)[i] for r in range(size) for d in range(devices)).astype(np.float32)
            for i in range(len(LEAVES))
        ]

    last = jnp.zeros((devices,), jnp.float32)
    outs, announced = [], 0
    for s in range(args.steps):
        while announced < len(at) and at[announced] == s:
            core.engine_set_routes(splits[announced])  # while earlier steps are still in flight
            announced += 1
        out = step(last, inputs(s))
        last = out[0][:, 0]
        outs.append(out)
        if s % 8 == 7:  # jax < 0.12's CPU runtime can deadlock a longer run of multi-device steps (docs/guide/loops.md)
            jax.block_until_ready(last)
    wrong = []
    for s, out in enumerate(outs):
        for i, (got, expect) in enumerate(zip(out, want(s))):
            for d in range(devices):
                if not np.array_equal(np.asarray(got[d]), expect):
                    wrong.append([s, i, d])
    before = core.engine_stats()
    for s in range(args.steps, args.steps + args.measure_steps):
        out = jax.block_until_ready(step(last, inputs(s)))
        for got, expect in zip(out, want(s)):
            assert all(np.array_equal(np.asarray(got[d]), expect) for d in range(devices)), f"step {s}"
    after = core.engine_stats()
    pushed = [a - b for a, b in zip(after["server_bytes_pushed"], before["server_bytes_pushed"])]
    to_first = {}  # fixed routes or not: (bytes each server got, the sum right)
    for fixed in (True, False):
        only_first = link_rate.one_server(len(pushed), 0)
        for _ in range(2):  # a name's first call goes as planned; its next ones by the split its sums carried
            values = np.full(100_000, rank + 1, np.float32)
            ahead = core.engine_stats()["server_bytes_pushed"]
            link_rate.psum_host(f"to_first.{fixed}", values, only_first, 60.0, fixed_routes=fixed)
        got = [a - b for a, b in zip(core.engine_stats()["server_bytes_pushed"], ahead)]
        to_first[str(fixed)] = (got, bool(np.all(values == size * (size + 1) // 2)))
    report = {
        "rank": rank,
        "wrong": wrong,
        "pushed": pushed,
        "to_first": to_first,
        "routes_announced": after["routes_announced"],
        "routes_used": after["routes_used"],
        "init_split": list(jbps.runtime.server_fractions()),  # jbps.init's, by the links it measured
    }
    print(json.dumps(report), flush=True)
    jbps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
