"""A psum's places in one compiled program.

A psum traced once can sit at several places of one program: a jitted
function that calls jbps.psum, used twice inside another jit; remat's
recomputation of a forward pass; an unrolled loop; one name= given to two
psums. Its places would carry the same keys, and the engine pairs a worker's
calls with the other workers' by the order they reach it. Where neither place
waits for the other's sum, XLA starts them in the order their operands become
ready, which can differ between workers: worker 0's first place would be
summed with worker 1's second, silently (tests/test_places.py shows it).

So each place of a psum in a program gets keys of its own: the k-th place of
psum NAME lowered in a module is named NAME@k (the first keeps NAME, so a
program with one place of each psum is lowered as before). Every worker
lowers the same program in the same order, so the k-th place is the same
place on all of them.

jax lowers a function called at several places of a module once and calls it
from each place (its per-module lowering cache); a function that holds a jbps
psum must be lowered at each place instead, so that each gets its own name.
`PlaceCache` wraps each module's cache (jax's ModuleContext creates one per
module and shares it with the contexts derived from it) and keeps no function
whose key holds a jaxpr with a jbps psum.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import MutableMapping
from typing import Any, Iterator

from jax._src import core
from jax._src.interpreters import mlir


class PlaceCache(MutableMapping):
    """A module's lowering cache, less the functions that hold a jbps psum,
    and the count of places lowered so far per psum."""

    def __init__(self, cache: dict, primitive: core.Primitive):
        self._cache = cache
        self._primitive = primitive
        self.places: collections.Counter = collections.Counter()

    def __getitem__(self, key):
        return self._cache[key]

    def __setitem__(self, key, value):
        if not any(_holds(j, self._primitive) for j in _jaxprs(key)):
            self._cache[key] = value

    def __delitem__(self, key):
        del self._cache[key]

    def __iter__(self):
        return iter(self._cache)

    def __len__(self):
        return len(self._cache)


# A jaxpr with its constants before jax 0.12; from 0.12 on a Jaxpr holds them itself.
_CLOSED_JAXPR = getattr(core, "ClosedJaxpr", None)


def _jaxprs(obj: Any) -> Iterator[core.Jaxpr]:
    """The jaxprs in a lowering cache's key (nested tuples)."""
    if _CLOSED_JAXPR is not None and isinstance(obj, _CLOSED_JAXPR):
        yield obj.jaxpr
    elif isinstance(obj, core.Jaxpr):
        yield obj
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _jaxprs(item)


_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # jaxpr -> holds a psum


def _holds(jaxpr: core.Jaxpr, primitive: core.Primitive) -> bool:
    try:
        return _held[jaxpr]
    except KeyError:
        pass
    found = any(e.primitive is primitive for e in jaxpr.eqns) or any(
        _holds(sub, primitive) for sub in core.subjaxprs(jaxpr)
    )
    _held[jaxpr] = found
    return found


def install(primitive: core.Primitive) -> None:
    """Every module jax lowers from now on gets a PlaceCache for `primitive`."""
    init = mlir.ModuleContext.__init__
    if getattr(init, "_jbps_places", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        cache = self.cached_primitive_lowerings
        if not isinstance(cache, PlaceCache):
            object.__setattr__(self, "cached_primitive_lowerings", PlaceCache(cache, primitive))

    __init__._jbps_places = True  # type: ignore[attr-defined]
    mlir.ModuleContext.__init__ = __init__  # type: ignore[method-assign]


def place_name(module_context: Any, name: str) -> str:
    """The name of this place of psum `name` in the module being lowered:
    `name` for its first place, `name@k` for the k-th after it."""
    cache = getattr(module_context, "cached_primitive_lowerings", None)
    if not isinstance(cache, PlaceCache):
        return name
    key = (name, tuple(getattr(module_context, "platforms", ()) or ()))
    k = cache.places[key]
    cache.places[key] += 1
    return name if k == 0 else f"{name}@{k}"
