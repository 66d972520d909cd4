"""Which server owns each chunk: balanced by bytes to the optimal split.

Every server declares its role (`python -m jbps.server --role`): colocated on
a worker's machine, or dedicated on a CPU-only machine. With n workers and k
dedicated servers, the colocated servers share n·y of the bytes equally and
the dedicated ones the rest (k·x); see split.py. Chunks are then dealt out
greedily, largest first, each to the server furthest below its target. That
keeps every server within one partition of its target (a server is only
chosen while below target, and never while another is further below), and it
depends only on the chunks' sizes and keys: identical on every worker,
whatever the pytree's dict order, the process or the Python hash seed.
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
    return [colocated_share / colocated if r == COLOCATED else (1.0 - colocated_share) / dedicated
            for r in roles]


def assign_chunks(chunk_bytes: Sequence[int], order_keys: Sequence[tuple], fractions: Sequence[float],
                  rotation: int = 0) -> list[int]:
    """Server index of each chunk.

    order_keys: a unique, process-independent sort key per chunk (ties of
    equal size are dealt in this order). rotation: which server wins exact
    ties between equal deficits (e.g. derived from the psum's name), so that
    many small calls do not all land on server 0.
    """
    total = float(sum(chunk_bytes))
    targets = [f * total for f in fractions]
    assigned = [0.0] * len(fractions)
    count = len(fractions)
    owner = [0] * len(chunk_bytes)
    for i in sorted(range(len(chunk_bytes)), key=lambda i: (-chunk_bytes[i], order_keys[i])):
        best = max(range(count), key=lambda s: (targets[s] - assigned[s], -((s - rotation) % count)))
        owner[i] = best
        assigned[best] += chunk_bytes[i]
    return owner
