"""The dtypes lax.psum sums that the servers do not: bool and complex.

lax.psum counts the Trues of a bool array (its result is int32) and sums a
complex array's real and imaginary parts apart. jbps does the same by sending
a bool leaf as int32 and a complex leaf as its two parts, a trailing axis of
2 in the matching float type, and rebuilding the complex sum afterwards: the
servers only ever see the dtypes they add (partition.SUPPORTED_DTYPES).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# What to_wire turns into the servers' dtypes.
CONVERTED = (np.dtype(np.bool_), np.dtype(np.complex64), np.dtype(np.complex128))


def to_wire(x: jax.Array) -> jax.Array:
    """The array the servers sum for leaf x (x itself for their own dtypes)."""
    if x.dtype == np.bool_:
        return x.astype(jnp.int32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    return x


def from_wire(summed: jax.Array, dtype: np.dtype) -> jax.Array:
    """The sum as lax.psum types it, from the sum of to_wire(leaf of `dtype`)."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return lax.complex(summed[..., 0], summed[..., 1])
    return summed  # bool: int32, as lax.psum's count of Trues


def complex_leaf(paths: Sequence[str], dtypes: Sequence[np.dtype]) -> str | None:
    """The path of the first complex leaf, or None."""
    for path, dtype in zip(paths, dtypes):
        if jnp.issubdtype(dtype, jnp.complexfloating):
            return path or "<root>"
    return None
