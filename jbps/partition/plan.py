"""The plan of one psum call.

Each leaf is flattened and padded so it splits evenly over the L devices of
the reduced axes; device d reduces shard d of every leaf across workers.
Devices that differ along mapped axes the psum does not reduce over form
separate groups (as for lax.psum over some axes of a mesh): group g's shard s
has the slot g * L + s, unique among a worker's devices. Each shard is cut
into chunks of at most the partition size (across hosts a large shard's
first and last partition in smaller pieces: chunk_sizes); chunk c of slot s is keyed
ChunkKey(leaf_key, s, c) by the engine, so groups never share keys. The leaf key is a hash of
the psum's name and the leaf's path, so every worker computes the same key
without talking to the others. The plan also fixes each chunk's server
(assign.py) and each leaf's priority (priority.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import ml_dtypes
import numpy as np

from .assign import assign_chunks

# numpy's types (bfloat16: ml_dtypes', which jax's is): importing jbps loads no jax, so
# servers, the scheduler and `jbps run` start without it.
SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32))


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    path: str  # jax.tree_util.keystr of the leaf
    shape: tuple[int, ...]
    dtype: np.dtype
    size: int  # elements
    padded: int  # elements after padding to a multiple of the shard count
    key: int  # signed 64-bit, as the FFI attribute carries it
    priority: int  # larger is sent sooner
    shard_bytes: int  # bytes of one device's shard
    chunk_bytes: int  # bytes of every chunk but the ramp's pieces and the last of a shard
    num_chunks: int  # chunks per shard
    ramped: bool = False  # the shard's first and last partition go in pieces (chunk_sizes)

    def chunk_sizes(self) -> list[int]:
        """Bytes of each chunk of a shard, in order."""
        return chunk_sizes(self.shard_bytes, self.chunk_bytes, self.ramped)

    def chunks_alone(self) -> list[bool]:
        """Per chunk of a shard: whether it travels alone, never fused with other
        small chunks (a ramp's pieces: they are small so that they go sooner)."""
        pieces = len(RAMP_EIGHTHS) if self.ramped else 0
        return [c < pieces or c >= self.num_chunks - pieces for c in range(self.num_chunks)]


@dataclasses.dataclass(frozen=True)
class CallPlan:
    name: str
    leaves: tuple[LeafPlan, ...]
    num_shards: int  # devices each leaf is split over: the size of the reduced axes
    partition_bytes: int
    # Server of every chunk, ordered slot by slot, then leaf by leaf, then chunk.
    chunk_servers: tuple[int, ...]
    num_groups: int = 1  # positions along the mapped axes not reduced over
    ramp: bool = False  # large shards' first and last partition in pieces (chunk_sizes)

    @property
    def num_slots(self) -> int:
        """Shards of every group: what the engine's shard index counts."""
        return self.num_shards * self.num_groups

    def server_bytes(self, num_servers: int) -> list[int]:
        """Bytes each server receives from this worker per call."""
        out = [0] * num_servers
        for (_, _, _, nbytes), server in zip(self.chunks(), self.chunk_servers):
            out[server] += nbytes
        return out

    def chunk_table(self, leaves: Sequence[int]) -> tuple[list[int], list[int], list[bool]]:
        """What the engine cuts a shard of each of `leaves` by, and it alone
        (xla_ext/engine/engine.h, CallSpec): every chunk's bytes, leaf by leaf;
        each leaf's chunk count; whether each chunk travels alone."""
        sizes, counts, alone = [], [], []
        for i in leaves:
            sizes += self.leaves[i].chunk_sizes()
            counts.append(self.leaves[i].num_chunks)
            alone += self.leaves[i].chunks_alone()
        return sizes, counts, alone

    def chunks(self):
        """(slot, leaf index, chunk, bytes) in chunk_servers order."""
        sizes = [leaf.chunk_sizes() for leaf in self.leaves]
        for shard in range(self.num_slots):
            for index in range(len(self.leaves)):
                for c, nbytes in enumerate(sizes[index]):
                    yield shard, index, c, nbytes


def leaf_key(name: str, path: str) -> int:
    """Stable 64-bit key of a leaf (same in every process, unlike hash())."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# The tree check's key: a path no leaf has (keystr paths start with '[' or '.').
TREE_PATH = "<tree>"
# Longer descriptions travel as a digest (the server's limit is 1 MiB).
MAX_TREE_BYTES = 1 << 20


def tree_key(name: str) -> int:
    """Where a psum's tree check meets: the key of a leaf no tree has."""
    return leaf_key(name, TREE_PATH)


def tree_description(
    name: str, paths: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype | str]
) -> str:
    """ "psum NAME", then "PATH DTYPE[SHAPE]" per leaf: what every worker must
    agree on. A dtype given as a string names a compressed leaf ("onebit")."""
    lines = [f"psum {name}"] + [
        f"{path} {dtype if isinstance(dtype, str) else np.dtype(dtype).name}[{','.join(map(str, shape))}]"
        for path, shape, dtype in zip(paths, shapes, dtypes)
    ]
    text = "\n".join(lines)
    if len(text.encode()) > MAX_TREE_BYTES:
        text = f"psum {name}\n<{len(paths)} leaves> sha256:{hashlib.sha256(text.encode()).hexdigest()}"
    return text


