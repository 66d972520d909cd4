"""jbps.psum / jbps.pmean: lax.psum semantics, reduced through BytePS servers.

The sum runs over the named mapped axes and over every worker; devices at
different positions along mapped axes not named sum separately, as lax.psum
over some axes of a mesh does. The work is the jbps_psum primitive
(psum_primitive.py); this is the user-facing part: checks, names, the mean.
"""

from __future__ import annotations

from typing import Any, Hashable

import jax
import jax.numpy as jnp
from jax import lax

from .. import runtime
from ..partition import check_dtypes, resolve_priorities
from ..partition.priority import Priority
from . import compression as wire
from . import ffi, lax_dtypes, onebit
from .psum_primitive import PsumSpec, bind

AxisName = Hashable


def _normalize_axes(axis_name: Any) -> tuple[AxisName, ...] | None:
    if axis_name is None:
        return None
    if isinstance(axis_name, (tuple, list)):
        return tuple(axis_name)
    return (axis_name,)


def _axis_size(axes: tuple[AxisName, ...]) -> int:
    """The product of the named axes' sizes (vmap axes included); an unknown
    name is jax's NameError, here at trace time."""
    if not axes:
        return 1
    size = lax.psum(1, axes)  # a Python int inside pmap/shard_map/vmap
    try:
        return int(size)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"jbps.psum: the size of axis {axes} is not static") from None


def psum(
    tree: Any,
    axis_name: Any = None,
    *,
    average: bool = False,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
    compression: str | None = None,
) -> Any:
    """Sums every leaf of `tree` over the named mapped axes and every worker.

    axis_name: the mapped axis (or tuple of axes) to sum over besides the
    workers, as for lax.psum: pmap/shard_map axes over this worker's local
    devices, vmap axes too. Devices at different positions along mapped axes
    not named sum separately. None only outside pmap/shard_map (plain jit on
    one device, or vmap): under a mapped device axis it is refused when the
    call is lowered, naming the axes; axis_name=() sums each device's value
    over the workers only.
    average: divide by the number of values summed (pmean); integer leaves
    then become floating point, as with lax.pmean.
    name: identifies this call's tensors across workers; by default a digest
    of where it is called from and of the tree's paths, shapes and dtypes
    (runtime.auto_name), whatever the order the process traces it in.
    priority: larger is sent sooner. Default: pytree order, first leaf first
    (-index). A mapping {leaf path (jax.tree_util.keystr): int} overrides the
    leaves it names; a callable (path, leaf) -> int sets every leaf.
    `jbps.forward_order(params)` gives flax params their forward order.
    bucket_bytes: a tree of more bytes goes as several custom calls of about
    this many bytes, grouped in the order the backward pass produces the
    leaves (lowest priority first), so each starts as soon as its leaves
    exist (buckets.py); default JBPS_BUCKET_BYTES, else 4 MiB on one host and
    across hosts sized to the tree and the link's measured rate
    (partition/defaults.py); 0: one call.
    compression: None, "bf16" or "fp16": float32/float64 leaves travel as
    16-bit floats (half the bytes), summed in float32 by the servers and
    cast back (compression.py); the same on every worker.
    """
    wire.check(compression, "jbps.psum")
    out, _ = _psum(
        tree,
        None,
        axis_name,
        average=average,
        name=name,
        priority=priority,
        bucket_bytes=bucket_bytes,
        compression=compression,
    )
    return out


def psum_with_feedback(
    tree: Any,
    residuals: Any,
    axis_name: Any = None,
    *,
    average: bool = False,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
    compression: str = "onebit",
) -> tuple[Any, Any]:
    """psum with onebit or topk ("topk:FRACTION" too) compression and error feedback (onebit.py,
    topk.py): returns (the sums, the new residuals). `residuals` has the
    tree's structure, a float32 array of the shape of each leaf that travels
    compressed (onebit.compressed; zeros at first), anything for the other
    leaves, which travel as they are (None in the residuals returned); the
    optax wrappers keep it in their state."""
    if wire.feedback_codec(compression, "jbps.psum_with_feedback") is None:
        raise ValueError(
            f"jbps.psum_with_feedback: compression must be 'onebit', 'topk' or 'topk:FRACTION', got {compression!r}"
        )
    return _psum(
        tree,
        residuals,
        axis_name,
        average=average,
        name=name,
        priority=priority,
        bucket_bytes=bucket_bytes,
        compression=compression,
    )


