"""jbps: BytePS for JAX.

import jbps
jbps.init()                                     # JBPS_SERVERS, JBPS_NUM_WORKERS, JBPS_WORKER_RANK
f = jax.pmap(lambda g: jbps.psum(g, "i"), axis_name="i")
tx = jbps.optax.distributed(optax.adam(1e-3), axis_name="i")   # or in a flax TrainState
params = jbps.broadcast_parameters(params)      # every worker starts from rank 0's
"""

import importlib

from .config import Config
from .errors import JbpsError, is_jbps_error
from . import errors, partition
from .ops import broadcast, broadcast_parameters, pmean, psum
from .partition import forward_order, optimal_split
from .data_parallel import value_and_grad
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
    "shutdown",
    "size",
    "value_and_grad",
]


def __getattr__(name: str):
    # jbps.optax imports optax; load it (and jbps.elastic) when first used, not with `import jbps`.
    if name in ("optax", "elastic"):
        return importlib.import_module(f".{name}", __name__)
    if name == "DistributedOptimizer":
        return importlib.import_module(".optax", __name__).distributed
    raise AttributeError(f"module 'jbps' has no attribute {name!r}")
