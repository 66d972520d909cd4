"""A broadcast of host arrays outside XLA, for the start of an elastic
generation (jbps/elastic.py): the root's bytes travel as int32 words through
one host psum of the running engine (link_rate.psum_host), every other worker
adding zeros. x + 0 is x for integers, whatever their bits mean, so every
worker gets the root's bits. Nothing is traced or compiled: right after a
generation cleared jax's caches, the XLA broadcast (ops/broadcast.py) would
compile a program for each call first.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import link_rate, runtime


def broadcast_bytes(data: bytes, root: int, name: str) -> bytes:
    """The root's `data` on every worker. Every worker passes bytes of the
    root's length (only the root's are read)."""
    if not data:
        return data
    words = np.zeros(-(-len(data) // 4), np.int32)
    if runtime.rank() == root:
        words.view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
    link_rate.psum_host(name, words, runtime.server_fractions(), link_rate.backstop_s(runtime.config().timeout_s))
    return words.view(np.uint8)[: len(data)].tobytes()


def broadcast_blob(data: bytes, root: int, name: str) -> bytes:
    """The root's `data` on every worker, each passing bytes of any length:
    its length first (`name`_size), then the bytes."""
    size = int.from_bytes(broadcast_bytes(len(data).to_bytes(4, "little"), root, name + "_size"), "little")
    return broadcast_bytes(data[:size].ljust(size, b"\0"), root, name)


def broadcast_arrays(arrays: Sequence[np.ndarray], root: int, name: str) -> list[np.ndarray]:
    """The root's arrays on every worker, bit for bit. Every worker passes
    arrays of the root's shapes and dtypes, in one host psum."""
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    received = broadcast_bytes(data, root, name)
    out, at = [], 0
    for a in arrays:
        if a.size == 0:
            out.append(np.empty(a.shape, a.dtype))
            continue
        out.append(np.frombuffer(received, a.dtype, count=a.size, offset=at).reshape(a.shape).copy())
        at += a.nbytes
    return out
