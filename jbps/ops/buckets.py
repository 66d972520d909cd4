"""Buckets: a psum of a large tree as several custom calls, so that gradients
start travelling while the backward pass still runs.

One custom call needs all its operands, so a psum of a whole model's
gradients as one call waits for the last gradient of the backward pass, and
the step takes compute + communication. Split into calls of about
`bucket_bytes`, each call depends only on its own leaves: XLA runs it as soon
as they exist (XLA:CPU's executor runs a call that returns a future beside
independent work), and the engine sends its chunks while the rest of the
backward pass is computed. As PyTorch DDP's buckets, the leaves are grouped in
the order the backward pass produces them: the reverse of the forward order,
which is what priorities say (larger is needed sooner by the next forward
pass, so it is produced later by the backward pass). The engine still sends
chunks of all calls in flight by priority.

Splitting never changes a sum: each element is summed over the same workers
and devices, by the same servers' arithmetic, whichever call carries it.
"""

from __future__ import annotations

from typing import Sequence


def split(nbytes: Sequence[int], priorities: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Leaf indices per bucket, in the order the backward pass produces them
    (lowest priority first; among equals the later leaf first). As DDP's
    buckets, a bucket is closed once it holds `bucket_bytes` or more, so a
    layer's small bias rides with the next kernel instead of travelling
    alone. `bucket_bytes` 0, or a tree within one bucket: one call."""
    total = sum(nbytes)
    if bucket_bytes <= 0 or total <= bucket_bytes:
        return [list(range(len(nbytes)))]
    order = sorted(range(len(nbytes)), key=lambda i: (priorities[i], -i))
    buckets: list[list[int]] = [[]]
    filled = 0
    for i in order:
        if filled >= bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += nbytes[i]
    return [sorted(b) for b in buckets]  # each call's leaves in tree order
