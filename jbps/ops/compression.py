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
optax wrappers offer it, keeping the residual in their state.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import onebit, topk

WIRE_TYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
_COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))


# The codecs with error feedback, by name: they keep a residual, so only the
# optax wrappers (which have the state) offer them.
FEEDBACK = {"onebit": onebit, "topk": topk}
STATEFUL = tuple(FEEDBACK)


def check(compression: str | None, what: str, *, stateful_ok: bool = False) -> None:
    if compression is None or compression in WIRE_TYPES or (stateful_ok and compression in STATEFUL):
        return
    if compression in STATEFUL:
        raise ValueError(
            f"{what}: compression={compression!r} keeps an error-feedback residual, which needs "
            f"optimizer state: use jbps.optax.distributed(tx, compression={compression!r})"
        )
    choices = "None, 'bf16', 'fp16', 'onebit' or 'topk'" if stateful_ok else "None, 'bf16' or 'fp16'"
    raise ValueError(f"{what}: compression must be {choices}, got {compression!r}")


def compress(leaves: Sequence[jax.Array], compression: str | None) -> list[jax.Array]:
    """The leaves as they travel."""
    if compression is None:
        return list(leaves)
    wire = WIRE_TYPES[compression]
    return [x.astype(wire) if np.dtype(x.dtype) in _COMPRESSIBLE else x for x in leaves]


def decompress(summed: Sequence[jax.Array], originals: Sequence[jax.Array]) -> list[jax.Array]:
    """The sums back in their leaves' dtypes."""
    return [s if s.dtype == x.dtype else s.astype(x.dtype) for s, x in zip(summed, originals)]
