"""The collective operations users call inside pmap, shard_map or jit."""

from .psum import pmean, psum

__all__ = ["pmean", "psum"]
