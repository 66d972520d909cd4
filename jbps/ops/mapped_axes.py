"""The device axes a psum runs under, read where jax knows them for certain.

At trace time an axis name in jax's axis environment may be a vmap axis (not a
device axis) that only batching, later, will remove: behind a jit, nothing
tells them apart. When a computation is lowered every vmap axis has been
batched away, and the lowering context says which devices it spans:
shard_map's manual mesh axes (pmap's axis too, in the jax versions that run
pmap on shard_map), pmap's replica axes in those that do not.
"""

from __future__ import annotations

from typing import Any, Hashable

from jax._src import sharding_impls

AxisName = Hashable
Axes = tuple[tuple[AxisName, int], ...]  # (name, size), outermost first

# pmap's own lowering context, gone once pmap runs on shard_map.
_ReplicaAxisContext = getattr(sharding_impls, "ReplicaAxisContext", None)
# What pmap calls an axis it was not given a name for.
_UNNAMED_PMAP_AXES = ("_internal_pmap_axis_name",)


def describe(name: AxisName) -> str:
    if name in _UNNAMED_PMAP_AXES or type(name).__name__ == "_TempAxisName":
        return "an unnamed pmap axis"
    return repr(name)


def device_axes(lowering_ctx: Any) -> Axes:
    """The mapped device axes at this point of the lowering, with sizes.

    A plain jit has none, also over several devices: the partitioner then runs
    the call on each of them with the same replicated operands (and keys), so
    the sums are right, at that many times the traffic. Mesh axes that
    shard_map leaves to the partitioner are the same.
    """
    axis_ctx = lowering_ctx.module_context.axis_context
    if isinstance(axis_ctx, sharding_impls.SPMDAxisContext):
        shape = dict(axis_ctx.mesh.shape)
        return tuple((n, shape[n]) for n in shape if n in axis_ctx.manual_axes)
    if _ReplicaAxisContext is not None and isinstance(axis_ctx, _ReplicaAxisContext):
        return tuple(zip(axis_ctx.axis_env.names, axis_ctx.axis_env.sizes))
    return ()


def split(axis_name: tuple[AxisName, ...] | None, mapped: Axes, what: str) -> tuple[Axes, Axes]:
    """(reduced, grouped): the mapped axes the psum sums over, and those it
    keeps apart (a separate sum for each position along them, as lax.psum
    over some axes of a mesh does).

    No axis_name under a mapped device axis is refused: jbps would sum each
    device's value over the workers only, where "the sum over all devices" was
    surely meant, and lax.psum cannot be called without its axes either.
    """
    if axis_name is None:
        if mapped:
            names = ", ".join(describe(n) for n, _ in mapped)
            if any(describe(n) != repr(n) for n, _ in mapped):
                fix = "give pmap an axis_name and pass it here"
            else:
                fix = f"e.g. axis_name={tuple(n for n, _ in mapped)!r} for all of them"
            raise ValueError(
                f"{what}: called without axis_name inside a map over devices (mapped axes: {names}); "
                f"name the axes to sum over as lax.psum needs them ({fix}); axis_name=() sums "
                "each device's value over the workers only"
            )
        return (), ()
    sizes = dict(mapped)
    unknown = [a for a in axis_name if a not in sizes]
    if unknown:
        raise ValueError(
            f"{what}: axes {unknown} are not device axes here (mapped device axes: {[n for n, _ in mapped]})"
        )
    return tuple((a, sizes[a]) for a in axis_name), tuple((n, s) for n, s in mapped if n not in axis_name)