def check_dtypes(paths: Sequence[str], dtypes: Sequence[np.dtype], what: str, also: Sequence[np.dtype] = ()) -> None:
    """TypeError naming the first leaf whose dtype jbps cannot sum (the
    servers' dtypes, and `also`: those the caller turns into them)."""
    accepted = SUPPORTED_DTYPES + tuple(np.dtype(d) for d in also)
    for path, dtype in zip(paths, dtypes):
        if np.dtype(dtype) not in accepted:
            names = ", ".join(d.name for d in accepted)
            raise TypeError(
                f"{what}: leaf {path or '<root>'} has dtype {np.dtype(dtype).name}, "
                f"which jbps cannot sum (supported: {names})"
            )


def chunk_size(partition_bytes: int, itemsize: int) -> int:
    """Largest whole number of elements that fits the partition (at least one)."""
    return max(itemsize, partition_bytes - partition_bytes % itemsize)


# A psum across hosts is a pipeline: a chunk's sum leaves its server only once
# every worker's copy of it is in, so the first sums wait for the first chunks
# to cross every link and the last pulls for the last pushes, each wait about
# one chunk's time on a link per worker. A shard of at least RAMP_MIN_PARTS
# partitions therefore goes with its first partition in pieces of RAMP_EIGHTHS
# eighths of it, and its last in the same pieces backwards. The engine cuts by
# the table this plan gives it (CallPlan.chunk_table), never by a rule of its own.
RAMP_EIGHTHS = (1, 1, 2, 4)
RAMP_MIN_PARTS = 8


def ramps(shard_bytes: int, chunk_bytes: int, dtype: np.dtype, ramp: bool) -> bool:
    """Whether a shard is cut with ramps: with `ramp` (the call's), a plain dtype (compressed
    records keep their blocks), partitions of whole eighths and a shard long enough."""
    dtype = np.dtype(dtype)
    return (
        ramp
        and dtype in SUPPORTED_DTYPES
        and chunk_bytes % (8 * dtype.itemsize) == 0
        and shard_bytes >= RAMP_MIN_PARTS * chunk_bytes
    )


def num_chunks(shard_bytes: int, chunk_bytes: int, ramped: bool) -> int:
    """len(chunk_sizes(...)) without listing them: a ramp turns two partitions into 2 x 4 pieces."""
    return -(-shard_bytes // chunk_bytes) + (2 * (len(RAMP_EIGHTHS) - 1) if ramped else 0)


def chunk_sizes(shard_bytes: int, chunk_bytes: int, ramped: bool) -> list[int]:
    """Bytes of each chunk of a shard: partitions, the last what is left; ramped, the first
    and last partition in pieces."""
    if not ramped:
        full, rest = divmod(shard_bytes, chunk_bytes)
        return [chunk_bytes] * full + ([rest] if rest else [])
    eighth = chunk_bytes // 8
    up = [e * eighth for e in RAMP_EIGHTHS]
    return up + chunk_sizes(shard_bytes - 2 * chunk_bytes, chunk_bytes, False) + up[::-1]


def make_plan(
    name: str,
    paths: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[np.dtype],
    num_shards: int,
    *,
    partition_bytes: int,
    server_fractions: Sequence[float],
    priorities: Sequence[int] | None = None,
    num_groups: int = 1,
    ramp: bool = False,
) -> CallPlan:
    """The plan of one call. priorities: one per leaf, larger sooner; by
    default the pytree order, first leaf first. num_groups: how many groups
    of num_shards devices sum separately (see the module's docstring). ramp:
    large shards' ends go in pieces (chunk_sizes; jbps does it across hosts)."""
    leaves = []
    for index, (path, shape, dtype) in enumerate(zip(paths, shapes, dtypes)):
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64))
        padded = -(-size // num_shards) * num_shards
        shard_bytes = padded // num_shards * dtype.itemsize
        part = chunk_size(partition_bytes, dtype.itemsize)
        ramped = ramps(shard_bytes, part, dtype, ramp)
        leaves.append(
            LeafPlan(
                path=path,
                shape=tuple(shape),
                dtype=dtype,
                size=size,
                padded=padded,
                key=leaf_key(name, path),
                priority=-index if priorities is None else int(priorities[index]),
                shard_bytes=shard_bytes,
                chunk_bytes=part,
                num_chunks=num_chunks(shard_bytes, part, ramped),
                ramped=ramped,
            )
        )
    draft = CallPlan(name, tuple(leaves), num_shards, partition_bytes, (), num_groups, ramp)
    chunks = list(draft.chunks())
    # The engine's send order: higher priority first, then leaf position, then chunk.
    order = [(shard, -leaves[i].priority, i, c) for shard, i, c, _ in chunks]
    servers = assign_chunks(
        [nbytes for *_, nbytes in chunks],
        order,
        server_fractions,
        rotation=leaf_key(name, "") % max(1, len(server_fractions)),
    )
    return dataclasses.replace(draft, chunk_servers=tuple(servers))
