"""The optimal split of traffic between colocated and dedicated servers.

n worker machines and k CPU-only machines, every NIC with bandwidth B, M
bytes of gradient per worker. A server on a CPU-only machine ("dedicated")
owns a fraction x of the bytes, a server on a worker machine ("colocated") a
fraction y, with k·x + n·y = 1. A worker machine's NIC carries, each way,
M·(1 - y) of its own pushes to other machines plus (n - 1)·y·M of sums its
colocated server returns to the other workers; a CPU machine's NIC carries
n·x·M. Equalising the two (docs/design.md derives it) gives, for k ≤ n:

    x = 2(n-1) / (n² + kn - 2k)      y = (n-k) / (n² + kn - 2k)
    T = 2n(n-1)·M / ((n² + kn - 2k)·B)

k = 0 is all-reduce's traffic, k = n a plain parameter server's. For k > n
the colocated servers get nothing (y = 0, x = 1/k) and T = max(M, nM/k)/B.
With one worker machine nothing needs to leave it: y = 1, T = 0.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Split:
    """Byte fractions per server, and the communication time they lead to."""

    num_workers: int  # n: worker machines, one colocated server each
    num_cpu_servers: int  # k: CPU-only machines, one dedicated server each
    cpu_fraction: float  # x: owned by each dedicated server
    colocated_fraction: float  # y: owned by each colocated server

    def time_s(self, model_bytes: float, bandwidth_bytes_per_s: float) -> float:
        """Seconds for one push-pull of `model_bytes` per worker: the busiest
        NIC's bytes (one direction) over its bandwidth."""
        n, k = self.num_workers, self.num_cpu_servers
        worker_nic = (1 - self.colocated_fraction) + (n - 1) * self.colocated_fraction
        cpu_nic = n * self.cpu_fraction if k else 0.0
        return max(worker_nic, cpu_nic) * model_bytes / bandwidth_bytes_per_s


def optimal_split(num_workers: int, num_cpu_servers: int) -> Split:
    """x and y of the optimal split (docs/design.md) for n = num_workers, k = num_cpu_servers."""
    n, k = num_workers, num_cpu_servers
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_workers must be a positive integer, got {n!r}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"num_cpu_servers must be a non-negative integer, got {k!r}")
    if n == 1:
        return Split(n, k, 0.0, 1.0)
    if k > n:
        return Split(n, k, 1.0 / k, 0.0)
    denominator = n * n + k * n - 2 * k
    return Split(n, k, 2 * (n - 1) / denominator, (n - k) / denominator)


def allreduce_time_s(num_workers: int, model_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Ring all-reduce: each NIC sends 2(n-1)/n of the gradient."""
    n = num_workers
    return 2 * (n - 1) * model_bytes / (n * bandwidth_bytes_per_s)


def ps_time_s(num_workers: int, num_cpu_servers: int, model_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """A plain parameter server on the k CPU machines (equal shares, none on
    the workers): max(M, nM/k)/B. Needs k ≥ 1."""
    if num_cpu_servers < 1:
        raise ValueError("a plain parameter server needs at least one CPU machine")
    return max(model_bytes, num_workers * model_bytes / num_cpu_servers) / bandwidth_bytes_per_s
