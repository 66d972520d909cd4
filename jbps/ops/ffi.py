"""The jbps_psum XLA custom call: one variadic call per device for a whole tree."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from ..partition import LeafPlan
from ..runtime import FFI_TARGET


def push_pull(shard_index: jax.Array, shards: Sequence[jax.Array], plans: Sequence[LeafPlan],
              name: str) -> list[jax.Array]:
    """Sums each shard across workers through the summation servers.

    `shard_index` (int32 scalar) says which local-device shard these are; the
    engine keys chunks by it, so device d of every worker meets device d of
    every other worker on the same keys.
    """
    call = jax.ffi.ffi_call(
        FFI_TARGET,
        [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shards],
        # A sum is elementwise, so a batch of sums is the sum of the batch.
        vmap_method="broadcast_all",
    )
    return call(
        shard_index,
        *shards,
        leaf_keys=np.array([p.key for p in plans], dtype=np.int64),
        priorities=np.array([p.priority for p in plans], dtype=np.int64),
        names="\n".join(f"{name}{p.path}" for p in plans),
    )
