"""A worker that psums one tree whose first leaf is small and last leaf large,
with the default priority (first leaf first) or reversed (--reverse), and
checks the sum against numpy. Run with JBPS_TRACE_DIR set: the test reads the
trace jbps.shutdown() writes. Prints one JSON line {"rank", "leaves"}."""

import argparse
import json

import jax
import numpy as np

import jbps

SIZES = (8192, 16384, 131072)  # float32 elements: 2, 4 and 32 chunks of 16 KiB


def data(rank):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reverse", action="store_true", help="last leaf first")
    args = p.parse_args()
    jbps.init()
    priority = (lambda path, leaf: int(path.strip("[]"))) if args.reverse else None
    step = jax.jit(lambda tree: jbps.psum(tree, name="grads", priority=priority))
    rank = jbps.rank()
    out = jax.device_get(step(data(rank)))
    want = [np.sum([data(r)[i].astype(np.float64) for r in range(jbps.size())], axis=0) for i in range(len(SIZES))]
    for i, (got, ref) in enumerate(zip(out, want)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=f"leaf {i}")
    jbps.shutdown()
    print(json.dumps({"rank": rank, "leaves": len(SIZES)}), flush=True)


if __name__ == "__main__":
    main()
