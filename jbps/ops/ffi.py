"""The custom calls: jbps_psum (one variadic call per device for a whole tree),
jbps_join, and the codecs' encoders and decoders and the 16-bit casts on XLA:CPU."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from ..partition import CallPlan
from ..partition.plan import tree_key
from .. import runtime
from ..runtime import FFI_TARGET, JOIN_TARGET
from . import replication


def push_pull(
    shard_index: jax.Array,
    shards: Sequence[jax.Array],
    plan: CallPlan,
    leaves: Sequence[int],
    tree: str,
    in_place: Sequence[bool] | None = None,
) -> list[jax.Array]:
    """Sums each shard of plan.leaves[i] for i in `leaves` across workers.

    in_place[j] (default all): shard j's sum lands in its own buffer when XLA
    can give it up; otherwise in a fresh output (see kept_operands.py).

    `shard_index` (int32 scalar) says which local-device shard these are; the
    engine keys chunks by it, so device d of every worker meets device d of
    every other worker on the same keys, and picks its slice of the plan's
    chunk routing by it.
    """
    if any(plan.leaves[i].num_chunks == 0 for i in leaves):
        raise ValueError("push_pull: empty leaves have nothing to send")
    chosen = set(leaves)
    routes = [server for (_, leaf, _, _), server in zip(plan.chunks(), plan.chunk_servers) if leaf in chosen]
    sizes, counts, alone = plan.chunk_table(leaves)
    call = jax.ffi.ffi_call(
        FFI_TARGET,
        [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shards],
        # A sum is elementwise, so a batch of sums is the sum of the batch.
        vmap_method="broadcast_all",
        # Each sum lands in its own operand's buffer when XLA can give it up
        # (a gradient dead after the step, a donated argument): no fresh
        # output buffer, whose first touch costs page faults every step. The
        # engine reads a chunk before its sum can arrive (the server waits
        # for this worker's push), so in place is safe.
        input_output_aliases={i + 1: i for i in range(len(shards)) if in_place is None or in_place[i]},
    )
    return list(
        call(
            shard_index,
            *shards,
            leaf_keys=np.array([plan.leaves[i].key for i in leaves], dtype=np.int64),
            priorities=np.array([plan.leaves[i].priority for i in leaves], dtype=np.int64),
            names="\n".join(f"{plan.name}{plan.leaves[i].path}" for i in leaves),
            partition_bytes=np.int64(plan.partition_bytes),
            # The plan's chunk table of one shard: the engine cuts by it alone.
            chunk_bytes=np.array(sizes, dtype=np.int64),
            chunk_counts=np.array(counts, dtype=np.int64),
            chunk_alone=np.array(alone, dtype=np.int32),
            chunk_servers=np.array(routes, dtype=np.int32),
            tree=tree,
            tree_key=np.int64(tree_key(plan.name)),
        )
    )


def join(values: Sequence[jax.Array], keep: Sequence[jax.Array] = ()) -> list[jax.Array]:
    """The same values, released together by one jbps_join call (each result
    aliases its operand, so nothing is copied). Every value stays live until
    this call, which XLA can place only after the last of them exists: no
    other computation gets the buffer of a bucket's sum while its custom call
    may still be writing it, and none waits for it (XLA:CPU's executor orders
    thunks by the buffers they touch). `keep`: more operands the call only
    reads, live until it runs (no result, so XLA copies none of them)."""
    call = jax.ffi.ffi_call(
        JOIN_TARGET,
        [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values],
        vmap_method="broadcast_all",
        input_output_aliases={i: i for i in range(len(values))},
    )
    return list(call(*values, *keep))


def workers(baked: int) -> jax.Array:
    """The job's worker count as the program runs (an int32 scalar): the
    jbps_workers handler's on XLA:CPU, so that an elastic job's mean does not
    bake its generation's size into the program (runtime.programs_outlive_membership);
    on other platforms, which have no such handler, `baked` (the program then
    holds for this size only: runtime.note_traced_read)."""
    runtime.register_ffi_targets()
    if jax.default_backend() != "cpu":
        runtime.note_traced_read("size", baked)
    call = jax.ffi.ffi_call("jbps_workers", jax.ShapeDtypeStruct((), np.int32))
    return jax.lax.platform_dependent(cpu=lambda: call(), default=lambda: np.int32(baked))


def encode_in_place(target: str, values: jax.Array, records: jax.ShapeDtypeStruct, *operands, **attributes):
    """(records, what they leave of `values`) from a codec's XLA:CPU encoder
    (xla_ext/ffi_codecs_cpu.cc), which writes what is left into the values'
    own buffer. Blockwise, so a batch (vmap) is more blocks."""
    runtime.register_ffi_targets()  # no session needed to encode
    call = jax.ffi.ffi_call(
        target,
        (records, jax.ShapeDtypeStruct(values.shape, values.dtype)),
        vmap_method="broadcast_all",
        input_output_aliases={0: 1},
    )
    return tuple(call(values, *operands, **attributes))


def decode(target: str, records: jax.Array, num_values: int, **attributes) -> jax.Array:
    """float32[num_values] from a codec's XLA:CPU decoder (ffi_codecs_cpu.cc)."""
    runtime.register_ffi_targets()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((num_values,), np.float32), vmap_method="broadcast_all")
    return call(records, **attributes)


def encode_added(
    target: str,
    residual: jax.Array,
    values: jax.Array,
    records: jax.ShapeDtypeStruct,
    *operands,
    first_block: int,
    **attributes,
):
    """(records, residual, values) from a codec's _added encoder on XLA:CPU
    (ffi_codecs_cpu.cc): the records of residual + values from block
    `first_block` on (one piece of a leaf; the rest as it was), what they
    leave written into the residual's buffer, the values passed through in
    theirs (aliased both), so that a later call can put the sums there."""
    runtime.register_ffi_targets()
    call = jax.ffi.ffi_call(
        target,
        (
            records,
            jax.ShapeDtypeStruct(residual.shape, residual.dtype),
            jax.ShapeDtypeStruct(values.shape, values.dtype),
        ),
        vmap_method=None,  # a piece's blocks of a batch would not be one piece
        input_output_aliases={0: 1, 1: 2},
    )
    return tuple(call(residual, values, *operands, first_block=np.int64(first_block), **attributes))


def decode_into(target: str, records: jax.Array, values: jax.Array, first_block: int, **attributes) -> jax.Array:
    """`values` with the records' blocks decoded into them from `first_block`
    on, in their own buffer (aliased): a codec's _into decoder on XLA:CPU
    (ffi_codecs_cpu.cc)."""
    runtime.register_ffi_targets()
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct(values.shape, np.float32), vmap_method=None, input_output_aliases={1: 0}
    )
    return call(records, values, first_block=np.int64(first_block), **attributes)


def cast(target: str, values: jax.Array, dtype) -> jax.Array:
    """`values` as `dtype`, same shape, from a cast's XLA:CPU handler
    (xla_ext/ffi_casts_cpu.cc). Elementwise, so a batch (vmap) is more values."""
    runtime.register_ffi_targets()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(values.shape, dtype), vmap_method="broadcast_all")
    # Elementwise: the result varies over the mapped axes its input does (an
    # ffi_call's result is typed as varying over none).
    return replication.pvary(call(values), tuple(replication.varying(replication.aval_of(values))))
