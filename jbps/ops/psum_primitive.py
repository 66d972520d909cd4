"""The jbps_psum primitive: a psum over mapped axes and over every worker.

A primitive, not a traced Python function, because what a psum does depends
on which of its axes map over devices, and that is only certain when it is
lowered (see mapped_axes.py): vmap axes are handled by the batching rule, the
device axes by the lowering, which builds the hierarchical reduce:
psum_scatter over the reduced axes (XLA's own local reduce), one jbps_psum
custom call per device on its shard, all_gather back.

`typed` marks a call whose result is typed replicated over its axes (shard_map
with check_vma, or jax 0.5's check_rep rewrite): its transpose sums the
cotangent over the workers only, since jax's typing already summed it over
the mapped axes, where the untyped psum's transpose is a psum (see
replication.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from functools import partial
from typing import Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax._src import core, dispatch
from jax._src.interpreters import ad, batching, mlir

from .. import runtime
from ..partition import make_plan
from ..partition.plan import tree_description
from . import buckets, held, kept_operands, mapped_axes, places, replication
from .compression import feedback_codec
from .ffi import join, push_pull
from .side_stream import on_stream

AxisName = Hashable
WHAT = "jbps.psum"

# Where a psum's buckets each run on a stream of their own (side_stream.py):
# XLA:GPU, whose custom calls otherwise wait on the compute stream. Buckets
# take SIDE_STREAMS streams in turn, so that many are on the network at once.
SIDE_STREAM_PLATFORMS = ("cuda",)
SIDE_STREAMS = 4


@dataclasses.dataclass(frozen=True)
class PsumSpec:
    """Everything static about one psum call (a hashable primitive parameter)."""

    name: str
    axes: tuple[AxisName, ...] | None  # None: not given (refused under mapped device axes)
    paths: tuple[str, ...]
    priorities: tuple[int, ...] | None  # one per leaf; None: pytree order
    # 0: one custom call; else buckets of about this many bytes (buckets.py); None: the
    # default for the tree's size, decided where it is lowered (runtime.bucket_bytes)
    bucket_bytes: int | None = 0
    # A codec with error feedback, "onebit", "topk" or "topk:FRACTION" (onebit.py, topk.py): the
    # operands are the leaves then one residual per leaf, the results their
    # sums then the new residuals.
    feedback: str | None = None
    # Bound inside jbps.scan's own trace (held.py): on XLA:CPU with one device a
    # worker, the buckets' sums are not joined; the scan holds them to its end.
    held: bool = False

    def select(self, keep: Sequence[int], suffix: str, axes: tuple[AxisName, ...] | None = None) -> "PsumSpec":
        """The spec of a derived call (tangent, transpose) over leaves `keep`."""
        return PsumSpec(
            name=self.name + suffix,
            axes=self.axes if axes is None else axes,
            paths=tuple(self.paths[i] for i in keep),
            priorities=None if self.priorities is None else tuple(self.priorities[i] for i in keep),
            bucket_bytes=self.bucket_bytes,
            feedback=self.feedback,
        )


psum_p = core.Primitive("jbps_psum")
psum_p.multiple_results = True


def bind(leaves: Sequence[jax.Array], spec: PsumSpec) -> list[jax.Array]:
    typed = replication.typed()
    if typed and spec.axes:
        # As lax.psum does: a value invariant along an axis is summed as
        # |axis| copies, and must be typed varying to be reduced.
        leaves = [replication.pvary(x, spec.axes) for x in leaves]
    explicit = _explicit_axes_beside_manual()
    if explicit:
        specs = tuple(_spec_along(x, explicit) for x in leaves)
        return _manual_over(explicit, list(leaves), specs, spec, typed)
    if held.wants_hold():
        out = psum_p.bind(*leaves, spec=dataclasses.replace(spec, held=True), typed=typed)
        held.hold(out)
        return out
    return psum_p.bind(*leaves, spec=spec, typed=typed)


def _explicit_axes_beside_manual() -> tuple[AxisName, ...]:
    """The context mesh's Explicit axes in a shard_map manual over its other
    axes (explicit sharding mode): values there carry shardings along them,
    which jax's own reduce-scatter cannot lower (jax 0.10-0.12)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or getattr(mesh, "empty", True) or not getattr(mesh, "manual_axes", ()):
        return ()
    vmapped = _vmapped_mesh_axes()  # a vmap over such an axis slices its batch itself (_batch)
    return tuple(a for a in getattr(mesh, "explicit_axes", ()) if a not in vmapped)