def _psum(tree, residuals, axis_name, *, average, name, priority, bucket_bytes, compression):
    config = runtime.config_for_psum()  # a clear error before init() or after the job failed
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not path_leaves:
        return tree, residuals
    paths = tuple(jax.tree_util.keystr(p) for p, _ in path_leaves)
    leaves = tuple(jnp.asarray(x) for _, x in path_leaves)
    dtypes = [x.dtype for x in leaves]
    check_dtypes(paths, dtypes, "jbps.psum", also=lax_dtypes.CONVERTED)
    priorities = resolve_priorities(paths, leaves, priority)
    if wire.stateful(compression) and (path := lax_dtypes.complex_leaf(paths, dtypes)) is not None:
        raise TypeError(f"jbps.psum: leaf {path} is complex, which {compression} compression cannot carry")
    leaves = tuple(lax_dtypes.to_wire(x) for x in leaves)  # bool and complex as lax.psum sums them
    axes = _normalize_axes(axis_name)
    count = _axis_size(axes or ())
    if name is None:
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
        name = runtime.auto_name("psum", paths, shapes, axes_words(axes), priorities, bucket_bytes, compression)
    if bucket_bytes is None:
        bucket_bytes = config.bucket_bytes  # None still: sized where it is lowered (runtime.bucket_bytes)
    elif isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"jbps.psum: bucket_bytes must be a non-negative int, got {bucket_bytes!r}")
    spec = PsumSpec(
        name=name,
        axes=axes,
        paths=paths,
        priorities=None if priorities is None else tuple(priorities),
        bucket_bytes=bucket_bytes,
        feedback=compression if wire.stateful(compression) else None,
    )
    new_residuals = residuals
    if spec.feedback:
        held = _residual_leaves(residuals, treedef, paths, leaves, compression)
        results = bind(list(leaves) + held, spec)
        out = results[: len(leaves)]
        kept = [r if onebit.compressed(x.shape, x.dtype) else None for x, r in zip(leaves, results[len(leaves) :])]
        new_residuals = jax.tree_util.tree_unflatten(treedef, kept)
    else:
        out = wire.decompress(bind(wire.compress(leaves, compression), spec), leaves)
    out = [lax_dtypes.from_wire(x, dtype) for x, dtype in zip(out, dtypes)]
    if average:
        workers = ffi.workers(config.num_workers) if runtime.programs_outlive_membership() else runtime.size()
        out = [x / (count * workers) for x in out]
    return jax.tree_util.tree_unflatten(treedef, out), new_residuals


def axes_words(axis_name: Any) -> tuple | None:
    """An axis_name as a psum's default name takes it (runtime.auto_name): strings and ints as they
    are, others by their type (the same on every worker; an object's repr may hold its address)."""
    axes = _normalize_axes(axis_name)
    return None if axes is None else tuple(a if isinstance(a, (str, int)) else type(a).__name__ for a in axes)


def _residual_leaves(residuals, treedef, paths, leaves, compression) -> list[jax.Array]:
    """The residual of every leaf, checked: a float32 array of the leaf's
    shape for the leaves that travel compressed; for the others (None in the
    state) an empty placeholder, which the primitive passes through."""
    try:
        held = treedef.flatten_up_to(residuals)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"jbps.psum: the {compression} residuals do not have the gradients' tree structure: {e}"
        ) from None
    out = []
    for path, leaf, r in zip(paths, leaves, held):
        if not onebit.compressed(leaf.shape, leaf.dtype):
            out.append(jnp.zeros((0,), jnp.float32))
            continue
        r = jnp.asarray(r)
        if r.shape != leaf.shape or r.dtype != jnp.float32:
            raise ValueError(
                f"jbps.psum: the {compression} residual of leaf {path or '<root>'} is "
                f"{r.dtype.name}{list(r.shape)}, expected float32{list(leaf.shape)}"
            )
        out.append(r)
    return out


def pmean(
    tree: Any,
    axis_name: Any = None,
    *,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
    compression: str | None = None,
) -> Any:
    """psum(..., average=True): the mean over the named axes and every worker."""
    return psum(
        tree, axis_name, average=True, name=name, priority=priority, bucket_bytes=bucket_bytes, compression=compression
    )
