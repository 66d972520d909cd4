"""An elastic worker's side of the rendezvous (the scheduler is jbps/scheduler/elastic.py).

One connection to the scheduler for the process's life. For each generation
the worker learns its rank, the worker count and the token, starts its
summation server, says where it listens, and learns every server's address.
Between generations it says "regroup" (and whether it holds the job's state);
at its end, "done". A dedicated server
(`python -m jbps.server`) does the same with a fresh server per generation
(serve_generations), until the scheduler says the job is over.
"""

from __future__ import annotations

import logging
import select
import threading
import time

from ..config import Config
from ..errors import JbpsError
from ..scheduler.rendezvous import Registration
from .mpi import start_colocated

# Beyond the timeout, while waiting for a generation: the scheduler's own
# bounds (its timeout, then the settle time) come first and say why.
_SCHEDULER_GRACE_S = 15.0
log = logging.getLogger("jbps.server")


class Membership:
    """A worker's place in an elastic job."""

    def __init__(self, requested: Config, warms_up: bool = False):
        if not requested.scheduler:
            raise JbpsError(
                "jbps.elastic.run needs the job's scheduler: start the job with `jbps run --min-workers N "
                "--max-workers M ...`, or set DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT to a scheduler started "
                "with --min-workers and --max-workers"
            )
        self.requested = requested
        self.reg = Registration(
            requested.scheduler,
            "worker",
            requested.timeout_s,
            worker_id=requested.worker_rank,
            secret=requested.job_secret,
            elastic=True,
            **({"warms_up": True} if warms_up else {}),
        )
        if not self.reg.opening.get("elastic"):
            self.reg.close()
            raise JbpsError(
                f"the scheduler at {requested.scheduler} runs a job that is not elastic: start it with "
                "--min-workers and --max-workers for jbps.elastic.run"
            )
        # Where this worker warms up and a generation runs: the sizing its rank 0's programs were
        # lowered with. The scheduler waits for ready() before it asks the running workers to regroup.
        self.job_sizing: str | None = None
        self.job_size = 0  # and the size the job will have once this worker joins, as the scheduler sees it
        if warms_up:
            try:
                told = self.reg.receive()
                if isinstance(told.get("size"), int):
                    self.job_sizing, self.job_size = told.get("sizing"), told["size"]
            except BaseException:
                self.reg.close()
                raise
        self.generation = 0
        self.regroup_asked = False
        # Whether this worker's state is the job's: it took a generation's state from its root
        # (State.sync), or was in the first generation, whose root's own state starts the job.
        # A worker that regroups without it (its first generation's broadcast failed) cannot be
        # the next generation's root: its state is the fresh one it was made with.
        self.holds_state = False

    def join(self) -> tuple[Config, list, dict]:
        """Waits for the next generation (bounded) and starts this worker's
        server in it; the worker's config, the servers it hosts, and the
        generation as the scheduler gave it."""
        timeout = self.requested.timeout_s
        while True:
            # The scheduler says "waiting" every timeout / 4 while this worker waits (for the
            # others' next commit, or for enough workers): a silent one is gone or cut off.
            self.reg.deadline = time.monotonic() + timeout + _SCHEDULER_GRACE_S
            job = self.reg.receive()
            if job.get("end"):
                raise JbpsError(
                    f"the elastic job of the jbps scheduler at {self.reg.address} is over: its workers finished "
                    "before this one could join them"
                )
            if "generation" not in job:  # "waiting", or a regroup notice that crossed our own
                continue
            server = start_colocated(f"{self.reg.local_host}:0", job["num_workers"], job["token"], "colocated", timeout)
            try:
                self.reg.send({"address": f"{self.reg.local_host}:{server.port}"})
                reply = self.reg.receive()
            except BaseException:
                server.stop()
                raise
            if reply.get("retry"):  # another member failed to start its server
                server.stop()
                continue
            break
        from . import with_job

        try:
            config = with_job(self.requested, job, reply["servers"])
        except BaseException:
            server.stop()
            raise
        self.generation, self.regroup_asked = job["generation"], False
        self.holds_state = self.holds_state or job["generation"] == 1
        # The links' rates an earlier generation on these hosts measured, if the scheduler has them.
        return config, [server], dict(job, rates=reply.get("rates"))

    def tell_rates(self, rates: dict) -> None:
        """Rank 0's word on the links' rates this generation measured (every
        worker agreed on them): a later generation on the same hosts reuses them."""
        self.reg.send({"rates": rates})

    def ready(self) -> None:
        """After its warm-up (where the scheduler gave job_sizing): this worker
        waits to join the running generation."""
        try:
            self.reg.send({"ready": True})
        except JbpsError:
            pass  # the scheduler's last word (the job is over, or failed) is what join() reads next

    def tell_sizing(self, sizing: str) -> None:
        """Rank 0's word on the sizing its programs were lowered with, which a
        newcomer that warms up traces its step with (runtime.tracing_ahead)."""
        self.reg.send({"sizing": sizing})

    def asked_to_regroup(self) -> bool:
        """Whether the scheduler has asked this generation to regroup (a worker
        waits to join); does not wait."""
        while not self.regroup_asked and select.select([self.reg.conn], [], [], 0)[0]:
            self.reg.deadline = time.monotonic() + self.requested.timeout_s
            if self.reg.receive().get("regroup"):
                self.regroup_asked = True
        return self.regroup_asked

    def leave_generation(self) -> None:
        self.reg.send({"regroup": True, "holds": self.holds_state})

    def finish(self) -> None:
        try:
            self.reg.send({"done": True})
        finally:
            self.close()

    def close(self) -> None:
        self.reg.close()


def serve_generations(reg: Registration, start_server, port: int, timeout_s: float, stop: threading.Event) -> int:
    """A dedicated server's life in an elastic job: for each generation, a
    fresh server from start_server(bind, num_workers, token, role), on the
    address this host reaches the scheduler from (at `port`; 0: any free one),
    serving until its workers have left (or one was lost); then the next.
    Returns the generations served, once the scheduler says the job is over
    (or `stop` is set)."""
    served = 0
    try:
        while not stop.is_set():
            reg.deadline = time.monotonic() + timeout_s + _SCHEDULER_GRACE_S
            job = reg.receive()
            if job.get("end"):
                return served
            if "generation" not in job:  # "waiting"
                continue
            server = start_server(f"{reg.local_host}:{port}", job["num_workers"], job["token"], job["role"])
            try:
                reg.send({"address": f"{reg.local_host}:{server.port}"})
                reg.deadline = time.monotonic() + timeout_s + _SCHEDULER_GRACE_S
                if reg.receive().get("retry"):
                    continue
                log.info(
                    "generation %d: serving %d workers on %s:%d (%s)",
                    job["generation"],
                    job["num_workers"],
                    reg.local_host,
                    server.port,
                    job["role"],
                )
                while not stop.is_set() and not server.wait(0.2):
                    pass
            finally:
                server.stop()
            served += 1
            if not stop.is_set():
                reg.send({"regroup": True})
        return served
    finally:
        reg.close()
