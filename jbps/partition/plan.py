"""The trace-time plan of one psum call.

Each leaf is flattened and padded so it splits evenly over the L devices of
the mapped axis; device d reduces shard d of every leaf across workers. The
C++ engine cuts each shard into chunks of at most the partition size and keys
chunk c of shard s as ChunkKey(leaf_key, s, c). The leaf key is a hash of the
psum's name and the leaf's path, so every worker computes the same key without
talking to the others.

Priority: larger is sent sooner. Leaves keep their pytree order (for flax
params: the module definition order, i.e. the forward order of the model), and
the first leaf gets the highest priority because the next forward pass needs
it first.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16, jnp.int32))


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    path: str  # jax.tree_util.keystr of the leaf
    shape: tuple[int, ...]
    dtype: np.dtype
    size: int  # elements
    padded: int  # elements after padding to a multiple of the shard count
    key: int  # signed 64-bit, as the FFI attribute carries it
    priority: int


def leaf_key(name: str, path: str) -> int:
    """Stable 64-bit key of a leaf (same in every process, unlike hash())."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def check_dtypes(paths: Sequence[str], dtypes: Sequence[np.dtype], what: str) -> None:
    """TypeError naming the first leaf whose dtype jbps cannot sum."""
    for path, dtype in zip(paths, dtypes):
        if np.dtype(dtype) not in SUPPORTED_DTYPES:
            names = ", ".join(d.name for d in SUPPORTED_DTYPES)
            raise TypeError(f"{what}: leaf {path or '<root>'} has dtype {np.dtype(dtype).name}, "
                            f"which jbps cannot sum (supported: {names})")


def make_plan(name: str, paths: Sequence[str], shapes: Sequence[tuple[int, ...]],
              dtypes: Sequence[np.dtype], num_shards: int) -> list[LeafPlan]:
    plans = []
    for index, (path, shape, dtype) in enumerate(zip(paths, shapes, dtypes)):
        size = int(np.prod(shape, dtype=np.int64))
        padded = -(-size // num_shards) * num_shards
        plans.append(LeafPlan(path=path, shape=tuple(shape), dtype=np.dtype(dtype), size=size, padded=padded,
                              key=leaf_key(name, path), priority=-index))
    return plans