def _vmapped_mesh_axes() -> set:
    """The Explicit mesh axes that the vmaps being traced batch over."""
    axes: set = set()
    ctx = getattr(core, "trace_ctx", None)
    trace = getattr(ctx, "trace", None)
    while trace is not None:
        axis_data = getattr(trace, "axis_data", None)
        axes.update(getattr(axis_data, "explicit_mesh_axis", None) or ())
        trace = getattr(trace, "parent_trace", None)
    return axes


def _spec_along(x, axes):
    """x's partition spec, keeping only the mesh axes in `axes`."""
    spec = tuple(replication.aval_of(x).sharding.spec)
    kept = []
    for entry in spec + (None,) * (jnp.ndim(x) - len(spec)):
        names = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        names = tuple(n for n in names if n in axes)
        kept.append(names[0] if len(names) == 1 else names or None)
    return P(*kept)


def _manual_over(mesh_axes, leaves, specs, spec, typed):
    """psum_p over `leaves` in a shard_map manual over `mesh_axes` too, each
    leaf sliced along them by `specs`: each device sums its slice (devices at
    other positions along them: sums of their own, as lax.psum keeps a
    sharded value's slices apart; a leaf replicated along them sums the same
    in each). With no axes named (outside any shard_map's axes), the psum
    is over the workers only."""
    inner = dataclasses.replace(spec, axes=spec.axes or ())

    def local(*xs):
        return tuple(psum_p.bind(*xs, spec=inner, typed=typed))

    # Under jit: a shard_map run eagerly inside an eager shard_map cannot
    # reshard its result (jax 0.10).
    sliced = jax.shard_map(local, in_specs=specs, out_specs=specs, axis_names=set(mesh_axes), check_vma=typed)
    with core.remove_explicit_mesh_axis_names(mesh_axes):
        return list(jax.jit(sliced)(*leaves))


psum_p.def_impl(partial(dispatch.apply_primitive, psum_p))


def _abstract_eval(*avals, spec, typed):
    if not typed or not spec.axes:
        return list(avals)
    return [replication.summed_over(a, frozenset(spec.axes)) for a in avals]


psum_p.def_abstract_eval(_abstract_eval)


def _not_with_feedback(spec, what):
    if spec.feedback:
        raise NotImplementedError(
            f"jbps: {what} of a psum with {spec.feedback} compression (its error feedback is "
            f"per call, not elementwise): use it on gradients, as the optax wrappers do"
        )


def _batch(axis_data, vals, dims, *, spec, typed):
    _not_with_feedback(spec, "vmap")
    explicit = getattr(axis_data, "explicit_mesh_axis", None)  # jax >= 0.7
    if explicit and (spec.axes is None or axis_data.name not in spec.axes):
        return _batch_over_explicit_axes(explicit, vals, dims, spec=spec, typed=typed)
    if spec.axes is None or axis_data.name not in spec.axes:
        # Elementwise: a batch of sums is the sum of the batch.
        return psum_p.bind(*vals, spec=spec, typed=typed), list(dims)
    # The vmap axis is one of the axes summed over: sum it here, on the
    # device, and the rest as before; the result is the same for every element.
    summed = [x * axis_data.size if d is None else jnp.sum(x, axis=d, dtype=x.dtype) for x, d in zip(vals, dims)]
    rest = dataclasses.replace(spec, axes=tuple(a for a in spec.axes if a != axis_data.name))
    return psum_p.bind(*summed, spec=rest, typed=typed), [None] * len(vals)


def _batch_over_explicit_axes(mesh_axes, vals, dims, *, spec, typed):
    """vmap over an array sharded along Explicit mesh axes (explicit sharding
    mode): each device holds a slice of the batch, and the partitioner, not a
    manual axis, would place the custom call. A shard_map manual over those
    axes gives each device its slice (_manual_over); leaves not batched are
    replicated along them."""
    names = mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)
    specs = tuple(P() if d is None else P(*([None] * d), names) for d in dims)
    return _manual_over(mesh_axes, list(vals), specs, spec, typed), list(dims)


