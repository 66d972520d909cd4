"""A worker that broadcasts a nested tree of mixed dtypes, holding values a
float sum would change (-0.0, NaN with a payload, infinities, subnormals),
from --root, and checks that it got the root's tree bit for bit.

Every worker can build any worker's tree from its rank, so the expected
bits come from numpy, not from jbps. Prints one JSON line: {"rank", "digests"
(one per mode), "leaves"}.
"""

import argparse
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

import jbps
from jbps.host_broadcast import broadcast_arrays


def special_f32():
    bits = np.array([0x80000000, 0x7FC00123, 0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF], np.uint32)
    return bits.view(np.float32)  # -0.0, NaN with payload, +inf, -inf, subnormals


def make_tree(rank):
    rng = np.random.default_rng(rank)
    tree = {
        "params": {
            "dense": {
                "kernel": rng.standard_normal((17, 5)).astype(np.float32),
                "bias": np.concatenate([special_f32(), rng.standard_normal(3).astype(np.float32)]),
            },
            "embed": rng.standard_normal((9, 4)).astype(jnp.bfloat16),
            "half": np.array([-0.0, np.nan, rng.standard_normal()], np.float16),
        },
        "step": np.int32(rank * 7 - 3),
        "flags": rng.random(6) < 0.5,
        "bytes": [rng.integers(0, 256, 10, dtype=np.uint8), rng.integers(-128, 128, 4, dtype=np.int8)],
        "u32": rng.integers(0, 2**32, 5, dtype=np.uint32),
        "scalar": np.float32(-0.0 if rank % 2 else rank),
    }
    if jax.config.jax_enable_x64:
        tree["x64"] = {
            "f64": np.array([-0.0, np.nan, rng.standard_normal()], np.float64),
            "i64": rng.integers(-(2**62), 2**62, 3, dtype=np.int64),
            "u64": rng.integers(0, 2**63, 3, dtype=np.uint64),
        }
    return tree


def bits(tree):
    """(path, dtype, shape, raw bytes) of every leaf."""
    return [
        (jax.tree_util.keystr(p), np.asarray(x).dtype.name, np.shape(x), np.asarray(x).tobytes())
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def broadcast(mine, root, mode, rank, devices):
    if mode == "eager":
        return jbps.broadcast(mine, root=root)
    if mode == "jit":
        return jax.jit(lambda t: jbps.broadcast(t, root=root))(mine)
    if mode == "host":  # outside XLA: an elastic generation's state (jbps/host_broadcast.py)
        leaves, treedef = jax.tree_util.tree_flatten(mine)
        arrays = broadcast_arrays([np.asarray(x) for x in leaves], root, "host_broadcast_check")
        return jax.tree_util.tree_unflatten(treedef, arrays)
    # pmap: each local device starts from a different tree; the root's first device wins.
    per_device = [make_tree(1000 + rank * 100 + d) if d else mine for d in range(devices)]
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *per_device)
    out = jax.device_get(jax.pmap(lambda t: jbps.broadcast(t, root=root, axis_name="i"), axis_name="i")(stacked))
    for d in range(devices):
        assert bits(jax.tree_util.tree_map(lambda x: x[d], out)) == bits(make_tree(root)), f"device {d}"
    return jax.tree_util.tree_map(lambda x: x[0], out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--modes", default="eager", help="comma-separated: eager, jit, host, pmap")
    args = p.parse_args()
    jbps.init()
    rank, devices = jbps.rank(), jax.local_device_count()
    want = bits(make_tree(args.root))
    digests = {}
    for mode in args.modes.split(","):
        have = bits(jax.device_get(broadcast(make_tree(rank), args.root, mode, rank, devices)))
        assert len(want) == len(have), (mode, len(want), len(have))
        for w, h in zip(want, have):
            assert w == h, f"{mode}, leaf {w[0]}: expected {w[1]}{w[2]} {w[3].hex()}, got {h[1]}{h[2]} {h[3].hex()}"
        digests[mode] = hashlib.sha256(b"".join(h[3] for h in have)).hexdigest()
    print(json.dumps({"rank": rank, "digests": digests, "leaves": len(want)}), flush=True)
    jbps.shutdown()


if __name__ == "__main__":
    main()
