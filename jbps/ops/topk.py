"""Top-k compression with error feedback, the device's half.

The format (xla_ext/topk.h): of every BLOCK float32 values, the KEEP largest
in magnitude travel as one record of KEEP (index in the block, value) pairs,
uint32 index then float32 value, in index order; ties go to the lower index.
A record decodes to those values at those indices and zeros elsewhere:
80 bytes for 4 KiB, 1/51.2 of float32. As with onebit (onebit.py), leaves of
fewer than MIN_ELEMENTS values travel as they are, the worker adds its
residual before encoding and keeps what the encoding dropped, and the servers
decode, add, add their own residual per key and encode the sum the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .onebit import MIN_ELEMENTS, compressed, zero_residual  # noqa: F401 (the same leaves travel compressed)

BLOCK = 1024
KEEP = 10
RECORD_WORDS = 2 * KEEP
RECORD_BYTES = 4 * RECORD_WORDS
# The plan's element for a topk leaf: one record (the engine's DType::kTopK,
# which a uint32 operand of the custom call carries).
RECORD_DTYPE = np.dtype((np.void, RECORD_BYTES))
NAME = "topk"


def encode(values: jax.Array, counts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """float32[n * BLOCK] (padding is zeros; counts are not needed) ->
    (records uint32[n, RECORD_WORDS], what they decode to)."""
    del counts
    blocks = values.reshape(-1, BLOCK)
    _, index = lax.top_k(jnp.abs(blocks), KEEP)  # ties: the lower index first
    index = jnp.sort(index, axis=1)
    kept = jnp.take_along_axis(blocks, index, axis=1)
    records = jnp.stack([index.astype(jnp.uint32), lax.bitcast_convert_type(kept, jnp.uint32)], axis=-1)
    rows = jnp.arange(blocks.shape[0])[:, None]
    sent = jnp.zeros_like(blocks).at[rows, index].set(kept)
    return records.reshape(-1, RECORD_WORDS), sent.reshape(-1)


def decode(records: jax.Array) -> jax.Array:
    """uint32[n, RECORD_WORDS] -> float32[n * BLOCK]."""
    pairs = records.reshape(-1, KEEP, 2)
    index = pairs[:, :, 0].astype(jnp.int32)
    kept = lax.bitcast_convert_type(pairs[:, :, 1], jnp.float32)
    rows = jnp.arange(pairs.shape[0])[:, None]
    return jnp.zeros((pairs.shape[0], BLOCK), jnp.float32).at[rows, index].set(kept).reshape(-1)


def encode_shard(values: jax.Array, size: int, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """encode() of a device's padded shard of a leaf (the codecs' common entry,
    as onebit.py's): padding is zeros, so neither size nor start matter here."""
    del size, start
    return encode(values)