batching.fancy_primitive_batchers[psum_p] = _batch


def _live(values) -> list[int]:
    return [i for i, v in enumerate(values) if type(v) is not ad.Zero]


def _jvp(primals, tangents, *, spec, typed):
    _not_with_feedback(spec, "the derivative")
    out = psum_p.bind(*primals, spec=spec, typed=typed)
    live = _live(tangents)
    tangents_out = [ad.Zero(replication.aval_of(x).to_tangent_aval()) for x in out]
    if live:
        summed = psum_p.bind(*[tangents[i] for i in live], spec=spec.select(live, "/jvp"), typed=typed)
        for i, t in zip(live, summed):
            tangents_out[i] = t
    return out, tangents_out


ad.primitive_jvps[psum_p] = _jvp


def _transpose(cts, *args, spec, typed):
    _not_with_feedback(spec, "the transpose")
    live = _live(cts)
    out = [ad.Zero(x.aval) if ad.is_undefined_primal(x) else None for x in args]
    if not live:
        return out
    cts_live = [cts[i] for i in live]
    if typed:
        # The cotangent is typed invariant along the axes (jax already summed
        # it over them where it was pvary-ed); the workers are outside jax's
        # types, so each device still sums it over them.
        summed = psum_p.bind(*cts_live, spec=spec.select(live, "/grad", axes=()), typed=True)
        summed = [replication.cotangent_of(s, args[i].aval, spec.axes or ()) for i, s in zip(live, summed)]
    else:
        summed = psum_p.bind(*cts_live, spec=spec.select(live, "/grad"), typed=False)
    for i, s in zip(live, summed):
        out[i] = s
    return out


ad.primitive_transposes[psum_p] = _transpose

replication.register_check_rep_rules(
    psum_p, axes_of=lambda params: params["spec"].axes or (), rewritten=lambda params: dict(params, typed=True)
)


def _axis_index(axes: mapped_axes.Axes) -> jax.Array:
    if not axes:
        return jnp.zeros((), jnp.int32)
    return lax.axis_index(tuple(n for n, _ in axes)).astype(jnp.int32)


def device_slot(reduced: mapped_axes.Axes, grouped: mapped_axes.Axes) -> jax.Array:
    """The slot the engine keys this device's chunks by (partition/plan.py: g * L + s, for
    position g along `grouped` and s along `reduced`, which has L positions): unique among
    the worker's devices, the same for the devices of every worker that sum together."""
    return _axis_index(grouped) * math.prod(s for _, s in reduced) + _axis_index(reduced)


