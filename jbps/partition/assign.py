"""Which server owns each chunk: balanced by bytes to the optimal split.

Every server declares its role (`python -m jbps.server --role`): colocated on
a worker's machine, or dedicated on a CPU-only machine. With n workers and k
dedicated servers, the colocated servers share n·y of the bytes equally and
the dedicated ones the rest (k·x); see split.py.

Chunks are dealt out in the order the engine sends them (priority, then
position), each to the server furthest below its share *of the bytes dealt so
far*. So not only the totals match the split: every stretch of the send order
carries each server its share too, and while a call is pushed every server's
link is busy in proportion, instead of the servers with the largest shares
taking the first half of the call and the others the second. Every server
ends within one chunk of its share (the chosen server is the furthest below
its running target, which the new chunk moves up by less than a chunk). The
result depends only on the chunks' sizes and order: identical on every
worker, whatever the process or the Python hash seed.
"""

from __future__ import annotations

from typing import Sequence

from .split import optimal_split

COLOCATED = "colocated"
DEDICATED = "dedicated"
ROLES = (COLOCATED, DEDICATED)


def server_fractions(roles: Sequence[str], num_workers: int) -> list[float]:
    """Share of the bytes each server owns, in server order."""
    if not roles:
        raise ValueError("no servers")
    for i, role in enumerate(roles):
        if role not in ROLES:
            raise ValueError(f"server {i} has role {role!r}; expected one of {ROLES}")
    colocated = sum(r == COLOCATED for r in roles)
    dedicated = len(roles) - colocated
    if dedicated == 0:
        return [1.0 / colocated] * colocated
    if colocated == 0:
        return [1.0 / dedicated] * dedicated
    split = optimal_split(num_workers, dedicated)
    colocated_share = min(1.0, num_workers * split.colocated_fraction)
    return [colocated_share / colocated if r == COLOCATED else (1.0 - colocated_share) / dedicated for r in roles]


def assign_chunks(
    chunk_bytes: Sequence[int], send_order: Sequence[tuple], fractions: Sequence[float], rotation: int = 0
) -> list[int]:
    """Server index of each chunk.

    send_order: a unique, process-independent sort key per chunk: the order
    the engine sends them in. rotation: which server wins exact ties between
    equal deficits (e.g. derived from the psum's name), so that many small
    calls do not all start on server 0.
    """
    count = len(fractions)
    dealt = 0.0
    assigned = [0.0] * count
    owner = [0] * len(chunk_bytes)
    for i in sorted(range(len(chunk_bytes)), key=lambda i: send_order[i]):
        dealt += chunk_bytes[i]
        best = max(range(count), key=lambda s: (fractions[s] * dealt - assigned[s], -((s - rotation) % count)))
        owner[i] = best
        assigned[best] += chunk_bytes[i]
    return owner
