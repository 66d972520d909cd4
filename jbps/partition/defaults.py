"""The chunk size and credit window a user gets without setting them.

On one host every byte moves through shared memory or loopback, where a chunk
costs a few microseconds of bookkeeping: 1 MiB chunks, and a window of two
chunks per server (at least 4). A chunk's copy in, its sum and its copy out
then overlap with the next chunk's: a 4 MiB psum is four chunks over the
servers, not one. In paired runs on the 2-core development machine (2 workers,
2 servers, calls of each chunk size alternating) 1 MiB chunks took 7-18% less
time than 4 MiB ones for 4 MiB psums; for 16-256 MiB, 13-27% less in two runs
of three and 10-15% more in the third (the machine's other load decides);
512 KiB chunks were slower than 1 MiB.

Across hosts a psum is a pipeline: a chunk's sum can leave its server only
once every worker's copy of it has arrived, so a link waits at the start for
the first sums and at the end for the last pushes. Each wait lasts about one
window of chunks at the link's rate, and with every server's link shared by
the chunks in flight, the two together cost about 2·W·c/(M/S) of the call
(W chunks of c bytes in flight per worker, S servers sharing M bytes). In
that model the cost does not depend on the link's rate, so the defaults
follow the call and the job, not the network (which jbps does not measure):
chunks of about M/(48·S) (the nearest power of two, between
32 KiB and 4 MiB; 48 KiB instead of 64 KiB, which stalls:
STALLING_PARTITION_BYTES), and a window of one chunk per server that gets
bytes plus two, which keeps every server's link fed and the pipeline's ends a
few percent of the call. The ends are shorter still because a large tensor's
first and last partition go in pieces of 1/8 to 1/2 of a chunk across hosts
(plan.py, chunk_sizes): the first sums come back sooner and the last pulls
follow the last pushes sooner.
Measured, the rate matters too: at 200 Mbit/s 48 KiB chunks took 1.06-1.09x
the formula where M/(48·S) chunks (128 KiB for 32 MiB) took 1.08-1.13x,
while at 1 Gbit/s 48 KiB chunks cost 10-25% more CPU and lost at k = 4.
So across hosts a chunk is also at most about CHUNK_LINK_S of the link
(the largest of the sizes above that fits), with the rate jbps.init
measured (link_rate.py), the same on every worker: 48 KiB at 200 Mbit/s,
no change from about 350 Mbit/s up for 32 MiB psums.
"""

from __future__ import annotations

from typing import Sequence

ONE_HOST_PARTITION_BYTES = 1 << 20
MIN_NETWORK_PARTITION_BYTES = 32 << 10
MAX_NETWORK_PARTITION_BYTES = 4 << 20
# Chunks each server gets per call across hosts: the pipeline's fill and drain
# cost about 2·W/(CHUNKS_PER_SERVER·S) of the call, W ≈ S + 2 (4-5% here).
# More, smaller chunks shorten it further but cost CPU per chunk on every
# host: on the 2-core development machine, which also runs every emulated
# host's network stack, 4 workers and 2 CPU hosts at 1 Gbit/s took 1.35x the
# formula with 64 KiB chunks and 1.13x with 128 KiB.
CHUNKS_PER_SERVER = 48
# Chunks of 64 KiB across hosts stall: a sum of about 64 KiB on its way from a
# CPU host's server to a worker now and then takes ~100 ms instead of ~1 ms,
# and every worker's window waits on it. Measured on the emulated cluster
# (4 worker hosts, 16 MiB at 1 Gbit/s): 1.8-2.1x the formula with 2 or 4 CPU
# hosts at 64 KiB (and at 65,472 bytes, 1.5x), 1.07-1.11x at 32, 48, 60, 72
# and 96 KiB, the same 1.08x with none. The cause is not fully found (not the
# receive threshold, the direct writes or the receive buffer: each changed
# alone left it; no packet is dropped in any qdisc or veth, yet senders
# retransmit and send loss probes, so ACKs come late): delayed ACKs are part
# of it, since TCP_QUICKACK after every read took 32 MiB with 4 CPU hosts
# from 0.45 s to 0.35 s at 64 KiB (0.30-0.32 s at 128 KiB, unchanged by it).
# So that size is not chosen: 48 KiB instead.
STALLING_PARTITION_BYTES = 64 << 10
INSTEAD_OF_STALLING_BYTES = 48 << 10
# The longest a chunk should take on the link across hosts. A chunk's sum
# waits for every worker's copy, and each link holds a window of chunks, so
# the waits grow with the chunk's time on the wire, and at low rates beyond
# what the model above says (the workers drift further apart): at 200 Mbit/s
# (25 MB/s) this gives 48 KiB, the size that measured best there.
CHUNK_LINK_S = 0.003
# Buckets (jbps/ops/buckets.py). A bucket's sums can travel only once its
# last gradient exists, and the last bucket's sums are never hidden by the
# backward pass, so smaller buckets leave sooner and leave less exposed; each
# costs a custom call and its chunks' bookkeeping, so not too small. On one
# host the sums take little of the step: 4 MiB, as measured before buckets
# followed anything. Across hosts a bucket is at most BUCKET_LINK_S of the
# busiest link (at the rate jbps.init measured, the same on every worker) and
# at most 1/MIN_BUCKETS of the tree, so even on a fast link the first bucket
# leaves while most of the backward pass is still to run; never below
# MIN_BUCKET_BYTES. A leaf larger than a bucket is a bucket of its own, so
# below a model's layer size this means one call per layer. Measured on the
# emulated cluster: docs/guide/overlap.md.
ONE_HOST_BUCKET_BYTES = 4 << 20
MAX_BUCKET_BYTES = 4 << 20
MIN_BUCKET_BYTES = 256 << 10
MIN_BUCKETS = 8
BUCKET_LINK_S = 0.010
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


