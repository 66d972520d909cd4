"""The collective operations users call inside pmap, shard_map or jit."""

from .broadcast import broadcast, broadcast_parameters
from .psum import pmean, psum

__all__ = ["broadcast", "broadcast_parameters", "pmean", "psum"]
