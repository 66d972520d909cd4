"""How much of a stretch of training went to communication, over the job.

engine_stats()["busy_seconds"] is wall time with at least one psum in flight.
A psum is in flight from the moment a worker submits it until every worker's
part has been summed and pulled back, so a worker that reaches the psum before
a slower one also counts the time it waits for that one: on a loaded machine
two workers of one job read, say, 0% and 16%. The worker that arrives last
waits for nobody; its share is what communication itself costs. The others'
excess over it is load imbalance, which a faster network would not remove.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .ops.psum import psum
from .runtime import rank, size


class CommunicationShare(NamedTuple):
    communication: float  # of the elapsed time, the same on every worker: the least busy worker's share
    waiting: float  # this worker's busy share beyond that: inside psums, waiting for slower workers


def communication_share(busy_seconds: float, elapsed_s: float) -> CommunicationShare:
    """busy_seconds: this worker's engine_stats()["busy_seconds"] over a
    stretch of elapsed_s seconds. Every worker must call it at the same point
    (it runs one psum of every worker's share)."""
    if not elapsed_s > 0:
        raise ValueError(f"elapsed_s must be positive, got {elapsed_s!r}")
    shares = np.zeros(size(), np.float32)
    shares[rank()] = busy_seconds / elapsed_s
    every = np.asarray(psum(jnp.asarray(shares), name="jbps.communication_share"))
    least = float(every.min())
    return CommunicationShare(communication=least, waiting=max(0.0, float(every[rank()]) - least))
