"""Onebit compression with error feedback, the device's half.

The format (xla_ext/onebit.h): up to BLOCK float32 values travel as one
record: their scale (the mean absolute value, float32), how many values the
record holds (uint32; fewer than BLOCK only at the end of a leaf), then one
sign bit per value, set for negative values, bit j of byte k for value 8k + j.
A value decodes to +scale or -scale: 8 + BLOCK/8 bytes for 4 * BLOCK, 1/25.6
of float32. Leaves of fewer than MIN_ELEMENTS values (biases, norms) travel
as they are: few bytes, and their gradients are the most sensitive. A block of
256 trains the mnist example as well as float32 with SGD and momentum, where
4096 (one scale for values of very different sizes) fell to 0.97; 128 was no
better than 256.

The worker adds its residual (what its earlier encodings lost) to its part of
the gradient before encoding and keeps what this encoding loses as the new
residual, so nothing is lost for good, only delayed (error feedback, as
BytePS's onebit). The servers decode every push, add in float32, add their
own residual per key and encode the sum the same way for the pull.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import runtime
from . import ffi

BLOCK = 256
RECORD_BYTES = 8 + BLOCK // 8
MIN_ELEMENTS = 1024
# The plan's element for a onebit leaf: one record (the engine's DType::kOneBit).
RECORD_DTYPE = np.dtype((np.void, RECORD_BYTES))
NAME = "onebit"


def compressed(shape, dtype) -> bool:
    """Whether a leaf travels as onebit: floating point, and big enough."""
    return jnp.issubdtype(dtype, jnp.floating) and math.prod(shape) >= MIN_ELEMENTS


def zero_residual(shape, dtype) -> jax.Array | None:
    """A leaf's residual before its first step: float32 zeros of its shape
    where it travels as onebit, None where it does not (no array at all, so a
    checkpoint holds nothing for it: orbax refuses arrays of zero size)."""
    return jnp.zeros(shape, jnp.float32) if compressed(shape, dtype) else None


def encode(values: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32[n * BLOCK], each block's count of values (the rest is
    padding, zeros) -> (records uint8[n, RECORD_BYTES], what they decode to)."""
    records, _ = _extract(values, counts)
    return records, decode(records)


def decode(records: jax.Array) -> jax.Array:
    """uint8[n, RECORD_BYTES] -> float32[n * BLOCK]."""
    return lax.platform_dependent(records, cpu=_decode_cpu, default=_decode_xla)


def _encode_xla(values: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    blocks = values.reshape(-1, BLOCK)
    counts = counts.astype(jnp.uint32)
    scale = jnp.sum(jnp.abs(blocks), axis=1) / jnp.maximum(counts, 1).astype(jnp.float32)
    held = jnp.arange(BLOCK, dtype=jnp.uint32)[None, :] < counts[:, None]
    negative = (blocks < 0) & held
    header = jnp.concatenate(
        [lax.bitcast_convert_type(scale, jnp.uint8), lax.bitcast_convert_type(counts, jnp.uint8)], axis=1
    )
    records = jnp.concatenate([header, jnp.packbits(negative, axis=1, bitorder="little")], axis=1)
    sent = jnp.where(held, jnp.where(negative, -scale[:, None], scale[:, None]), 0.0)
    return records, sent.reshape(-1)


def _extract_xla(values: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    records, sent = _encode_xla(values, counts)
    return records, values - sent


def _decode_xla(records: jax.Array) -> jax.Array:
    scale = lax.bitcast_convert_type(records[:, :4], jnp.float32)
    counts = lax.bitcast_convert_type(records[:, 4:8], jnp.uint32)
    held = jnp.arange(BLOCK, dtype=jnp.uint32)[None, :] < counts[:, None]
    negative = jnp.unpackbits(records[:, 8:], axis=1, bitorder="little").astype(bool)
    return jnp.where(held, jnp.where(negative, -scale[:, None], scale[:, None]), 0.0).reshape(-1)


def _extract_cpu(values: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    # The servers' encoder (xla_ext/onebit.cc); its scale is summed in
    # double, so its last bit can differ from _encode_xla's.
    records = jax.ShapeDtypeStruct((values.size // BLOCK, RECORD_BYTES), jnp.uint8)
    return ffi.encode_in_place(runtime.ONEBIT_ENCODE_TARGET, values, records, counts.astype(jnp.int32))


def _decode_cpu(records: jax.Array) -> jax.Array:
    return ffi.decode(runtime.ONEBIT_DECODE_TARGET, records, records.shape[0] * BLOCK)


def encode_piece(
    residual: jax.Array, values: jax.Array, size: int, start: jax.Array, first: int, rows: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Error feedback on XLA:CPU, one piece at a time: the records of blocks
    first .. first + rows of residual + values (a device's padded shard of a
    leaf of `size` values from element `start` on, and its residual), what
    they leave in the residual's buffer, the values passed through ->
    (records, residual, values)."""
    counts = block_counts(size, start + first * BLOCK, rows).astype(jnp.int32)
    records = jax.ShapeDtypeStruct((rows, RECORD_BYTES), jnp.uint8)
    return ffi.encode_added(runtime.ONEBIT_ENCODE_ADDED_TARGET, residual, values, records, counts, first_block=first)


def decode_piece(values: jax.Array, records: jax.Array, first: int) -> jax.Array:
    """`values` with the records' blocks decoded into them from block `first` on, on XLA:CPU."""
    return ffi.decode_into(runtime.ONEBIT_DECODE_INTO_TARGET, records, values, first)


def block_counts(size: int, start: jax.Array, num_blocks: int) -> jax.Array:
    """Values of a leaf of `size` held by each of `num_blocks` blocks from
    element `start` on (the rest of the padded shard is padding)."""
    starts = start + jnp.arange(num_blocks, dtype=jnp.int32) * BLOCK
    return jnp.clip(size - starts, 0, BLOCK)


def encode_shard(values: jax.Array, size: int, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A device's padded shard of a leaf of `size` values, from element `start`
    of the leaf on -> (records, what they leave of the values: the new
    residual), the codecs' common entry (topk.py has one too)."""
    return _extract(values, block_counts(size, start, values.shape[0] // BLOCK))


def _extract(values: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(records, what they leave of the values): the servers' C++ on XLA:CPU, XLA ops elsewhere."""
    return lax.platform_dependent(values, counts, cpu=_extract_cpu, default=_extract_xla)
