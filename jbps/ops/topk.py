"""Top-k compression with error feedback, the device's half.

The format (xla_ext/topk.h): of every BLOCK float32 values, the `keep`
largest in magnitude travel as one record of `keep` (index in the block,
value) pairs, uint32 index then float32 value, in index order; ties go to the
lower index. A record decodes to those values at those indices and zeros
elsewhere. `compression="topk"` keeps DEFAULT_KEEP (80 bytes for 4 KiB,
1/51.2 of float32); `"topk:FRACTION"` keeps round(FRACTION * BLOCK), 1 to
MAX_KEEP (more would take more bytes than float32). The records of a leaf are
uint32[n, 2 * keep], from which the custom call reads the keep, and every
push carries it to the servers. As with onebit (onebit.py), leaves of fewer
than MIN_ELEMENTS values travel as they are, the worker adds its residual
before encoding and keeps what the encoding dropped, and the servers decode,
add, add their own residual per key and encode the sum the same way.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import runtime
from . import ffi
from .onebit import MIN_ELEMENTS, compressed, zero_residual  # noqa: F401 (the same leaves travel compressed)

BLOCK = 1024
DEFAULT_KEEP = 10
MAX_KEEP = BLOCK // 2
PREFIX = "topk:"


class TopK:
    """The codec keeping `keep` of every BLOCK values (the codecs' interface,
    as onebit.py's module: BLOCK, NAME, RECORD_DTYPE, compressed, encode_shard, decode)."""

    BLOCK = BLOCK
    compressed = staticmethod(compressed)
    zero_residual = staticmethod(zero_residual)

    def __init__(self, keep: int):
        if not 1 <= keep <= MAX_KEEP:
            raise ValueError(f"topk keeps 1 to {MAX_KEEP} of every {BLOCK} values, got {keep}")
        self.keep = keep
        self.RECORD_WORDS = 2 * keep
        self.RECORD_BYTES = 4 * self.RECORD_WORDS
        # The plan's element for a topk leaf: one record (the engine's DType::kTopK,
        # which a uint32 operand of the custom call carries).
        self.RECORD_DTYPE = np.dtype((np.void, self.RECORD_BYTES))
        # What the tree check calls such a leaf: workers that keep different
        # amounts fail there, naming the leaf.
        self.NAME = "topk" if keep == DEFAULT_KEEP else f"topk({keep}/{BLOCK})"

    def __repr__(self) -> str:
        return f"TopK(keep={self.keep})"

    def encode(self, values: jax.Array, counts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """float32[n * BLOCK] (padding is zeros; counts are not needed) ->
        (records uint32[n, RECORD_WORDS], what they decode to)."""
        del counts
        records, _ = self._extract(values)
        return records, self.decode(records)

    def decode(self, records: jax.Array) -> jax.Array:
        """uint32[n, RECORD_WORDS] -> float32[n * BLOCK]."""
        return lax.platform_dependent(records, cpu=self._decode_cpu, default=self._decode_xla)

    def encode_shard(self, values: jax.Array, size: int, start: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A device's padded shard of a leaf -> (records, what they leave of the
        values: the new residual), the codecs' common entry (as onebit.py's).
        Padding is zeros, so neither size nor start matter here. On XLA:CPU the
        servers' C++ encoder, in place (a custom call; 3x faster there than
        lax.top_k); elsewhere XLA ops. Both send the same records."""
        del size, start
        return self._extract(values)

    def _extract(self, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        return lax.platform_dependent(values, cpu=self._extract_cpu, default=self._extract_xla)

    def _extract_xla(self, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        blocks = values.reshape(-1, BLOCK)
        _, index = lax.top_k(jnp.abs(blocks), self.keep)  # ties: the lower index first
        index = jnp.sort(index, axis=1)
        kept = jnp.take_along_axis(blocks, index, axis=1)
        records = jnp.stack([index.astype(jnp.uint32), lax.bitcast_convert_type(kept, jnp.uint32)], axis=-1)
        rows = jnp.arange(blocks.shape[0])[:, None]
        # The values sent leave zeros (a kept infinity too), as on the servers.
        left = blocks.at[rows, index].set(0.0)
        return records.reshape(-1, self.RECORD_WORDS), left.reshape(-1)

    def _decode_xla(self, records: jax.Array) -> jax.Array:
        pairs = records.reshape(-1, self.keep, 2)
        index = pairs[:, :, 0].astype(jnp.int32)
        kept = lax.bitcast_convert_type(pairs[:, :, 1], jnp.float32)
        rows = jnp.arange(pairs.shape[0])[:, None]
        return jnp.zeros((pairs.shape[0], BLOCK), jnp.float32).at[rows, index].set(kept).reshape(-1)

    def _extract_cpu(self, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        records = jax.ShapeDtypeStruct((values.size // BLOCK, self.RECORD_WORDS), jnp.uint32)
        return ffi.encode_in_place(runtime.TOPK_ENCODE_TARGET, values, records, keep=np.int64(self.keep))

    def _decode_cpu(self, records: jax.Array) -> jax.Array:
        return ffi.decode(runtime.TOPK_DECODE_TARGET, records, records.shape[0] * BLOCK, keep=np.int64(self.keep))

    def encode_piece(
        self, residual: jax.Array, values: jax.Array, size: int, start: jax.Array, first: int, rows: int
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Error feedback on XLA:CPU, one piece at a time (as onebit.encode_piece)."""
        del size, start  # padding is zeros
        records = jax.ShapeDtypeStruct((rows, self.RECORD_WORDS), jnp.uint32)
        return ffi.encode_added(
            runtime.TOPK_ENCODE_ADDED_TARGET, residual, values, records, first_block=first, keep=np.int64(self.keep)
        )

    def decode_piece(self, values: jax.Array, records: jax.Array, first: int) -> jax.Array:
        """`values` with the records' blocks decoded into them from block `first` on, on XLA:CPU."""
        return ffi.decode_into(runtime.TOPK_DECODE_INTO_TARGET, records, values, first, keep=np.int64(self.keep))


@functools.lru_cache(maxsize=None)
def codec(keep: int = DEFAULT_KEEP) -> TopK:
    """The codec keeping `keep` of every BLOCK values (one object per keep)."""
    return TopK(keep)


def keep_of(fraction: str) -> int:
    """The values per block that "topk:FRACTION" keeps: round(FRACTION * BLOCK).
    A ValueError (without the caller's prefix) when FRACTION is not a number
    above 0 and at most 0.5, or keeps no value."""
    try:
        f = float(fraction)
    except ValueError:
        f = math.nan
    keep = round(f * BLOCK) if math.isfinite(f) else 0
    if not (0 < f <= 0.5 and keep >= 1):
        raise ValueError(
            f"topk's fraction must be a number in (0, 0.5] that keeps at least one of every {BLOCK} "
            f"values (it keeps round(fraction * {BLOCK}) of them, 1 to {MAX_KEEP}; more than half would "
            f"send more bytes than float32), got {fraction!r}"
        )
    return keep
