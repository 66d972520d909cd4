"""jbps.broadcast: every device of every worker ends with the root's values,
bit for bit.

BytePS's way: the root contributes its values, everyone else zeros, and the
servers sum. To make that exact for every dtype (a float sum would turn -0.0
into +0.0 and may quiet NaNs), each leaf travels as int32 words that hold its
bits: x + 0 is x for integers, whatever the bits mean.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import runtime
from .psum import axes_words, psum


def _check_dtype(dtype: Any, path: str) -> None:
    dtype = np.dtype(dtype)
    if not (dtype == np.bool_ or dtype.kind in "iu" or jnp.issubdtype(dtype, jnp.floating)):
        raise TypeError(
            f"jbps.broadcast: leaf {path or '<root>'} has dtype {dtype.name}, which jbps cannot "
            "broadcast (supported: bool, integer and floating types)"
        )


def _to_words(x: jax.Array) -> jax.Array:
    """x's bits as int32: one word per 4-byte element, one per smaller element
    (zero-extended), two per 8-byte element (a trailing axis of 2)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(jnp.int32)
    if dtype.itemsize in (4, 8):
        return lax.bitcast_convert_type(x, jnp.int32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[dtype.itemsize]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.int32)


def _from_words(words: jax.Array, like: jax.Array) -> jax.Array:
    dtype = np.dtype(like.dtype)
    if dtype == np.bool_:
        return words != 0
    if dtype.itemsize in (4, 8):
        return lax.bitcast_convert_type(words, dtype)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[dtype.itemsize]
    return lax.bitcast_convert_type(words.astype(unsigned), dtype)


def _is_traced(leaves: list) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


def _check_root(root: Any) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"jbps.broadcast: root must be a worker rank (an int), got {root!r}")
    if not 0 <= root < runtime.size():
        raise ValueError(f"jbps.broadcast: root {root} is out of range for {runtime.size()} workers")
    return int(root)


def _broadcast_traced(tree: Any, root: int, axis_name: Any, name: str) -> Any:
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [jnp.asarray(x) for _, x in path_leaves]
    words = [_to_words(x) for x in leaves]
    # Only the root worker's first device along the mapped axes contributes.
    contributes = runtime.rank() == root
    if axis_name is not None:
        first = lax.axis_index(axis_name) == 0
        words = [jnp.where(first, w, 0) if contributes else jnp.zeros_like(w) for w in words]
    elif not contributes:
        words = [jnp.zeros_like(w) for w in words]
    # One call: the root's program differs from the others' (zeros here), so
    # XLA may order buckets differently on each, and where it runs them one by
    # one (small programs) each worker would wait on a different bucket.
    summed = psum(words, axis_name, name=name, bucket_bytes=0)
    return jax.tree_util.tree_unflatten(treedef, [_from_words(s, x) for s, x in zip(summed, leaves)])


def broadcast(tree: Any, root: int = 0, axis_name: Any = None, *, name: str | None = None) -> Any:
    """Returns `tree` with every leaf replaced by the root worker's value.

    Call it eagerly (it compiles itself) or inside jit/pmap/shard_map; under
    pmap/shard_map give the mapped axis, and the root's first device along it
    is the source. Every worker must call it with the same tree structure,
    shapes and dtypes; the result is bitwise identical on every worker.
    """
    runtime.config()  # a clear error before init()
    root = _check_root(root)
    path_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not path_leaves:
        return tree
    for path, x in path_leaves:  # dtype errors before anything is compiled
        _check_dtype(jnp.result_type(x), jax.tree_util.keystr(path))
    if name is None:
        shapes = tuple((jax.tree_util.keystr(p), np.shape(x), str(jnp.result_type(x))) for p, x in path_leaves)
        name = runtime.auto_name("broadcast", shapes, root, axes_words(axis_name))
    if _is_traced([x for _, x in path_leaves]) or axis_name is not None:
        return _broadcast_traced(tree, root, axis_name, name)
    return jax.jit(partial(_broadcast_traced, root=root, axis_name=None, name=name))(tree)


def broadcast_parameters(params: Any, root: int = 0) -> Any:
    """broadcast(params, root): call once after init so every worker starts
    from the same parameters (Horovod's broadcast_parameters; JAX arrays are
    immutable, so the broadcast tree is returned, not written in place)."""
    return broadcast(params, root)
