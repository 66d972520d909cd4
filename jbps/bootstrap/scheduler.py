"""The scheduler bootstrap, member side (the scheduler is jbps/scheduler/)."""

from __future__ import annotations

from ..config import Config
from ..errors import JbpsError
from ..scheduler.rendezvous import Registration


def join_as_worker(requested: Config) -> Config:
    from . import with_job

    reg = Registration(
        requested.scheduler,
        "worker",
        requested.timeout_s,
        worker_id=requested.worker_rank,
        secret=requested.job_secret,
    )
    try:
        job = reg.receive()
    finally:
        reg.close()
    return with_job(requested, job, job["servers"])


def join_as_server(
    scheduler: str, timeout_s: float, start_server, port: int = 0, secret: str | None = None, elastic=None
):
    """Registers; for an elastic job's scheduler, returns elastic(registration)
    (the server serves its generations, bootstrap/elastic.py). Else learns the job, starts the server with
    start_server(bind, num_workers, token, role) on the address this host
    reaches the scheduler from (at `port`; 0: any free one), reports it and
    waits for the scheduler to say the job has assembled. Returns (server,
    job); raises JbpsError, the server stopped, if the job fails first (a
    server that went on would wait for workers that never come)."""
    reg = Registration(scheduler, "server", timeout_s, secret=secret)
    if reg.opening.get("elastic"):
        if elastic is None:
            reg.close()
            raise JbpsError(
                f"the scheduler at {scheduler} runs an elastic job: its servers run `python -m jbps.server`"
            )
        return elastic(reg)
    try:
        job = reg.receive()
        try:
            server = start_server(f"{reg.local_host}:{port}", job["num_workers"], job["token"], job["role"])
        except Exception as exc:
            reg.send({"error": str(exc)})
            raise
        try:
            reg.send({"address": f"{reg.local_host}:{server.port}"})
            reg.receive()
        except BaseException:
            server.stop()
            raise
    finally:
        reg.close()
    return server, {**job, "host": reg.local_host}
