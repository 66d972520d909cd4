"""jbps: BytePS for JAX.

import jbps
jbps.init()                                     # JBPS_SERVERS, JBPS_NUM_WORKERS, JBPS_WORKER_RANK
f = jax.pmap(lambda g: jbps.psum(g, "i"), axis_name="i")
tx = jbps.optax.distributed(optax.adam(1e-3), axis_name="i")   # or in a flax TrainState
params = jbps.broadcast_parameters(params)      # every worker starts from rank 0's
"""

import importlib
from typing import TYPE_CHECKING

from .config import Config
from .errors import JbpsError, is_jbps_error
from . import errors, partition
from .partition import forward_order, optimal_split
from .runtime import (
    Session,
    check,
    config,
    engine_stats,
    has_cuda_support,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

# What imports jax loads on first use (_LAZY, __getattr__ below): a summation server, the
# scheduler and `jbps run` import jbps too, and start in a fraction of a second without it.
_LAZY = {
    "broadcast": ".ops",
    "broadcast_parameters": ".ops",
    "pmean": ".ops",
    "psum": ".ops",
    "scan": ".overlapped_scan",
    "value_and_grad": ".data_parallel",
    "CommunicationShare": ".timing",
    "communication_share": ".timing",
}
if TYPE_CHECKING:
    from .data_parallel import value_and_grad
    from .ops.broadcast import broadcast, broadcast_parameters
    from .ops.psum import pmean, psum
    from .overlapped_scan import scan
    from .timing import CommunicationShare, communication_share

__version__ = "0.1.0"

__all__ = [
    "Config",
    "DistributedOptimizer",
    "elastic",
    "JbpsError",
    "Session",
    "broadcast",
    "broadcast_parameters",
    "check",
    "CommunicationShare",
    "communication_share",
    "config",
    "errors",
    "engine_stats",
    "forward_order",
    "has_cuda_support",
    "init",
    "is_initialized",
    "is_jbps_error",
    "local_rank",
    "local_size",
    "optax",
    "optimal_split",
    "partition",
    "pmean",
    "psum",
    "rank",
    "scan",
    "shutdown",
    "size",
    "value_and_grad",
]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))  # the names loaded on first use too (completion)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # found directly from now on
        return value
    # jbps.optax imports optax; load it (and jbps.elastic) when first used, not with `import jbps`.
    if name in ("optax", "elastic"):
        return importlib.import_module(f".{name}", __name__)
    if name == "DistributedOptimizer":
        return importlib.import_module(".optax", __name__).distributed
    raise AttributeError(f"module 'jbps' has no attribute {name!r}")
