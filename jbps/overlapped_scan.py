"""jbps.scan: several training steps in one compiled program, so that a step's
forward pass starts on the first layers' new parameters while the previous
step's later sums are still on the network (BytePS's priority at work).

The contract is lax.scan's: step(carry, x) -> (carry, y), the carry the same
tree of shapes and dtypes after every step. The steps are unrolled (XLA runs a
loop's body one iteration at a time, so a rolled loop could not overlap them),
and the psums traced in the step itself (jbps.psum, jbps.optax.distributed)
are held to the program's end (ops/held.py) instead of joining their buckets.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax._src import core

from .ops import held

WHAT = "jbps.scan"


def scan(
    step: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any = None, length: int | None = None
) -> tuple[Any, Any]:
    """lax.scan(step, init, xs, length), its steps unrolled in one program and
    overlapped: on XLA:CPU with one device a worker, each update waits for its
    own sums only, and the next step's forward pass runs on the layers whose
    sums are back while the later layers' still travel (with priority=
    jbps.forward_order(params), the first layers' come back first). Returns
    (the last carry, the steps' y stacked), as lax.scan.

    Use it inside jax.jit (outside, it jits itself, as lax.scan does), with
    the psum in `step` itself (jbps.psum, jbps.optax.distributed): a psum
    under a nested jit, grad or shard_map in the step is summed as in a
    program of one step (its buckets joined: the same sums, no overlap with
    the next step). With several devices a worker, and on the GPU, every psum
    joins its buckets too. Each step's starting carry and its gradients stay
    in memory to the program's end (about `length` x (carry + gradients)),
    and compile time grows with `length`: a few steps (2-8) are enough.
    """
    n = _length(xs, length)
    if not any(isinstance(v, core.Tracer) for v in jax.tree_util.tree_leaves((init, xs))):
        return _jitted(step, init, xs, n)
    return _unrolled(step, init, xs, n)


@partial(jax.jit, static_argnums=(0, 3))
def _jitted(step, init, xs, n):
    return _unrolled(step, init, xs, n)


def _length(xs, length) -> int:
    sizes = {
        jax.tree_util.keystr(path): (jnp.shape(v)[0] if jnp.ndim(v) else None)
        for path, v in jax.tree_util.tree_leaves_with_path(xs)
    }
    for path, size in sizes.items():
        if size is None:
            raise ValueError(f"{WHAT}: xs leaf {path or 'xs'} is a scalar; every leaf needs a leading axis of steps")
    found = set(sizes.values())
    if len(found) > 1:
        raise ValueError(f"{WHAT}: xs leaves differ in their leading axis (steps): {sizes}")
    if length is None:
        if not found:
            raise ValueError(f"{WHAT}: give length= when xs has no leaves")
        length = found.pop()
    elif found and found != {length}:
        raise ValueError(f"{WHAT}: length={length} but xs has {found.pop()} steps")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"{WHAT}: length must be a positive int, got {length!r}")
    return length


def _unrolled(step, init, xs, n):
    spec = _describe(init)
    carry, ys = init, []
    kept: list = []  # what each step's updates read: the carry it started from, and its sums
    with held.holding() as state:
        for i in range(n):
            x = None if xs is None else jax.tree_util.tree_map(lambda v: v[i], xs)
            kept += [v for v in jax.tree_util.tree_leaves(carry) if isinstance(v, core.Tracer)]
            out = step(carry, x)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(f"{WHAT}: step must return a pair (carry, y), got {type(out).__name__}")
            carry, y = out
            _check_carry(spec, carry, i)
            ys.append(y)
            kept += state.take()
        if state.other_calls and not state.held_calls:
            warnings.warn(
                f"{WHAT}: the step's psums were traced under a nested jit, grad, vmap or shard_map, so "
                "each joins its buckets as in a program of one step (the same sums, not overlapped with "
                "the next step); call jbps.psum or jbps.optax.distributed in the step itself",
                stacklevel=3,
            )
        if state.held_calls:  # else no psum skipped its join: nothing to keep
            leaves, tree = jax.tree_util.tree_flatten(carry)
            carry = jax.tree_util.tree_unflatten(tree, held.release(leaves, kept))
    stacked = jax.tree_util.tree_map(lambda *v: jnp.stack(v), *ys) if ys[0] is not None else None
    return carry, stacked


def _describe(tree) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {
        jax.tree_util.keystr(path): (tuple(jnp.shape(v)), jnp.result_type(v))
        for path, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def _check_carry(spec, carry, i: int) -> None:
    """The carry must keep its tree, shapes and dtypes (lax.scan's contract)."""
    got = _describe(carry)
    for path in spec.keys() | got.keys():
        if path not in got:
            raise TypeError(f"{WHAT}: step {i} returned a carry without leaf {path or 'carry'}")
        if path not in spec:
            raise TypeError(f"{WHAT}: step {i} returned a carry with a new leaf {path}")
        if spec[path] != got[path]:
            (s0, d0), (s1, d1) = spec[path], got[path]
            raise TypeError(
                f"{WHAT}: step {i} changed carry leaf {path or 'carry'} from {d0}{list(s0)} to {d1}{list(s1)}"
            )
