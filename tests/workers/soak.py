"""A worker of the soak test (tests/test_soak.py): --rounds psums of trees of
mixed sizes and dtypes, cycling through a few fixed trees (each compiled
once), every result checked against a float64 numpy sum of every worker's
inputs. Records this worker's resident memory, and the servers' (PIDs in
SOAK_SERVER_PIDS), after round --measure-at and after the last round.

Prints one JSON line: {"rank", "rounds", "rss_kib": {"worker": [at, end],
"server <pid>": [at, end], ...}}."""

import argparse
import json
import os
import re
import sys

import jax
import numpy as np

import jbps

TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-2, "bfloat16": 1e-1, "int32": 0}
# Leaf shapes and dtypes of each tree: from a scalar to a leaf over several
# partitions (JBPS_PARTITION_BYTES is small in the test), odd sizes included.
TREES = [
    {"w": ((64, 33), "float32"), "b": ((33,), "float32"), "n": ((), "int32")},
    {"emb": ((3000,), "bfloat16"), "h": ((17, 5), "float16"), "x": ((9,), "float64")},
    {"big": ((20_000,), "float32"), "c": ((7,), "int32")},
    {"layers": [((128, 3), "float32"), ((1,), "float16"), ((0,), "float32")], "s": ((), "float64")},
]


def inputs(variant, worker, rnd, device):
    rng = np.random.default_rng([variant, worker, rnd, device])

    def leaf(spec):
        shape, dtype = spec
        if dtype == "int32":
            return rng.integers(-1000, 1000, size=shape, dtype=np.int32)
        return rng.standard_normal(shape).astype(jax.numpy.dtype(dtype))

    return jax.tree_util.tree_map(
        leaf, TREES[variant], is_leaf=lambda s: isinstance(s, tuple) and isinstance(s[1], str)
    )


def rss_kib(pid="self"):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--measure-at", type=int, required=True)
    args = p.parse_args()
    jax.config.update("jax_enable_x64", True)
    jbps.init()
    rank, workers, L = jbps.rank(), jbps.size(), jax.local_device_count()
    steps = [jax.pmap(lambda t, k=k: jbps.psum(t, "i", name=f"soak{k}"), axis_name="i") for k in range(len(TREES))]
    servers = [int(p) for p in os.environ.get("SOAK_SERVER_PIDS", "").split(",") if p]
    memory = {}

    def measure():
        memory.setdefault("worker", []).append(rss_kib())
        for pid in servers:
            memory.setdefault(f"server {pid}", []).append(rss_kib(pid))

    for rnd in range(args.rounds):
        k = rnd % len(TREES)
        mine = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[inputs(k, rank, rnd, d) for d in range(L)])
        out = jax.device_get(steps[k](mine))
        every = [inputs(k, w, rnd, d) for w in range(workers) for d in range(L)]
        want = jax.tree_util.tree_map(lambda *xs: np.sum([np.asarray(x, np.float64) for x in xs], axis=0), *every)
        for (path, got), ref in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree_util.tree_leaves(want)):
            tol = TOLERANCE[np.dtype(got.dtype).name]
            for d in range(L):
                np.testing.assert_allclose(
                    np.asarray(got[d], np.float64),
                    ref,
                    rtol=tol,
                    atol=tol,
                    err_msg=f"round {rnd} leaf {jax.tree_util.keystr(path)} device {d}",
                )
        if rnd + 1 in (args.measure_at, args.rounds):
            measure()
    jbps.shutdown()
    sys.stdout.write(json.dumps({"rank": rank, "rounds": args.rounds, "rss_kib": memory}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