def _reduce_on_devices(
    *args: jax.Array,
    spec: PsumSpec,
    reduced: mapped_axes.Axes,
    grouped: mapped_axes.Axes,
    kept: Sequence[bool],
    on_cpu: bool,
    side_streams: bool = False,
) -> list[jax.Array]:
    """What one device runs: its part of the sum over `reduced` and every
    worker, apart from the devices at other positions along `grouped`.
    kept[i]: leaf i is a parameter its caller keeps (kept_operands.py);
    on_cpu: the program runs on XLA:CPU only (compressed leaves then go through
    jbps's own codecs around the calls, large ones in pieces: _Wire.pieces).
    side_streams: several buckets each run on a stream of their own
    (side_stream.py). With spec.feedback, args are the leaves then their
    residuals, and so are the results."""
    num_shards = math.prod(s for _, s in reduced)
    num_groups = math.prod(s for _, s in grouped)
    names = tuple(n for n, _ in reduced)
    leaves = args[: len(args) // 2] if spec.feedback else args
    residuals = list(args[len(leaves) :])
    out = list(leaves)
    live = [i for i, x in enumerate(leaves) if x.size > 0]  # empty arrays sum to themselves
    if not live:
        return out + residuals
    slot = device_slot(reduced, grouped)
    ranks = spec.priorities or tuple(-i for i in range(len(leaves)))
    nbytes = [leaves[i].size * leaves[i].dtype.itemsize for i in live]
    bucket_bytes = spec.bucket_bytes if spec.bucket_bytes is not None else runtime.bucket_bytes(sum(nbytes))
    groups = buckets.split(nbytes, [ranks[i] for i in live], bucket_bytes)
    wire = _Wire(spec, leaves, tuple(residuals), names, num_shards, _axis_index(reduced), on_cpu)
    results: list[tuple[int, jax.Array]] = []  # (leaf, its summed shard)
    for b, members in enumerate(groups):
        idx = [live[m] for m in members]
        call = spec.name if len(groups) == 1 else f"{spec.name}/bucket{b}"
        stream = 1 + b % SIDE_STREAMS if side_streams and len(groups) > 1 else None
        summed, left = _push_pull_call(wire, idx, call, spec.paths, ranks, slot, num_groups, kept, stream)
        results.extend(zip(idx, summed))
        for i, r in left.items():
            residuals[i] = r
    summed = [s for _, s in results]
    # The join keeps each sum's buffer from the rest of the backward pass; a
    # held psum's sums are kept by jbps.scan's join at the program's end
    # instead, so each update waits for its own sum only. With several devices
    # a worker the join stays: every device fails together, before any
    # all-gather, should a later bucket fail; and there would be nothing to
    # gain, since XLA:CPU runs the devices' all-gathers in program order, the
    # first layer's (whose bucket comes last) after every other bucket's.
    if len(groups) > 1 and not (spec.held and on_cpu and num_shards == 1):
        summed = join(summed)
    for (i, _), s in zip(results, summed):
        s = wire.unpack(i, s)
        if num_shards > 1:
            s = lax.all_gather(s, names, axis=0, tiled=True)
        leaf = leaves[i]
        out[i] = s[: leaf.size].reshape(leaf.shape).astype(leaf.dtype)
    return out + residuals


# On XLA:CPU a compressed leaf's shard travels in pieces of about this many
# float32 bytes (at most MAX_PIECES; one below twice this), each piece its
# own custom call: XLA encodes a piece while the engine sends the one before,
# and decodes a piece while later ones are still on the network, where one
# call encoded all before the first byte left and decoded all after the last came.
PIECE_BYTES = 4 << 20
MAX_PIECES = 8


class _Wire:
    """Each leaf's shard as it travels: as it is, or (spec.feedback) onebit or topk
    records of the shard plus its residual, the new residual kept. On XLA:CPU
    a large compressed shard travels in pieces (PIECE_BYTES)."""

    def __init__(self, spec, leaves, residuals, names, num_shards, shard_index, on_cpu):
        self.leaves, self.residuals, self.names = leaves, residuals, names
        self.num_shards, self.shard_index, self.on_cpu = num_shards, shard_index, on_cpu
        codec = feedback_codec(spec.feedback)
        self.codec = [codec if codec and codec.compressed(x.shape, x.dtype) else None for x in leaves]

    def padded(self, i: int) -> int:
        """Elements of leaf i after padding: whole shards, compressed ones of whole blocks."""
        unit = self.num_shards * (self.codec[i].BLOCK if self.codec[i] else 1)
        return -(-self.leaves[i].size // unit) * unit

    def described(self, i: int) -> tuple[tuple[int, ...], np.dtype | str]:
        """(shape, dtype) as the tree check sees leaf i: its compression is part of it."""
        return self.leaves[i].shape, (self.codec[i].NAME if self.codec[i] else self.leaves[i].dtype)

    def pieces(self, i: int) -> list[tuple[int, int]]:
        """(first block, blocks) of each piece leaf i's shard travels in, on
        XLA:CPU with error feedback (encode_pieces); [] when it travels as shard() gives it."""
        codec = self.codec[i]
        if not codec or not self.on_cpu:
            return []
        blocks = self.padded(i) // self.num_shards // codec.BLOCK
        count = max(1, min(MAX_PIECES, blocks * codec.BLOCK * 4 // PIECE_BYTES))
        bounds = [blocks * p // count for p in range(count + 1)]
        return [(bounds[p], bounds[p + 1] - bounds[p]) for p in range(count)]

    def _flat(self, i: int) -> jax.Array:
        """This device's shard of leaf i, padded, reduce-scattered over the reduced axes."""
        x = self.leaves[i]
        flat = jnp.ravel(x).astype(jnp.float32) if self.codec[i] else jnp.ravel(x)
        padded = self.padded(i)
        if padded != x.size:
            flat = jnp.pad(flat, (0, padded - x.size))
        if self.num_shards > 1:
            flat = lax.psum_scatter(flat, self.names, scatter_dimension=0, tiled=True)
        return flat

    def _residual(self, i: int, n: int) -> tuple[jax.Array, jax.Array]:
        """The part of leaf i's residual that goes with this device's shard of
        `n` values, and the shard's first element in the leaf."""
        residual = jnp.pad(jnp.ravel(self.residuals[i]).astype(jnp.float32), (0, self.padded(i) - self.leaves[i].size))
        start = self.shard_index * n
        return lax.dynamic_slice(residual, (start,), (n,)), start

    def _new_residual(self, i: int, left: jax.Array) -> jax.Array:
        """What the encoding left of the shard, as leaf i's residual. Every
        reduced device ends with the whole new residual, so the residual is
        replicated as the sum is."""
        if self.num_shards > 1:
            left = lax.all_gather(left, self.names, axis=0, tiled=True)
        old = self.residuals[i]
        return left[: self.leaves[i].size].reshape(old.shape).astype(old.dtype)

    def shard(self, i: int) -> tuple[jax.Array, jax.Array | None]:
        """This device's shard of leaf i as it travels whole, and for a
        compressed leaf its new residual (else None)."""
        flat = self._flat(i)
        codec = self.codec[i]
        if not codec:
            return flat, None
        # Error feedback: encode the shard plus what earlier encodings lost,
        # keep what this one loses.
        residual, start = self._residual(i, flat.shape[0])
        records, left = codec.encode_shard(flat + residual, self.leaves[i].size, start)
        return records, self._new_residual(i, left)

    def encode_pieces(self, i: int) -> tuple[list[jax.Array], jax.Array, jax.Array]:
        """Error feedback as shard() gives it, on XLA:CPU: the records of each
        of leaf i's pieces, its new residual, and its shard's buffer, where
        decode_pieces puts the sums. The encoders add the shard to the
        residual block by block and leave what they do not send in the
        residual's buffer: nothing else is allocated or written."""
        codec = self.codec[i]
        flat = self._flat(i)
        residual, start = self._residual(i, flat.shape[0])
        records = []
        for first, blocks in self.pieces(i):
            piece, residual, flat = codec.encode_piece(residual, flat, self.leaves[i].size, start, first, blocks)
            records.append(piece)
        return records, self._new_residual(i, residual), flat

    def decode_pieces(self, i: int, summed: Sequence[jax.Array], into: jax.Array) -> jax.Array:
        """The summed pieces of leaf i decoded into `into` (encode_pieces' shard
        buffer), a piece as soon as its sum is in."""
        for (first, _), records in zip(self.pieces(i), summed):
            into = self.codec[i].decode_piece(into, records, first)
        return into

    def planned(self, i: int, blocks: int | None = None) -> tuple[tuple[int, ...], np.dtype]:
        """(shape, dtype) the plan cuts into chunks, across every reduced
        device (the plan cuts a shard of each): compressed records count as
        elements, `blocks` of them per shard for a piece."""
        codec = self.codec[i]
        if codec:
            return (
                (self.padded(i) // codec.BLOCK if blocks is None else blocks * self.num_shards),
            ), codec.RECORD_DTYPE
        return self.leaves[i].shape, self.leaves[i].dtype

    def unpack(self, i: int, summed: jax.Array) -> jax.Array:
        """A summed shard back in values (a leaf sent in pieces is decoded already)."""
        return self.codec[i].decode(summed) if self.codec[i] and not self.pieces(i) else summed


class _Part(NamedTuple):
    """What one psum call carries of a leaf: its shard, or a piece of it."""

    leaf: int
    shard: jax.Array
    planned: tuple[tuple[int, ...], np.dtype]  # (shape, dtype) as the plan cuts it
    path: str
    in_place: bool


def _push_pull_call(wire, idx, call, paths, priorities, slot, num_groups, kept, stream=None):
    """The jbps_psum custom calls of leaves `idx` (all non-empty), named
    `call`: one over each device's shard of every leaf (wire.shard), or, when
    some travel in pieces (wire.pieces), one per piece: call j carries piece j
    of each leaf in pieces, and the first also the leaves that travel whole.
    stream: run each on that XLA:GPU stream (side_stream.py).
    Returns the summed shards in `idx` order (as they travel; a leaf in pieces
    decoded already), and the new residuals of the compressed leaves, by leaf."""
    pieces = {i: wire.pieces(i) for i in idx}
    count = max(len(p) for p in pieces.values()) or 1
    left, into, parts = {}, {}, [[] for _ in range(count)]  # parts[j]: what call j carries
    for i in idx:
        if pieces[i]:
            records, left[i], into[i] = wire.encode_pieces(i)
            for j, (_, blocks) in enumerate(pieces[i]):
                path = paths[i] if len(pieces[i]) == 1 else f"{paths[i]} piece {j + 1}/{len(pieces[i])}"
                parts[j].append(_Part(i, records[j], wire.planned(i, blocks), path, True))
            continue
        shard, residual = wire.shard(i)
        if residual is not None:
            left[i] = residual
        # A kept parameter that reaches the custom call as it is gets a fresh output.
        in_place = not (
            kept[i] and wire.num_shards == 1 and wire.codec[i] is None and wire.padded(i) == wire.leaves[i].size
        )
        parts[0].append(_Part(i, shard, wire.planned(i), paths[i], in_place))
    summed = {}
    for j, members in enumerate(parts):
        name = call if count == 1 else f"{call}/piece{j}"
        for part, s in zip(members, _push_pull_one(wire, members, name, priorities, slot, num_groups, stream)):
            summed.setdefault(part.leaf, []).append(s)
    out = [wire.decode_pieces(i, summed[i], into[i]) if pieces[i] else summed[i][0] for i in idx]
    return out, left


def _push_pull_one(wire, members, call, priorities, slot, num_groups, stream=None):
    """One jbps_psum custom call over `members` (_Part each): their summed
    shards. stream: the call runs on that XLA:GPU stream, in a function of its
    own, its sums in fresh buffers (no operand of a called function given up)."""
    idx = [m.leaf for m in members]
    shapes, dtypes = [m.planned[0] for m in members], [m.planned[1] for m in members]
    sub_paths = tuple(m.path for m in members)
    # What this worker sends: each group's devices share out one copy of every leaf.
    call_bytes = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in zip(shapes, dtypes)) * num_groups
    outlives = runtime.programs_outlive_membership()
    plan = make_plan(
        call,
        sub_paths,
        shapes,
        dtypes,
        wire.num_shards,
        num_groups=num_groups,
        partition_bytes=runtime.partition_bytes(call_bytes),
        server_fractions=(1.0,) if outlives else runtime.server_fractions(),
        ramp=runtime.spans_hosts(),
        priorities=tuple(priorities[i] for i in idx),
    )
    if outlives:  # routed to no server: the engine deals the chunks by its generation's split
        plan = dataclasses.replace(plan, chunk_servers=(-1,) * len(plan.chunk_servers))
    described = [wire.described(i) for i in idx]
    tree = tree_description(call, sub_paths, [d[0] for d in described], [d[1] for d in described])
    leaves = list(range(len(members)))
    shards = [m.shard for m in members]
    if stream is None:
        return push_pull(slot, shards, plan, leaves, tree, [m.in_place for m in members])
    return on_stream(lambda s, *xs: push_pull(s, xs, plan, leaves, tree, [False] * len(xs)), [slot, *shards], stream)


def _lower(ctx, *args, spec, typed):
    del typed  # the same computation; only its typing and transpose differ
    spec = dataclasses.replace(spec, name=places.place_name(ctx.module_context, spec.name))
    mapped = mapped_axes.device_axes(ctx)
    reduced, grouped = mapped_axes.split(spec.axes, mapped, WHAT)
    body = partial(
        _reduce_on_devices,
        spec=spec,
        reduced=reduced,
        grouped=grouped,
        kept=kept_operands.kept_parameters(args),
        on_cpu=tuple(ctx.module_context.platforms) == ("cpu",),
        side_streams=tuple(ctx.module_context.platforms) == SIDE_STREAM_PLATFORMS,
    )
    return mlir.lower_fun(body, multiple_results=True)(ctx, *args)


# Lowered where it is called, not as a function shared by every call of the same
# shapes (jax's lowering cache, where it has one): whether an operand is a
# parameter the caller keeps is a property of the call site (kept_operands.py).
places.install(psum_p)
if "cacheable" in inspect.signature(mlir.register_lowering).parameters:
    mlir.register_lowering(psum_p, _lower, cacheable=False)
else:
    mlir.register_lowering(psum_p, _lower)
