"""A process started with no job around it (`python train.py`): a job of one
worker, with one summation server hosted in this process on loopback, as
Horovod runs alone with size 1. Scripts then run unchanged alone, under
`jbps run` and under mpirun."""

from __future__ import annotations

import logging
import secrets

from ..config import Config

log = logging.getLogger("jbps.bootstrap")


def nothing_given(requested: Config) -> bool:
    """No servers, scheduler, mpirun or job size: the job is this process."""
    return (
        not requested.servers
        and not requested.scheduler
        and requested.num_workers in (None, 1)
        and requested.worker_rank in (None, 0)
    )


def join_alone(requested: Config) -> tuple[Config, list]:
    from . import with_membership
    from .mpi import start_colocated

    token = requested.job_token or secrets.randbits(63) or 1
    server = start_colocated("127.0.0.1:0", 1, token, "colocated", requested.timeout_s)
    log.info(
        "jbps: no job found (JBPS_SERVERS, a scheduler or mpirun): running alone, one worker and an "
        "in-process summation server on 127.0.0.1:%d",
        server.port,
    )
    try:
        config = with_membership(
            requested,
            servers=(f"127.0.0.1:{server.port}",),
            num_workers=1,
            worker_rank=0,
            local_rank=0,
            local_size=1,
            job_token=token,
        )
    except Exception:
        server.stop()
        raise
    return config, [server]
