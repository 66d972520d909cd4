"""jbps.value_and_grad: data parallelism for programs written with jit and a mesh.

A JAX program of today shards its batch over a mesh's data axis and lets the
partitioner insert the gradient all-reduce; it never calls psum. This is
jax.value_and_grad for such a program: the gradient (and the loss) are
averaged over the data axis's local devices and every worker of the job, and
the function it returns is called where jax.value_and_grad's would be, inside
the jitted step.

It runs `fun` in a shard_map that is manual over the data axis only: each
device computes its slice of the batch, and one jbps.pmean over the data axis
reduces on the machine's devices first and pushes once per worker (not once
per device, which a jbps.psum in plain jit would do). Every other mesh axis is
left to the partitioner.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from .ops.psum import pmean

try:
    from jax import shard_map
except ImportError:  # jax < 0.7 has it in jax.experimental, with `auto` for the axes left to the partitioner
    from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]
_PARAMS = inspect.signature(shard_map).parameters
_CHECK = "check_vma" if "check_vma" in _PARAMS else "check_rep"


def _context_mesh():
    """The mesh jax.set_mesh (or `with mesh:`) made current, or None."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is not None and not getattr(mesh, "empty", False) and mesh.axis_names:
        return mesh
    try:  # `with mesh:` in older jax
        from jax._src import mesh as mesh_lib

        physical = mesh_lib.thread_resources.env.physical_mesh
        return None if physical.empty else physical
    except (ImportError, AttributeError):
        return None


def _argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nums):
        raise ValueError(f"jbps.value_and_grad: argnums must be a non-negative int or a tuple of them, got {argnums!r}")
    return nums


def value_and_grad(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: Hashable = "data",
    mesh: Any = None,
    **psum_options: Any,
) -> Callable:
    """jax.value_and_grad(fun, argnums, has_aux), averaged over the mesh's
    `axis_name` and every worker.

    The arguments in `argnums` (the parameters) are replicated over the data
    axis; every other argument is a batch, split over it along its first
    dimension, as a NamedSharding(mesh, P(axis_name)) places it. `fun`
    returns the mean loss of the slice it is given; the loss, the gradient
    and the aux (with has_aux) come back averaged over the whole job's batch,
    replicated. mesh: a jax.sharding.Mesh; by default the one jax.set_mesh
    (or `with mesh:`) made current. psum_options go to jbps.pmean (name,
    priority, bucket_bytes, compression="bf16"/"fp16").
    """
    nums = _argnums(argnums)
    grad_fn = jax.value_and_grad(fun, argnums=nums if len(nums) > 1 else nums[0], has_aux=has_aux)

    def averaged(*args):
        the_mesh = mesh if mesh is not None else _context_mesh()
        if the_mesh is None:
            raise ValueError(
                "jbps.value_and_grad: no mesh: pass mesh=, or call it under jax.set_mesh(mesh) (or `with mesh:`)"
            )
        names = tuple(the_mesh.axis_names)
        if axis_name not in names:
            raise ValueError(f"jbps.value_and_grad: the mesh has no axis {axis_name!r} (its axes: {names})")
        if any(n >= len(args) for n in nums):
            raise ValueError(f"jbps.value_and_grad: argnums {nums} but the function was given {len(args)} arguments")
        size = dict(the_mesh.shape)[axis_name]
        explicit = _is_explicit(the_mesh, axis_name)
        specs, placed = [], []
        for i, arg in enumerate(args):
            if i in nums:
                if explicit:
                    _check_not_split(arg, i, axis_name)
                specs.append(P())
                placed.append(arg)
                continue
            _check_batch(arg, i, axis_name, size)
            specs.append(P(axis_name))
            # Explicit sharding types the batch's placement: split it over the data axis, as the specs say.
            target = P(axis_name) if mesh is None else NamedSharding(the_mesh, P(axis_name))
            placed.append(jax.tree_util.tree_map(lambda x: jax.reshard(x, target), arg) if explicit else arg)
        args = tuple(placed)

        # Mesh axes besides the data axis (model, tensor): their devices hold the same gradient.
        others = tuple(n for n in names if n != axis_name and dict(the_mesh.shape)[n] > 1)
        if not others:

            def body(*local):
                return pmean(grad_fn(*local), axis_name, **psum_options)

            value, grads = _manual(body, the_mesh, tuple(specs), P(), (axis_name,))(*args)
        else:
            # The mean over the machine's data devices first (XLA's own), then the workers' in
            # slices: each device of the mesh pushes 1/m of every leaf, so the servers get the
            # gradient once, not once per device along the other axes.
            def local_mean(*local):
                return lax.pmean(grad_fn(*local), axis_name)

            if size > 1:
                result = _manual(local_mean, the_mesh, tuple(specs), P(), (axis_name,))(*args)
            else:  # nothing to average on the machine (and XLA cannot partition a mean over one device)
                result = grad_fn(*args)
            if explicit:  # typed as split over the other axes: gathered whole first, as the slicing wants
                whole = P() if mesh is None else NamedSharding(the_mesh, P())
                result = jax.tree_util.tree_map(lambda x: jax.reshard(x, whole), result)
            spread = partial(_pmean_in_slices, axes=names, options=psum_options)
            value, grads = _manual(spread, the_mesh, (P(),), P(), names)(result)
        if explicit:  # typed shardings: each gradient comes back placed as its parameter is
            params = args[nums[0]] if len(nums) == 1 else tuple(args[n] for n in nums)
            grads = jax.tree_util.tree_map(lambda g, p: jax.reshard(g, jax.typeof(p).sharding), grads, params)
        return value, grads

    return averaged


