"""Compression on the wire: 16-bit floats for the bytes that travel.

`compression="bf16"` or `"fp16"` (Horovod's fp16 compression, BytePS's
bfloat16): each float32/float64 leaf is cast to the 16-bit type on the device
before the push, the servers add the 16-bit pushes into float32 accumulators
and round the sum once to the 16-bit type for the pull, and the device casts
it back to the leaf's dtype. Half the bytes each way, no state: the result is
the sum of the inputs rounded to 16 bits, added in float32, rounded to 16 bits.
Leaves already 16-bit, and integer leaves, travel as they are. Every worker
must use the same choice: a psum whose workers disagree fails with the tree
check's error naming the first leaf whose dtype differs.

`compression="onebit"` and `"topk"` (onebit.py, topk.py) need a residual per leaf, so only the
optax wrappers offer it, keeping the residual in their state. `"topk"` keeps 10
of every 1024 values; `"topk:FRACTION"` keeps round(FRACTION * 1024) of them,
FRACTION in (0, 0.5] (`"topk:0.05"`: 51).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import runtime
from . import ffi, onebit, topk

WIRE_TYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
_COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))
_HALVES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


# The codecs with error feedback, by name: they keep a residual, so only the
# optax wrappers (which have the state) offer them. "topk:FRACTION" names a
# topk codec that keeps another amount (feedback_codec).
FEEDBACK = {"onebit": onebit, "topk": topk.codec()}


def feedback_codec(compression: str | None, what: str = "jbps"):
    """The codec with error feedback that `compression` names (onebit.py's
    module or a topk.TopK), or None for the others. A ValueError naming
    `what` for "topk:FRACTION" with a FRACTION topk cannot keep."""
    if not isinstance(compression, str):
        return None
    if compression in FEEDBACK:
        return FEEDBACK[compression]
    if compression.startswith(topk.PREFIX):
        try:
            return topk.codec(topk.keep_of(compression[len(topk.PREFIX) :]))
        except ValueError as e:
            raise ValueError(f"{what}: compression={compression!r}: {e}") from None
    return None


def stateful(compression: str | None) -> bool:
    """Whether `compression` keeps an error-feedback residual (checked: check())."""
    return feedback_codec(compression) is not None


def check(compression: str | None, what: str, *, stateful_ok: bool = False) -> None:
    if compression is None or (isinstance(compression, str) and compression in WIRE_TYPES):
        return
    if feedback_codec(compression, what) is not None:
        if stateful_ok:
            return
        raise ValueError(
            f"{what}: compression={compression!r} keeps an error-feedback residual, which needs "
            f"optimizer state: use jbps.optax.distributed(tx, compression={compression!r})"
        )
    choices = "None, 'bf16', 'fp16', 'onebit', 'topk' or 'topk:FRACTION'" if stateful_ok else "None, 'bf16' or 'fp16'"
    raise ValueError(f"{what}: compression must be {choices}, got {compression!r}")


def compress(leaves: Sequence[jax.Array], compression: str | None) -> list[jax.Array]:
    """The leaves as they travel."""
    if compression is None:
        return list(leaves)
    wire = WIRE_TYPES[compression]
    return [_cast(x, wire) if np.dtype(x.dtype) in _COMPRESSIBLE else x for x in leaves]


def decompress(summed: Sequence[jax.Array], originals: Sequence[jax.Array]) -> list[jax.Array]:
    """The sums back in their leaves' dtypes."""
    return [s if s.dtype == x.dtype else _cast(s, x.dtype) for s, x in zip(summed, originals)]


def _cast(x: jax.Array, dtype) -> jax.Array:
    return _cast_as(x, np.dtype(dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _cast_as(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """x.astype(dtype), the same bits; float32 <-> 16 bits on XLA:CPU in one
    thread of jbps's (ops/ffi.py cast: XLA's own splits a large cast over its
    thread pool, which stalls where processes share cores), XLA's elsewhere.
    Differentiated as astype (a custom call has no derivative of its own)."""
    source = np.dtype(x.dtype)
    if source == np.float32 and dtype in _HALVES:
        target = runtime.NARROW_TARGET
    elif source in _HALVES and dtype == np.float32:
        target = runtime.WIDEN_TARGET
    else:
        return x.astype(dtype)
    return lax.platform_dependent(x, cpu=lambda v: ffi.cast(target, v, dtype), default=lambda v: v.astype(dtype))


@_cast_as.defjvp
def _cast_as_jvp(dtype, primals, tangents):
    (x,), (t,) = primals, tangents
    return _cast_as(x, dtype), t.astype(dtype)
