"""How a process finds the rest of its job.

Five ways, tried in this order by jbps.init() (the first three by `python -m jbps.server` too):

1. Given: JBPS_SERVERS (+ JBPS_NUM_WORKERS, JBPS_WORKER_RANK) name everything.
2. Scheduler: JBPS_SCHEDULER_HOST/PORT or BytePS's DMLC_PS_ROOT_URI/PORT point
   at `python -m jbps.scheduler`, which assembles the job (scheduler.py).
3. mpirun: every rank is a worker unless it runs `python -m jbps.server`; the
   ranks exchange roles, addresses and the job token through MPI (mpi.py).
4. srun: every task is a worker; task 0 runs jbps's scheduler on a thread, the
   first task of each node the node's servers (slurm.py).
5. Alone: none of these and no job size: a 1-worker job with an in-process
   server (alone.py), so `python train.py` runs as under a launcher.
"""

from __future__ import annotations

import dataclasses

from ..config import Config
from ..errors import JbpsError
from .alone import join_alone, nothing_given
from .mpi import under_mpirun
from .slurm import under_srun

__all__ = ["complete", "under_mpirun", "under_srun"]


def complete(requested: Config) -> tuple[Config, list]:
    """The worker's full config, and any summation servers this process now
    hosts (mpirun's colocated servers), which live until jbps.shutdown()."""
    if requested.servers:
        return requested.complete(), []
    if requested.role not in (None, "worker"):
        raise JbpsError(
            f"jbps.init() runs in workers, but this process has role {requested.role!r} "
            "(JBPS_ROLE/DMLC_ROLE): servers run `python -m jbps.server`, the scheduler "
            "`python -m jbps.scheduler`"
        )
    if requested.scheduler:
        from .scheduler import join_as_worker

        return join_as_worker(requested), []
    if under_mpirun():
        from .mpi import join_as_worker as mpi_join

        return mpi_join(requested)
    if under_srun():
        from .slurm import join_as_worker as srun_join

        return srun_join(requested)
    if nothing_given(requested):
        return join_alone(requested)
    return requested.complete(), []  # raises: no servers, and the ways to give them


def with_membership(requested: Config, **found) -> Config:
    """requested, with what the bootstrap found about the job (servers, ranks,
    sizes, token: the bootstrap's word is final)."""
    return dataclasses.replace(requested, **found).complete()


def with_job(requested: Config, job: dict, servers) -> Config:
    """with_membership for the job a rendezvous described (its rank, sizes and
    token), served by `servers`."""
    return with_membership(
        requested,
        servers=tuple(servers),
        num_workers=job["num_workers"],
        worker_rank=job["rank"],
        local_rank=job["local_rank"],
        local_size=job["local_size"],
        job_token=job["token"],
    )
