"""psum with compression="bf16"/"fp16" on every worker of the job, checked
bitwise against numpy: each worker's float32 leaves rounded to 16 bits, added
in float32, the sum rounded to 16 bits and widened back. Prints one JSON line.

--compression-rank R --compression-there C: worker R uses C instead (to try
workers that disagree)."""

import argparse
import jax
import jax.numpy as jnp
import numpy as np

import jbps
from reporting import reported

WIRE = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def tree(rank: int, rnd: int):
    rng = np.random.default_rng(1000 * rnd + rank)
    return {
        "w": rng.normal(size=(300, 7)).astype(np.float32) * 10 ** rng.uniform(-3, 3),
        "b": rng.normal(size=(5000,)).astype(np.float32),
        "half": rng.normal(size=(64,)).astype(jnp.bfloat16),
        "count": rng.integers(-1000, 1000, size=(17,)).astype(np.int32),
    }


def reference(trees, compression):
    out = {}
    for name in trees[0]:
        xs = [t[name] for t in trees]
        if xs[0].dtype == np.float32:
            wire = WIRE[compression]
            total = np.zeros(xs[0].shape, np.float32)
            for x in xs:
                total = total + np.asarray(x, wire).astype(np.float32)
            out[name] = np.asarray(total, wire).astype(np.float32)
        elif xs[0].dtype == np.int32:
            out[name] = np.sum(xs, axis=0, dtype=np.int32)
        else:  # already 16-bit: summed in float32, rounded once
            out[name] = np.asarray(np.sum([np.asarray(x, np.float32) for x in xs], axis=0), xs[0].dtype)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compression", required=True, choices=sorted(WIRE))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compression-rank", type=int, default=-1)
    p.add_argument("--compression-there", default="none")
    args = p.parse_args()
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    mine = args.compression
    if rank == args.compression_rank:
        mine = None if args.compression_there == "none" else args.compression_there
    step = jax.jit(lambda t: jbps.psum(t, name="compressed", compression=mine))
    with reported({"rank": rank, "rounds": 0}) as report:
        for rnd in range(args.rounds):
            got = jax.device_get(step(tree(rank, rnd)))
            want = reference([tree(w, rnd) for w in range(size)], args.compression)
            for name in want:
                assert got[name].dtype == want[name].dtype, (name, got[name].dtype)
                assert np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8)), (
                    f"round {rnd} leaf {name}: {got[name].ravel()[:4]} != {want[name].ravel()[:4]}"
                )
            report["rounds"] += 1


if __name__ == "__main__":
    main()
