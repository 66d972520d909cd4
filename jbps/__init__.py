"""jbps: BytePS for JAX.

    import jbps
    jbps.init()                                     # JBPS_SERVERS, JBPS_NUM_WORKERS, JBPS_WORKER_RANK
    f = jax.pmap(lambda g: jbps.psum(g, "i"), axis_name="i")
"""

from .config import Config
from .errors import JbpsError, is_jbps_error
from . import errors, partition
from .ops import pmean, psum
from .partition import forward_order, optimal_split
from .runtime import (Session, check, config, engine_stats, init, is_initialized, local_rank, local_size, rank, shutdown,
                      size)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "JbpsError",
    "Session",
    "check",
    "config",
    "errors",
    "engine_stats",
    "forward_order",
    "init",
    "is_initialized",
    "is_jbps_error",
    "local_rank",
    "local_size",
    "optimal_split",
    "partition",
    "pmean",
    "psum",
    "rank",
    "shutdown",
    "size",
]
