"""Entry point of a summation server process.

    python -m jbps.server --bind 127.0.0.1:9001 --num-workers 2 [--role dedicated] [--deterministic]
    DMLC_ROLE=server DMLC_PS_ROOT_URI=... DMLC_PS_ROOT_PORT=... python -m jbps.server
    mpirun -np 4 python train.py : -np 2 python -m jbps.server

With --num-workers on the command line the server is given everything. Else
it joins the job the way its workers do: through the scheduler when one is
set (JBPS_SCHEDULER_HOST/PORT, DMLC_PS_ROOT_URI/PORT), through MPI under
mpirun; then the bootstrap decides its role, port and token. Else
JBPS_NUM_WORKERS / DMLC_NUM_WORKER stand in for the flag.

Prints "jbps.server listening on HOST:PORT" once ready (port 0 picks a free
port, and this line says which). Exits (status 0) when every worker has said
goodbye, or when a worker is lost (its connection ends without a goodbye: the
other workers are told, naming it), unless --keep-alive, which then waits for a
new job instead; also on SIGINT/SIGTERM. A server that joined through the
scheduler or mpirun also ends the job when a worker has not connected within
the timeout (JBPS_TIMEOUT_S), naming it; one given --num-workers waits for its
workers however late they come. If the job fails before it assembles (another
server could not start), the server exits with status 1, saying why.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from .. import unknown_settings
from ..bootstrap.mpi import under_mpirun
from ..config import argparse_type, exit_for_environment
from ..errors import JbpsError
from ..partition.assign import ROLES
from .settings import check_port, settings_from_environment

log = logging.getLogger("jbps.server")


def parse_args(argv=None, prog: str = "python -m jbps.server") -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="jbps summation server")
    # Settings from the environment are checked first, and a bad one is named
    # in one line: no flag was wrong, so no usage block.
    try:
        env = settings_from_environment()
    except JbpsError as exc:
        exit_for_environment(prog, exc)
    p.add_argument(
        "--bind",
        default=env["bind"],
        help="host:port to listen on (default 127.0.0.1:0, a free loopback port; env JBPS_SERVER_BIND). "
        "Under a scheduler only the port counts (e.g. :9000 for a firewall): the host is the address "
        "this machine reaches the scheduler from",
    )
    p.add_argument(
        "--num-workers",
        type=argparse_type("num_workers"),
        default=None,
        help="worker processes in the job (else the scheduler or mpirun tells; else env "
        "JBPS_NUM_WORKERS / DMLC_NUM_WORKER)",
    )
    p.add_argument(
        "--sum-threads",
        "--engine-threads",  # BytePS's name for them
        dest="sum_threads",
        type=int,
        default=env["sum_threads"],
        help="summation threads (default: min(4, cores); env JBPS_SERVER_ENGINE_THREADS / BYTEPS_SERVER_ENGINE_THREAD)",
    )
    p.add_argument(
        "--token",
        type=argparse_type("job_token"),
        default=env["token"],
        help="job token workers must present (env JBPS_JOB_TOKEN)",
    )
    p.add_argument(
        "--timeout",
        type=argparse_type("timeout_s"),
        default=env["timeout_s"],
        help="seconds a half-received message or a blocked send may stall (env JBPS_TIMEOUT_S)",
    )
    p.add_argument(
        "--role",
        choices=ROLES,
        default=env["role"],
        help="colocated: on a worker's machine (the default); dedicated: on a CPU-only machine. "
        "Workers give each role its share of the bytes by the optimal split (env JBPS_SERVER_ROLE)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=env["deterministic"],
        help="add pushes in worker-rank order, so sums are bitwise identical run to run (env JBPS_DETERMINISTIC=1)",
    )
    p.add_argument(
        "--no-shm",
        dest="shm",
        action="store_false",
        default=env["shm"],
        help="no shared memory with workers on this host: they send through TCP (env JBPS_SHM=0)",
    )
    p.add_argument(
        "--keep-alive", action="store_true", help="keep serving after every worker said goodbye (for a following job)"
    )
    args = p.parse_args(argv)
    args.scheduler, args.env_num_workers, args.secret = env["scheduler"], env["num_workers"], env["secret"]
    try:
        check_port(args.bind, "--bind ")
    except JbpsError as exc:
        p.error(str(exc))
    if args.num_workers is None and not args.scheduler and not under_mpirun() and args.env_num_workers is None:
        p.error("--num-workers is required (or set JBPS_NUM_WORKERS, or start under a scheduler or mpirun)")
    return args


def start(args):
    """Starts the server the way the command line and environment say;
    returns (server, host it listens on, worker count, role), or, for an
    elastic job's scheduler, (registration, make, port): main() serves its
    generations, each with a server of its own."""
    from .. import _core

    def make(bind, num_workers, token, role, join_timeout_s=args.timeout):
        # A bootstrapped server's workers are known to exist: if one has not
        # connected within the timeout, it failed, and the job ends naming it.
        return _core.Server(
            bind,
            num_workers,
            token,
            args.sum_threads,
            args.timeout,
            args.keep_alive,
            role,
            args.deterministic,
            args.shm,
            join_timeout_s,
        )

    if args.num_workers is None and args.scheduler:
        from ..bootstrap.scheduler import join_as_server

        # The host is the one the scheduler is reached from; the port is --bind's (0: any).
        port = int(args.bind.rpartition(":")[2] or 0)
        joined = join_as_server(
            args.scheduler, args.timeout, make, port=port, secret=args.secret, elastic=lambda reg: (reg, make, port)
        )
        if len(joined) == 3:  # an elastic job: main() serves its generations
            return joined
        server, job = joined
        return server, job["host"], job["num_workers"], job["role"]
    if args.num_workers is None and under_mpirun():
        from ..bootstrap.mpi import exchange

        job = exchange("server", args.token, 0, make, args.timeout)
        return job["hosted"][0], job["host"], job["num_workers"], job["role"]
    # Started by hand: it waits for its workers, however late they come.
    num_workers = args.num_workers or args.env_num_workers
    server = make(args.bind, num_workers, args.token, args.role, join_timeout_s=0)
    return server, args.bind.rpartition(":")[0], num_workers, args.role


def main(argv=None, prog: str = "python -m jbps.server") -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv, prog)
    unknown_settings.warn(lambda line: print(line, file=sys.stderr, flush=True))
    try:
        started = start(args)
    except (RuntimeError, ValueError, JbpsError) as exc:
        log.error("%s", exc)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if len(started) == 3:
        from ..bootstrap.elastic import serve_generations

        reg, make, port = started
        print(f"jbps.server serving an elastic job's generations from {reg.local_host}", flush=True)
        try:
            served = serve_generations(reg, make, port, args.timeout, stop)
        except (RuntimeError, ValueError, JbpsError) as exc:
            log.error("%s", exc)
            return 1
        log.info("done: served %d generations of the elastic job", served)
        return 0
    server, host, num_workers, role = started
    print(
        f"jbps.server listening on {host}:{server.port} for {num_workers} workers "
        f"({role}{', deterministic' if args.deterministic else ''})",
        flush=True,
    )

    # Short waits so signal handlers run promptly on the main thread.
    while not stop.is_set() and not server.wait(0.2):
        pass
    server.stop()
    stats = server.stats()
    # The cause of a job that ended early was said when it happened (one line
    # naming the worker): not again here. Exit 0 all the same: the lost
    # worker's own exit status tells launchers what failed.
    ended_early = "; the job ended early (see above)" if server.failure() and not stop.is_set() else ""
    log.info(
        "done: %d pushes, %.1f MiB received (%d bytes), %d sums sent, %d connections refused, %d workers lost%s",
        stats["pushes"],
        stats["bytes_received"] / 2**20,
        stats["bytes_received"],
        stats["sums_sent"],
        stats["rejected"],
        stats["workers_lost"],
        ended_early,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
