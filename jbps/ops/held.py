"""Sums held to the end of a program of several steps (jbps.scan).

XLA:CPU's executor orders work by the buffers it touches, and XLA schedules a
custom call as if it finished at once. Whatever a step's update reads (the
bucket's sum, the old parameters and optimizer state) is read only once that
sum is back; a buffer XLA hands on after that read makes whatever takes it
wait for the network too. One step's psum guards its sums with a join of its
buckets (ffi.join), which also makes every update wait for the last sum. In
a program of several steps the next step's forward pass on the first layers
could run while later layers' sums still travel, but not behind that join.

So inside `holding()` a psum bound in the program's own trace skips the join
(on XLA:CPU with one device a worker: psum_primitive.py) and its sums are
collected here; jbps.scan passes its last carry through one join that also
reads every step's sums and starting carry (`release`), so XLA hands none of
those buffers on before the program ends. (An optimization barrier would not
do: XLA:CPU turns it into an ordering only, and the values die at their last
real use.)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import jax

from .ffi import join

try:
    from jax._src.core import trace_ctx as _trace_ctx
except ImportError:  # a jax without it: no psum is held, each joins its buckets
    _trace_ctx = None

_local = threading.local()


class _Holding:
    def __init__(self, trace):
        self.trace = trace
        self.sums: list[jax.Array] = []
        self.held_calls = 0
        self.other_calls = 0

    def take(self) -> list[jax.Array]:
        """The sums held since the last take()."""
        sums, self.sums = self.sums, []
        return sums


def _current_trace():
    return None if _trace_ctx is None else _trace_ctx.trace


@contextlib.contextmanager
def holding() -> Iterator[_Holding]:
    """Collects the sums of the psums bound in the current trace (a jit's)."""
    trace = _current_trace()
    outer = getattr(_local, "holding", None)
    state = _Holding(trace if type(trace).__name__ == "DynamicJaxprTrace" else None)
    _local.holding = state
    try:
        yield state
    finally:
        _local.holding = outer


def wants_hold() -> bool:
    """Whether a psum bound now may leave its buckets unjoined: inside
    holding(), in the very trace it started in (not under grad, vmap, a
    nested jit or shard_map, whose values cannot reach the program's end)."""
    state = getattr(_local, "holding", None)
    if state is None:
        return False
    if state.trace is not None and _current_trace() is state.trace:
        state.held_calls += 1
        return True
    state.other_calls += 1
    return False


def hold(sums: Sequence[jax.Array]) -> None:
    """Keeps the sums of a held psum for holding()'s take()."""
    _local.holding.sums.extend(sums)


def release(values: Sequence[jax.Array], kept: Sequence[jax.Array]) -> list[jax.Array]:
    """`values`, passed through one join that also reads every one of `kept`:
    the program's last use of them, so XLA hands none of their buffers on."""
    if not kept or not values:
        return list(values)
    return join(values, keep=kept)
