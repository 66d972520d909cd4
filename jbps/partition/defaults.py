"""The chunk size and credit window a user gets without setting them.

On one host every byte moves through shared memory or loopback, where a chunk
costs a few microseconds of bookkeeping and large chunks are cheapest: 4 MiB,
and a window of two chunks per server (at least 4).

Across hosts a psum is a pipeline: a chunk's sum can leave its server only
once every worker's copy of it has arrived, so a link waits at the start for
the first sums and at the end for the last pushes. Each wait lasts about one
window of chunks at the link's rate, and with every server's link shared by
the chunks in flight, the two together cost about 2·W·c/(M/S) of the call
(W chunks of c bytes in flight per worker, S servers sharing M bytes). This
holds whatever the link's rate, so the defaults follow the call and the job,
not the network: chunks of about M/(48·S) (the nearest power of two, between
32 KiB and 4 MiB), and a window of one chunk per server that gets bytes plus
two, which keeps every server's link fed and the pipeline's ends a few
percent of the call.
"""

from __future__ import annotations

from typing import Sequence

ONE_HOST_PARTITION_BYTES = 4 << 20
MIN_NETWORK_PARTITION_BYTES = 32 << 10
# Chunks each server gets per call across hosts: the pipeline's fill and drain
# cost about 2·W/(CHUNKS_PER_SERVER·S) of the call, W ≈ S + 2 (4-5% here).
# More, smaller chunks shorten it further but cost CPU per chunk on every
# host: on the 2-core development machine, which also runs every emulated
# host's network stack, 4 workers and 2 CPU hosts at 1 Gbit/s took 1.35x the
# formula with 64 KiB chunks and 1.13x with 128 KiB.
CHUNKS_PER_SERVER = 48
MIN_CREDIT = 4
CREDIT_PER_SERVER_ONE_HOST = 2
EXTRA_CREDIT_NETWORK = 2
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def spans_hosts(servers: Sequence[str]) -> bool:
    """Whether the job's bytes cross a network: some server is not on this
    host's loopback address. Launchers put every server of a one-host job on
    127.0.0.1 and servers on other hosts on their hosts' addresses, so every
    worker, wherever it runs, reads the same answer from the same list."""
    return any(address.rpartition(":")[0] not in _LOOPBACK_HOSTS for address in servers)


def active_servers(fractions: Sequence[float]) -> int:
    """Servers that get bytes (with k ≥ n CPU machines the colocated ones get none)."""
    return max(1, sum(f > 0 for f in fractions))


def partition_bytes(call_bytes: int, fractions: Sequence[float], across_hosts: bool) -> int:
    """The largest chunk of one psum call of `call_bytes` (all leaves, all shards)."""
    if not across_hosts:
        return ONE_HOST_PARTITION_BYTES
    target = call_bytes / (CHUNKS_PER_SERVER * active_servers(fractions))
    size = MIN_NETWORK_PARTITION_BYTES
    # The power of two nearest the target (whole elements of every dtype, few distinct plans).
    while size < ONE_HOST_PARTITION_BYTES and size * 1.414 < target:
        size *= 2
    return size


def credit(fractions: Sequence[float], across_hosts: bool) -> int:
    """Chunks a worker may have pushed and not yet acknowledged."""
    if not across_hosts:
        return max(MIN_CREDIT, CREDIT_PER_SERVER_ONE_HOST * len(fractions))
    return max(MIN_CREDIT, active_servers(fractions) + EXTRA_CREDIT_NETWORK)
