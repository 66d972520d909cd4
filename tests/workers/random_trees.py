"""A worker of a multi-process test: psum random trees for many rounds and
check every result against a float64 numpy sum of all workers' data.

Each worker can generate every other worker's inputs (seeded by worker,
round and device), so it computes the reference itself, independently of
jbps. Prints one JSON line: {"rank", "digest", "rounds"}; the digest lets the
test check that every worker got bitwise the same sums.
"""

import argparse
import hashlib
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jbps

REPORTED_STATS = (
    "bytes_pushed",
    "bytes_pulled",
    "bytes_shm",
    "chunks_fused",
    "shm_servers",
    "server_bytes_pushed",
    "server_bytes_pulled",
    "server_bytes_acked",
    "server_unacked_seconds",
)
TOLERANCE = {  # (rtol, atol) against the float64 reference
    "float32": (1e-5, 1e-5),
    "float64": (1e-12, 1e-12),
    "float16": (1e-2, 2e-2),
    "bfloat16": (5e-2, 1e-1),
    "int32": (0, 0),
}


def make_tree(seed, worker, rnd, device, num_devices, big_elems):
    rng = np.random.default_rng([seed, worker, rnd, device])
    return {
        "big": rng.standard_normal(big_elems).astype(np.float32),  # several partitions
        "layer": {
            "w": rng.standard_normal((7, 3)),  # float64
            "h": rng.standard_normal(13).astype(np.float16),
            "b": rng.standard_normal((5, 5)).astype(jnp.bfloat16),
        },
        "counts": rng.integers(-1000, 1000, size=11, dtype=np.int32),
        "scalar": np.float32(rng.standard_normal()),
        "empty": np.zeros((0, 3), np.float32),
        "odd": [rng.standard_normal(num_devices * 3 + 1).astype(np.float32)],
    }


def stack(trees):
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *trees)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=["pmap", "shard_map", "jit"], default="pmap")
    p.add_argument("--big-elems", type=int, default=50_000)
    p.add_argument("--sleep-rank", type=int, default=-1, help="this rank sleeps before every other round")
    p.add_argument(
        "--jitter-ms",
        type=float,
        default=0,
        help="sleep a random 0..this many ms before every round (unseeded: arrival order varies)",
    )
    args = p.parse_args()

    jax.config.update("jax_enable_x64", True)
    jbps.init()
    at_init = jbps.engine_stats()  # across hosts, init's link probe has sent bytes already
    rank, workers, L = jbps.rank(), jbps.size(), jax.local_device_count()
    if args.mode == "pmap":
        step = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")
    elif args.mode == "shard_map":
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:
            from jax.experimental.shard_map import shard_map
        mesh = Mesh(np.array(jax.local_devices()), ("i",))
        step = jax.jit(
            shard_map(
                lambda t: jax.tree_util.tree_map(
                    lambda x: x[None], jbps.psum(jax.tree_util.tree_map(lambda x: x[0], t), "i")
                ),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
            )
        )
    else:
        assert L == 1, "jit mode runs on one device"
        step = jax.jit(
            lambda t: jax.tree_util.tree_map(lambda x: x[None], jbps.psum(jax.tree_util.tree_map(lambda x: x[0], t)))
        )

    jitter = np.random.default_rng()  # fresh entropy per process and run
    digest = hashlib.sha256()
    for rnd in range(args.rounds):
        if rank == args.sleep_rank and rnd % 2 == 0:
            time.sleep(0.3)  # the others run ahead into the next round
        if args.jitter_ms:
            time.sleep(jitter.uniform(0, args.jitter_ms) / 1000)
        mine = stack([make_tree(args.seed, rank, rnd, d, L, args.big_elems) for d in range(L)])
        out = jax.device_get(step(mine))
        every = [make_tree(args.seed, w, rnd, d, L, args.big_elems) for w in range(workers) for d in range(L)]
        ref = jax.tree_util.tree_map(lambda *xs: np.sum([np.asarray(x, np.float64) for x in xs], axis=0), *every)
        for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(out)[0], jax.tree_util.tree_leaves(ref)):
            name = jax.tree_util.keystr(path)
            dtype = np.dtype(got.dtype).name
            assert got.shape == (L,) + want.shape, (name, got.shape, want.shape)
            rtol, atol = TOLERANCE[dtype]
            for d in range(L):
                np.testing.assert_allclose(
                    np.asarray(got[d], np.float64),
                    want,
                    rtol=rtol,
                    atol=atol,
                    err_msg=f"round {rnd} leaf {name} device {d}",
                )
                assert np.ascontiguousarray(got[d]).tobytes() == np.ascontiguousarray(got[0]).tobytes(), (
                    f"devices differ bitwise: round {rnd} leaf {name}"
                )
            digest.update(np.ascontiguousarray(got[0]).tobytes())
    # What the tests read: srun --label splits a line past about 1.5 KB, so no more.
    stats = {k: v for k, v in jbps.engine_stats().items() if k in REPORTED_STATS}
    servers = list(jbps.runtime.config().servers)
    link = jbps.runtime.link_bytes_per_s()
    chunk_32mib = jbps.runtime.partition_bytes(32 << 20)  # the default chunk of a 32 MiB psum here
    rates = jbps.runtime.server_rates()  # each server's link as init measured it, and the split it gave
    fractions = list(jbps.runtime.server_fractions())
    jbps.shutdown()
    # One write per line: mpiexec interleaves ranks' output at write boundaries.
    sys.stdout.write(
        json.dumps(
            {
                "rank": rank,
                "digest": digest.hexdigest(),
                "rounds": args.rounds,
                "backend": jax.default_backend(),
                "stats": stats,
                "stats_at_init": {"server_bytes_pushed": at_init["server_bytes_pushed"]},
                "servers": servers,
                "link_bytes_per_s": link,
                "chunk_32mib": chunk_32mib,
                "server_rates": None if rates is None else list(rates),
                "server_fractions": fractions,
            }
        )
        + "\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