def _check_batch(arg: Any, index: int, axis_name: Hashable, size: int) -> None:
    """A clear error naming the leaf whose first dimension the data axis does not divide."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
        shape = getattr(leaf, "shape", ())
        if not shape or shape[0] % size:
            where = f"argument {index}{jax.tree_util.keystr(path)}"
            raise ValueError(
                f"jbps.value_and_grad: {where} has shape {tuple(shape)}: a batch argument needs a first "
                f"dimension divisible by the {size} devices of axis {axis_name!r} (or pass it in argnums)"
            )


def _is_explicit(mesh: Any, axis_name: Hashable) -> bool:
    """Whether the mesh types `axis_name` as an explicit sharding axis (jax >= 0.6)."""
    types = getattr(mesh, "axis_types", None)
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if types is None or explicit is None:
        return False
    return dict(zip(mesh.axis_names, types)).get(axis_name) == explicit


def _check_not_split(arg: Any, index: int, axis_name: Hashable) -> None:
    """A clear error naming a parameter typed as split over the data axis (FSDP), which this does not gather."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
        spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None) or ()
        used = {a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))}
        if axis_name in used:
            raise ValueError(
                f"jbps.value_and_grad: parameter argument {index}{jax.tree_util.keystr(path)} is sharded over the "
                f"data axis {axis_name!r} ({spec}); jbps averages replicated parameters only (no FSDP): "
                "replicate it over that axis"
            )


def _manual(f: Callable, mesh: Any, in_specs: tuple, out_specs: Any, axes: tuple) -> Callable:
    """shard_map(f) manual over `axes` only, the mesh's other axes left to the partitioner."""
    if "axis_names" in _PARAMS:
        manual = {"axis_names": frozenset(axes)}
    else:  # jax < 0.7 names the axes left to the partitioner instead
        manual = {"auto": frozenset(mesh.axis_names) - set(axes)}
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **manual, **{_CHECK: False})


def _pmean_in_slices(tree: Any, *, axes: tuple, options: dict) -> Any:
    """The mean over the workers of a tree every device of the mesh (manual over
    `axes`, all of them) holds whole: each device pushes its 1/m of every leaf
    (jbps.pmean with axis_name=(): the devices sum apart, each on keys of its
    own), and an all-gather over the mesh, on the machine, puts them together."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    m = lax.psum(1, axes)  # a Python int: the mesh's devices
    index = lax.axis_index(axes)
    pieces = []
    for x in leaves:
        flat = jnp.asarray(x).reshape(-1)
        per = -(-flat.size // m)
        flat = jnp.pad(flat, (0, per * m - flat.size))
        pieces.append(lax.dynamic_slice_in_dim(flat, index * per, per))
    summed = jax.tree_util.tree_leaves(pmean(jax.tree_util.tree_unflatten(treedef, pieces), (), **options))
    out = [lax.all_gather(s, axes, tiled=True)[: jnp.size(x)].reshape(jnp.shape(x)) for s, x in zip(summed, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)
