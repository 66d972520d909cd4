"""How jax types a value's replication over mapped axes, for every supported jax.

A psum's result is the same on every device of the axes it reduced over, and
shard_map proves `out_specs` from that: an output may leave out a mesh axis
only if it is replicated over it. The mechanism changed across jax versions:

- jax with `check_vma` (shard_map's check in newer versions; 0.10 here):
  avals carry the axes a value varies over. lax.psum takes a value varying over
  its axes (pvary-ing one that is not) and returns one invariant over them, and
  its transpose is a pvary: no communication. 0.10 keeps the set in
  `aval.mat.varying`, earlier ones in `aval.vma`.
- jax 0.5 (`check_rep`): shard_map infers replication with a rule per
  primitive and rewrites psum so that its inputs are pbroadcast to varying and
  its transpose is a pbroadcast.

jbps.psum follows both: `register_check_rep_rules` adds the jax 0.5 rules, the
rest types avals and casts values where avals carry the set. Everything here
reads jax internals, so it is feature-tested rather than version-tested.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

from jax._src import config as jax_config
from jax._src import core
from jax._src import mesh as mesh_lib

AxisName = Hashable

# jax 0.5's shard_map (jax.experimental.shard_map) keeps its replication
# rules in module dicts; later versions type avals instead and have none.
try:
    from jax.experimental import shard_map as _shard_map_05

    _CHECK_RULES = getattr(_shard_map_05, "_check_rules", None)
    _REWRITE_RULES = getattr(_shard_map_05, "_rewrite_rules", None)
    _PBROADCAST = getattr(_shard_map_05, "pbroadcast", None)
except ImportError:  # pragma: no cover - every supported jax has the module
    _CHECK_RULES = _REWRITE_RULES = _PBROADCAST = None


# The abstract value of a concrete or traced array (core.get_aval in older jax, 0.5 among them).
aval_of: Callable[[Any], Any] = getattr(core, "typeof", None) or getattr(core, "get_aval")


def typed() -> bool:
    """Whether the trace in progress types replication in avals (shard_map
    with check_vma on). pmap and shard_map(check_vma=False) do not."""
    flag = getattr(jax_config, "_check_vma", None)
    return bool(flag is not None and flag.value)


def varying(aval: Any) -> frozenset:
    """The mapped axes a value may differ along (empty where avals carry none)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def unreduced(aval: Any) -> frozenset:
    """The mapped axes a value is typed unreduced along (explicit sharding's
    partial sums, which a psum over them reduces; empty before jax 0.9)."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "unreduced", ()) or ())


def summed_over(aval: Any, axes: frozenset) -> Any:
    """`aval` after a psum over `axes`: neither varying nor unreduced along them."""
    mat = getattr(aval, "mat", None)
    if mat is not None and getattr(mat, "unreduced", None):
        left = frozenset(mat.unreduced) - axes
        kind = {} if left or not hasattr(mat, "unreduced_kind") else {"unreduced_kind": None}  # jax >= 0.11
        mat = mat.update(unreduced=left, **kind)
        aval = aval.update(manual_axis_type=mat)
    return with_varying(aval, varying(aval) - axes)


def with_varying(aval: Any, names: frozenset) -> Any:
    """`aval` typed as varying along exactly `names`."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=names))
    if hasattr(aval, "vma"):
        return aval.update(vma=names)
    return aval


def _typed_axes(axes: Sequence[AxisName]) -> tuple[AxisName, ...]:
    """The axes among `axes` that avals type: the mesh's manual axes, not
    vmap axes (where the mesh does not say, all of them)."""
    manual = getattr(mesh_lib.get_abstract_mesh(), "manual_axes", None)
    return tuple(axes) if manual is None else tuple(a for a in axes if a in manual)


def pvary(x: Any, axes: Sequence[AxisName]) -> Any:
    """x typed as varying along `axes` too (the value is unchanged): what a
    psum's transpose is where replication is typed."""
    aval = aval_of(x)
    # Unreduced along an axis is what a psum over it takes, as varying is.
    missing = tuple(a for a in _typed_axes(axes) if a not in varying(aval) | unreduced(aval))
    if not missing:
        return x
    if hasattr(core, "pvary"):
        return core.pvary(x, missing)
    if _PBROADCAST is not None:
        return _PBROADCAST(x, missing)
    return x


def cotangent_of(ct: Any, aval: Any, axes: Sequence[AxisName]) -> Any:
    """A psum's cotangent, invariant along `axes`, typed as its input's:
    varying along them (pvary), or reduced where the input was typed unreduced
    or reduced (explicit sharding: lax's transpose of a psum of an unreduced
    value is a cast to reduced)."""
    mat = getattr(aval, "mat", None)
    typed_reduced = unreduced(aval) | frozenset(getattr(mat, "reduced", ()) or ())
    cut = tuple(a for a in axes if a in typed_reduced)
    if cut:
        from jax import lax

        ct = lax.pcast(ct, cut, to="reduced")
    return pvary(ct, tuple(a for a in axes if a not in cut))


def register_check_rep_rules(
    prim: core.Primitive, axes_of: Callable[[dict], tuple], rewritten: Callable[[dict], dict]
) -> None:
    """jax 0.5's shard_map rules for a psum-like primitive: the output is
    replicated over the reduced axes (`axes_of(params)`); the rewrite makes the
    inputs varying over them and binds `rewritten(params)` (the variant whose
    transpose is a pbroadcast), as jax does for lax.psum. No-op elsewhere."""
    if _CHECK_RULES is None or _REWRITE_RULES is None or _PBROADCAST is None:
        return

    def check(mesh, *in_rep, **params):
        axes = set(axes_of(params))
        return [(set(mesh.axis_names) if rep is None else rep) | axes for rep in in_rep]

    def rewrite(mesh, in_rep, *args, **params):
        axes = set(axes_of(params))
        args = [_PBROADCAST(x, tuple(n for n in mesh.axis_names if n in axes & rep)) for x, rep in zip(args, in_rep)]
        return prim.bind(*args, **rewritten(params)), [rep | axes for rep in in_rep]

    _CHECK_RULES[prim] = check
    _REWRITE_RULES[prim] = rewrite
