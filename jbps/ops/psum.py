"""jbps.psum / jbps.pmean: lax.psum semantics, reduced through BytePS servers.

Inside pmap or shard_map over local devices, a psum is hierarchical:
psum_scatter over the mapped axis (XLA's own in-process/NVLink reduce), one
jbps_psum custom call per device on its shard, all_gather back. Each worker
therefore sends the tree's size over the network once, not once per device.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Hashable

import jax
import jax.numpy as jnp
from jax import lax

from .. import runtime
from ..partition import check_dtypes, make_plan, resolve_priorities
from ..partition.priority import Priority
from .ffi import push_pull, tree_description

AxisName = Hashable


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about one psum call (hashable for custom_vjp)."""
    name: str
    axes: tuple[AxisName, ...]
    average: bool
    paths: tuple[str, ...]
    priorities: tuple[int, ...] | None  # one per leaf; None: pytree order

    def gradient(self, keep: list[int]) -> "_Spec":
        """The spec of the transposed psum over leaves `keep`."""
        return dataclasses.replace(self, name=self.name + "/grad", paths=tuple(self.paths[i] for i in keep),
                                   priorities=None if self.priorities is None else
                                   tuple(self.priorities[i] for i in keep))


def _normalize_axes(axis_name: Any) -> tuple[AxisName, ...]:
    if axis_name is None:
        return ()
    if isinstance(axis_name, (tuple, list)):
        return tuple(axis_name)
    return (axis_name,)


def _axis_size(axes: tuple[AxisName, ...]) -> int:
    if not axes:
        return 1
    size = lax.psum(1, axes)  # a Python int inside pmap/shard_map
    try:
        return int(size)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ValueError(f"jbps.psum: the size of axis {axes} is not static") from None


def _reduce_impl(leaves: tuple[jax.Array, ...], spec: _Spec) -> tuple[jax.Array, ...]:
    num_shards = _axis_size(spec.axes)
    call_bytes = sum(x.size * x.dtype.itemsize for x in leaves)  # what this worker sends, over all its shards
    plan = make_plan(spec.name, spec.paths, [x.shape for x in leaves], [x.dtype for x in leaves], num_shards,
                     partition_bytes=runtime.partition_bytes(call_bytes), server_fractions=runtime.server_fractions(),
                     priorities=spec.priorities)
    plans = plan.leaves
    out = list(leaves)
    todo = [i for i, p in enumerate(plans) if p.size > 0]  # empty arrays sum to themselves
    if todo:
        if num_shards > 1:
            shard_index = lax.axis_index(spec.axes).astype(jnp.int32)
        else:
            shard_index = jnp.zeros((), jnp.int32)
        shards = []
        for i in todo:
            flat = jnp.ravel(leaves[i])
            if plans[i].padded != plans[i].size:
                flat = jnp.pad(flat, (0, plans[i].padded - plans[i].size))
            if num_shards > 1:
                flat = lax.psum_scatter(flat, spec.axes, scatter_dimension=0, tiled=True)
            shards.append(flat)
        tree = tree_description(spec.name, spec.paths, [x.shape for x in leaves], [x.dtype for x in leaves])
        summed = push_pull(shard_index, shards, plan, todo, tree)
        for i, s in zip(todo, summed):
            if num_shards > 1:
                s = lax.all_gather(s, spec.axes, axis=0, tiled=True)
            out[i] = s[: plans[i].size].reshape(plans[i].shape)
    if spec.average:
        count = num_shards * runtime.size()
        out = [x / count for x in out]
    return tuple(out)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce(leaves, spec):
    return _reduce_impl(leaves, spec)


def _reduce_fwd(leaves, spec):
    return _reduce_impl(leaves, spec), None


def _reduce_bwd(spec, _, cotangents):
    # A psum's transpose is a psum (as for lax.psum). Integer leaves have
    # float0 cotangents, which carry nothing and pass through.
    keep = [i for i, ct in enumerate(cotangents) if ct.dtype != jax.dtypes.float0]
    summed = _reduce_impl(tuple(cotangents[i] for i in keep), spec.gradient(keep))
    out = list(cotangents)
    for i, s in zip(keep, summed):
        out[i] = s
    return (tuple(out),)


_reduce.defvjp(_reduce_fwd, _reduce_bwd)


def psum(tree: Any, axis_name: Any = None, *, average: bool = False, name: str | None = None,
         priority: Priority = None) -> Any:
    """Sums every leaf of `tree` over all devices of all workers.

    axis_name: the pmap/shard_map axis (or tuple of axes) over this worker's
    local devices, as for lax.psum; None under plain jit on one device.
    average: divide by the total device count (pmean); integer leaves then
    become floating point, as with lax.pmean.
    name: identifies this call's tensors across workers; by default the n-th
    psum traced in the process (workers run the same program).
    priority: larger is sent sooner. Default: pytree order, first leaf first
    (-index). A mapping {leaf path (jax.tree_util.keystr): int} overrides the
    leaves it names; a callable (path, leaf) -> int sets every leaf.
    `jbps.forward_order(params)` gives flax params their forward order.
    """
    runtime.config_for_psum()  # a clear error before init() or after the job failed
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not path_leaves:
        return tree
    paths = tuple(jax.tree_util.keystr(p) for p, _ in path_leaves)
    leaves = tuple(jnp.asarray(x) for _, x in path_leaves)
    check_dtypes(paths, [x.dtype for x in leaves], "jbps.psum")
    priorities = resolve_priorities(paths, leaves, priority)
    spec = _Spec(name=name if name is not None else runtime.next_auto_name("psum"),
                 axes=_normalize_axes(axis_name), average=average, paths=paths,
                 priorities=None if priorities is None else tuple(priorities))
    return jax.tree_util.tree_unflatten(treedef, _reduce(leaves, spec))


def pmean(tree: Any, axis_name: Any = None, *, name: str | None = None, priority: Priority = None) -> Any:
    """psum(..., average=True): the mean over all devices of all workers."""
    return psum(tree, axis_name, average=True, name=name, priority=priority)
