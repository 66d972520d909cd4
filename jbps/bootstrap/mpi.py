"""The mpirun bootstrap.

    mpirun -np 4 python train.py                                  # SPMD: 4 workers
    mpirun -np 4 python train.py : -np 2 python -m jbps.server    # MPMD: + 2 servers

Every rank takes part in one exchange over MPI_COMM_WORLD (at jbps.init() in
workers, at start-up in servers): its role and its host (MPI's shared-memory
split, so "host" means what MPI means by node); the job token, drawn by rank
0 (or JBPS_JOB_TOKEN); then the address of every summation server.

Servers: on each host with workers, the first worker (local rank 0) runs
JBPS_COLOCATED_SERVERS (default 1) servers *inside its process*, on C++
threads: nothing extra to start, place or clean up, they end with the job,
and summing holds no Python lock. MPMD server ranks run one server each,
declared dedicated when no worker shares their host and colocated otherwise,
so the optimal split gives each its share.

The exchange is bounded by JBPS_TIMEOUT_S: rank 0 names the ranks that never
join and aborts the job. MPI_Init itself waits for every rank while holding
Python's lock, so a rank that ended before MPI started (a failed import, a
typo) is caught by a helper process instead (mpi_guard.py), which also
removes MPICH's shared-memory files when the job dies.

Workers are numbered in world-rank order; local_rank/local_size count the
workers in the same shared-memory domain. With every rank on one host the
servers listen on loopback; across hosts, on the address the host name
resolves to (JBPS_SERVER_HOST overrides it).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from typing import Callable

from ..config import Config, env_value
from ..errors import JbpsError

log = logging.getLogger("jbps.bootstrap")

# What mpiexec/mpirun put into each rank's environment: MPICH/Hydra and
# Intel MPI (PMI_*), Open MPI (OMPI_*), PMIx launchers, MVAPICH.
_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def under_mpirun(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return any(name in environ for name in _MPI_ENV)


def import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise JbpsError(
            "this process runs under mpirun, and jbps's mpirun bootstrap needs mpi4py: "
            f"pip install 'jbps[mpi]' (mpi4py and the MPICH wheel) ({exc}). Or give the servers "
            "yourself (JBPS_SERVERS) or use a scheduler (DMLC_PS_ROOT_URI)"
        ) from None
    return MPI


def _bind_host(single_host: bool) -> str:
    if os.environ.get("JBPS_SERVER_HOST"):
        return os.environ["JBPS_SERVER_HOST"]
    if single_host:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


_had_server_ranks = False  # MPMD server ranks end with their first job
_guard = None  # this rank's guard process (mpi_guard.py), for the rank's lifetime

# Rank 0 collects one message of this tag from every rank before the
# collectives start, so that it can name the ranks that never join.
_JOIN_TAG = 0x6A62
_POLL_S = 0.01
# A rank other than 0 waits this much longer than rank 0 before it speaks, so
# that rank 0's message, which names the missing ranks, comes first.
_OTHERS_GRACE_S = 5.0
# The guard process ends the job if the collectives still have not finished
# this long after the timeout (a rank stuck or dead in the middle of them).
_GUARD_GRACE_S = 10.0

# The variables of a rank's number, the job's size and the ranks on this host, by launcher.
_RANK_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_SIZE"),
)


class _Guard:
    """The rank's end of its guard process (mpi_guard.py): bounds the join
    even while MPI_Init holds Python's lock, and removes MPICH's files if the
    job dies. Without a rank number in the environment it does nothing."""

    def __init__(self):
        self.proc = None
        env = os.environ
        names = next((n for n in _RANK_VARIABLES if env.get(n[0], "").isdigit() and env.get(n[1], "").isdigit()), None)
        if names is None:
            return
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_guard.py")
        argv = [
            sys.executable,
            "-I",
            "-S",
            script,
            "--pid",
            str(os.getpid()),
            "--rank",
            env[names[0]],
            "--size",
            env[names[1]],
            "--local-size",
            env.get(names[2], ""),
            "--rank-variable",
            names[0],
        ]
        # Its own session: mpiexec's clean-up of the rank must leave it to clean up after the job.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    def tell(self, line: str) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                pass


def _names(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _abort(world, message: str) -> None:
    log.error("%s", message)
    # MPI_Abort tears the job down at once, and mpiexec may drop output it
    # has not forwarded yet: give it a moment to pass the message on.
    sys.stderr.flush()
    time.sleep(1.0)
    world.Abort(1)


def _join(world, deadline: float, timeout_s: float) -> None:
    """Every rank says it is here to rank 0, which answers once all have:
    point-to-point and polled, so rank 0 knows who is missing when time runs
    out, and no rank spins in a collective meanwhile."""
    if world.size == 1:
        return
    if world.rank == 0:
        waiting = {r: world.irecv(source=r, tag=_JOIN_TAG) for r in range(1, world.size)}
        while waiting:
            for r in [r for r, req in waiting.items() if req.test()[0]]:
                del waiting[r]
            if waiting and time.monotonic() > deadline:
                _abort(
                    world,
                    f"jbps mpirun bootstrap: rank 0 waited {timeout_s:g} s (JBPS_TIMEOUT_S) for the other "
                    f"ranks to join; {_names(waiting)} never did: does every rank call jbps.init() (or run "
                    "python -m jbps.server)? Aborting the MPI job.",
                )
            time.sleep(_POLL_S)
        for req in [world.isend(True, dest=r, tag=_JOIN_TAG) for r in range(1, world.size)]:
            req.wait()
        return
    sent = world.isend(True, dest=0, tag=_JOIN_TAG)
    answer = world.irecv(source=0, tag=_JOIN_TAG)
    while not answer.test()[0]:
        if time.monotonic() > deadline + _OTHERS_GRACE_S:
            _abort(
                world,
                f"jbps mpirun bootstrap: rank {world.rank} waited {timeout_s:g} s (JBPS_TIMEOUT_S) for "
                "rank 0 to confirm the job; rank 0 never joined: does it call jbps.init() (or run python "
                "-m jbps.server)? Aborting the MPI job.",
            )
        time.sleep(_POLL_S)
    sent.wait()


def exchange(role: str, token: int, colocated_per_host: int, start_server: Callable, timeout_s: float) -> dict:
    """The collective every rank runs, bounded: a rank that never joins
    (never calls jbps.init()) or ended before it makes the others end the MPI
    job after timeout_s with a message naming the missing ranks, instead of
    waiting forever. start_server(bind, num_workers, token, role) starts one
    summation server and returns it. Returns the job:
    {"servers", "token", "num_workers", "rank", "local_rank", "local_size",
    "hosted": [servers this process started], "host": where they listen,
    "role": a server rank's role}."""
    global _guard
    if _had_server_ranks:
        raise JbpsError(
            "under mpirun with `python -m jbps.server` ranks, jbps.init() works once per job: the "
            "server ranks ended with the first shutdown()"
        )
    deadline = time.monotonic() + timeout_s
    if _guard is None:
        _guard = _Guard()
    # MPI_Init (at the import, unless the program imported mpi4py already)
    # waits for every rank and holds Python's lock: only the guard can end it.
    _guard.tell(f"wait {timeout_s:g} mpi")
    MPI = import_mpi()
    world = MPI.COMM_WORLD
    _guard.tell(f"wait {max(0.0, deadline - time.monotonic()) + _GUARD_GRACE_S:g} join")
    try:
        _join(world, deadline, timeout_s)
        return _exchange(world, MPI, role, token, colocated_per_host, start_server)
    finally:
        _guard.tell("done")


def _exchange(world, MPI, role, token, colocated_per_host, start_server) -> dict:
    global _had_server_ranks
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    node_id = node.bcast(world.rank, root=0)  # the lowest world rank of the node names it
    node.Free()
    members = world.allgather((role, node_id))
    workers = [r for r, (ro, _) in enumerate(members) if ro == "worker"]
    _had_server_ranks = any(ro == "server" for ro, _ in members)
    if not workers:
        raise JbpsError("mpirun started no workers: every rank runs `python -m jbps.server`")
    token = world.bcast(token or secrets.randbits(63) or 1, root=0)
    nodes = {n for _, n in members}
    worker_nodes = {members[r][1] for r in workers}
    bind = f"{_bind_host(len(nodes) == 1)}:0"
    mine = [r for r in workers if members[r][1] == node_id]

    hosted, addresses, error = [], [], None
    server_role = "colocated" if node_id in worker_nodes else "dedicated"
    try:
        if role == "worker" and mine[0] == world.rank:
            for _ in range(colocated_per_host):
                hosted.append(start_server(bind, len(workers), token, "colocated"))
        elif role == "server":
            hosted.append(start_server(bind, len(workers), token, server_role))
        addresses = [f"{bind.rpartition(':')[0]}:{s.port}" for s in hosted]
    except Exception as exc:  # tell the others instead of leaving them waiting
        error = f"rank {world.rank}: {exc}"
    everyone = world.allgather((addresses, error))
    errors = [e for _, e in everyone if e]
    if errors:
        for s in hosted:
            s.stop()
        raise JbpsError("jbps mpirun bootstrap: a summation server failed to start: " + "; ".join(errors))
    servers = [a for addrs, _ in everyone for a in addrs]
    if not servers:
        raise JbpsError(
            "jbps mpirun bootstrap: no summation servers: JBPS_COLOCATED_SERVERS=0 and no `python -m jbps.server` ranks"
        )
    job = {
        "servers": servers,
        "token": token,
        "num_workers": len(workers),
        "hosted": hosted,
        "host": bind.rpartition(":")[0],
        "role": server_role,
    }
    if role == "worker":
        job.update(rank=workers.index(world.rank), local_rank=mine.index(world.rank), local_size=len(mine))
    return job


def start_colocated(bind: str, num_workers: int, token: int, role: str, timeout_s: float):
    from .. import _core
    from ..config import deterministic_sums

    return _core.Server(bind, num_workers, token, 0, timeout_s, False, role, deterministic_sums(), env_value("shm"))


def join_as_worker(requested: Config) -> tuple[Config, list]:
    from . import with_job

    job = exchange(
        "worker",
        requested.job_token,
        requested.colocated_servers,
        lambda bind, n, token, role: start_colocated(bind, n, token, role, requested.timeout_s),
        requested.timeout_s,
    )
    try:
        config = with_job(requested, job, job["servers"])
    except JbpsError:
        for s in job["hosted"]:
            s.stop()
        raise
    return config, job["hosted"]