def partition_bytes(
    call_bytes: int, fractions: Sequence[float], across_hosts: bool, link_bytes_per_s: float | None = None
) -> int:
    """The largest chunk of one psum call of `call_bytes` (all leaves, all
    shards); across hosts, at most CHUNK_LINK_S of a link of
    `link_bytes_per_s` when that is known."""
    if not across_hosts:
        return ONE_HOST_PARTITION_BYTES
    target = call_bytes / (CHUNKS_PER_SERVER * active_servers(fractions))
    size = MIN_NETWORK_PARTITION_BYTES
    # The power of two nearest the target (whole elements of every dtype, few distinct plans).
    while size < MAX_NETWORK_PARTITION_BYTES and size * 1.414 < target:
        size *= 2
    if link_bytes_per_s is not None:
        size = min(size, _largest_at_most(link_bytes_per_s * CHUNK_LINK_S))
    return INSTEAD_OF_STALLING_BYTES if size == STALLING_PARTITION_BYTES else size


def _largest_at_most(nbytes: float) -> int:
    """The largest power of two from MIN_NETWORK_PARTITION_BYTES up that is at
    most `nbytes` (64 KiB counting as the 48 KiB it becomes); the smallest if none."""
    size = MIN_NETWORK_PARTITION_BYTES
    while (
        size < MAX_NETWORK_PARTITION_BYTES
        and (INSTEAD_OF_STALLING_BYTES if size * 2 == STALLING_PARTITION_BYTES else size * 2) <= nbytes
    ):
        size *= 2
    return size


def bucket_bytes(
    tree_bytes: int, across_hosts: bool, link_bytes_per_s: float | None = None, nic_share: float = 1.0
) -> int:
    """The size of a bucket of a psum of `tree_bytes` (see the constants above).
    nic_share: bytes the busiest NIC carries per byte of a psum (link_rate.busiest_nic_share)."""
    if not across_hosts:
        return ONE_HOST_BUCKET_BYTES
    size = min(MAX_BUCKET_BYTES, tree_bytes / MIN_BUCKETS)
    if link_bytes_per_s is not None:
        size = min(size, link_bytes_per_s * BUCKET_LINK_S / max(nic_share, 1e-3))
    return int(max(MIN_BUCKET_BYTES, size))


def largest_partition_bytes(across_hosts: bool) -> int:
    """The largest chunk partition_bytes gives: what a shared-memory push slot must hold."""
    return MAX_NETWORK_PARTITION_BYTES if across_hosts else ONE_HOST_PARTITION_BYTES


def credit(fractions: Sequence[float], across_hosts: bool) -> int:
    """Chunks a worker may have pushed and not yet acknowledged."""
    if not across_hosts:
        return max(MIN_CREDIT, CREDIT_PER_SERVER_ONE_HOST * len(fractions))
    return max(MIN_CREDIT, active_servers(fractions) + EXTRA_CREDIT_NETWORK)
