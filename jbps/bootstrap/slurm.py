"""The srun bootstrap: `srun -n 4 python train.py` (in an allocation or an sbatch script).

Slurm starts every task with its place in the job step: SLURM_PROCID (the
worker rank), SLURM_NTASKS, SLURM_STEP_NODELIST and SLURM_STEP_NUM_NODES, as
jax.distributed reads them. jbps then assembles the job through its own
scheduler (jbps/scheduler/rendezvous.py), as under BytePS's variables:

- task 0 runs the scheduler on a thread of its process, on the step's first
  node, at a port every task derives from the job and step ids (below;
  JBPS_SCHEDULER_PORT sets it): nothing else to start;
- the first task of each node (SLURM_LOCALID 0) runs JBPS_COLOCATED_SERVERS
  (default 1) summation servers inside its process, as under mpirun, and
  registers them;
- every task registers as worker SLURM_PROCID and learns the servers, the
  job token and its local rank from the scheduler.

Every wait is bounded by JBPS_TIMEOUT_S: a task that never comes is named by
the scheduler's error, which every task that did register receives. With the
step on one node everything listens on loopback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading

from ..config import Config
from ..errors import JbpsError

# The variables srun gives each task of a step (an sbatch script's own
# process has no step node list: it runs alone, or starts tasks with srun).
_STEP = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST")
# The scheduler's port when JBPS_SCHEDULER_PORT is not set: one of 4,096 from
# the job and step ids, below the range jax.distributed takes the same way.
PORT_BASE, PORT_RANGE = 57344, 4096


def under_srun(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return all(name in environ for name in _STEP)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07"."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise JbpsError(f"jbps srun bootstrap: cannot read the node list SLURM_STEP_NODELIST={nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _int(environ, name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(str(value))
    except ValueError:
        raise JbpsError(f"jbps srun bootstrap: {name}={value!r} is not a number") from None


def scheduler_port(requested: Config, environ) -> int:
    if requested.scheduler_port:
        return requested.scheduler_port
    job, step = _int(environ, "SLURM_JOB_ID", 0), _int(environ, "SLURM_STEP_ID", 0)
    return PORT_BASE + (job * 7 + step) % PORT_RANGE


def join_as_worker(requested: Config, environ=None) -> tuple[Config, list]:
    from ..scheduler.rendezvous import Scheduler
    from .scheduler import join_as_worker as scheduler_join

    environ = os.environ if environ is None else environ
    rank, tasks = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
    local_id = _int(environ, "SLURM_LOCALID", 0)
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", 1))
    one_node = nodes == 1
    host = "127.0.0.1" if one_node else first_host(environ["SLURM_STEP_NODELIST"])
    port = scheduler_port(requested, environ)
    address = f"{host}:{port}"
    per_node = requested.colocated_servers
    if per_node < 1:
        raise JbpsError("jbps srun bootstrap: JBPS_COLOCATED_SERVERS must be at least 1 (servers run inside tasks)")

    if rank == 0:
        try:
            scheduler = Scheduler(
                tasks,
                nodes * per_node,
                bind=f"{'127.0.0.1' if one_node else '0.0.0.0'}:{port}",
                timeout_s=requested.timeout_s,
                token=requested.job_token or None,
                secret=requested.job_secret,
            )
        except OSError as exc:
            raise JbpsError(
                f"jbps srun bootstrap: task 0 cannot listen for the job at port {port} ({exc}); "
                "set JBPS_SCHEDULER_PORT to a free port (the same for every task)"
            ) from None
        threading.Thread(target=_run_scheduler, args=(scheduler,), daemon=True, name="jbps-scheduler").start()

    hosted: list = []
    failures: list = []
    # This node's servers register on threads, beside this task's own worker registration.
    threads = [
        threading.Thread(
            target=_serve, args=(address, requested.timeout_s, requested.job_secret, hosted, failures), daemon=True
        )
        for _ in range(per_node if local_id == 0 else 0)
    ]
    for t in threads:
        t.start()
    ok = False
    try:
        config = scheduler_join(
            dataclasses.replace(requested, scheduler_host=host, scheduler_port=port, worker_rank=rank)
        )
        for t in threads:
            t.join(timeout=requested.timeout_s)
        if failures or len(hosted) < len(threads):
            raise JbpsError(
                f"jbps srun bootstrap: this node's summation server failed: {'; '.join(failures) or 'timed out'}"
            )
        ok = True
    finally:
        if not ok:
            for t in threads:
                t.join(timeout=requested.timeout_s)
            for s in hosted:
                s.stop()
    return config, hosted


def _run_scheduler(scheduler) -> None:
    try:
        scheduler.run()
    except JbpsError:
        pass  # every member was told, and fails with it
    finally:
        scheduler.close()


def _serve(address, timeout_s, secret, hosted, failures) -> None:
    from .mpi import start_colocated
    from .scheduler import join_as_server

    try:
        server, _job = join_as_server(
            address,
            timeout_s,
            lambda bind, n, token, role: start_colocated(bind, n, token, role, timeout_s),
            secret=secret,
        )
        hosted.append(server)
    except Exception as exc:  # the worker's own registration fails with the scheduler's error too
        failures.append(str(exc))
