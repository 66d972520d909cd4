"""Bytes on every machine's NIC for one push-pull, from first principles.

Worker w runs on machine w (0 .. n-1); each server sits on a machine given
by index (a worker machine when colocated, n .. n+k-1 for CPU-only ones).
Every worker pushes each server's share of its gradient to that server and
pulls the same bytes back; traffic between a worker and a server on its own
machine never touches the NIC. This is independent of the closed form in
split.py, so each checks the other.
"""

from __future__ import annotations

from typing import Sequence


def nic_bytes(num_workers: int, server_machines: Sequence[int], server_bytes: Sequence[float]) -> dict[int, float]:
    """Busier direction (in or out) of each machine's NIC, in bytes."""
    if len(server_machines) != len(server_bytes):
        raise ValueError("one machine and one byte count per server")
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for machine, nbytes in zip(server_machines, server_bytes):
        for worker in range(num_workers):
            if worker == machine:
                continue
            # Push: worker -> server; pull: server -> worker.
            sent[worker] = sent.get(worker, 0.0) + nbytes
            received[machine] = received.get(machine, 0.0) + nbytes
            sent[machine] = sent.get(machine, 0.0) + nbytes
            received[worker] = received.get(worker, 0.0) + nbytes
    machines = set(range(num_workers)) | set(server_machines)
    return {m: max(sent.get(m, 0.0), received.get(m, 0.0)) for m in sorted(machines)}


def busiest_nic_bytes(num_workers: int, server_machines: Sequence[int], server_bytes: Sequence[float]) -> float:
    return max(nic_bytes(num_workers, server_machines, server_bytes).values(), default=0.0)


def standard_placement(num_workers: int, num_cpu_servers: int) -> list[int]:
    """One colocated server per worker machine, then one per CPU machine."""
    return list(range(num_workers)) + [num_workers + i for i in range(num_cpu_servers)]
