"""`python -m jbps.scheduler` (or `jbps scheduler`): the rendezvous of a job
started from environment variables, BytePS-style:

    DMLC_ROLE=scheduler DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=2 \\
    DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=9000 python -m jbps.scheduler

Every server (`python -m jbps.server`) and worker (`jbps.init()`) started with
the same DMLC_* (or JBPS_*) variables registers here, in any order. Once all
have, each learns the job (servers, token, ranks) and the scheduler exits 0.
If anyone is missing after JBPS_TIMEOUT_S, everyone who registered gets an
error naming what is missing and the scheduler exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .. import unknown_settings
from ..config import Config, argparse_type, exit_for_environment
from ..errors import JbpsError
from .elastic import ElasticScheduler
from .rendezvous import Scheduler, refuse

log = logging.getLogger("jbps.scheduler")


def main(argv=None, prog: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(
        prog=prog or "python -m jbps.scheduler",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    try:
        env = Config.resolve({})
    except JbpsError as exc:  # the environment's fault: one line, no usage
        exit_for_environment(p.prog, exc)
    default_bind = f"{env.scheduler_host or '127.0.0.1'}:{env.scheduler_port or 0}"
    p.add_argument(
        "--bind",
        default=default_bind,
        help="host:port to listen on (default DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT, or JBPS_SCHEDULER_*)",
    )
    p.add_argument(
        "--num-workers",
        type=argparse_type("num_workers"),
        default=env.num_workers,
        help="workers to wait for (env JBPS_NUM_WORKERS / DMLC_NUM_WORKER)",
    )
    p.add_argument(
        "--num-servers",
        type=argparse_type("num_servers"),
        default=env.num_servers,
        help="servers to wait for (env JBPS_NUM_SERVERS / DMLC_NUM_SERVER)",
    )
    p.add_argument(
        "--timeout",
        type=argparse_type("timeout_s"),
        default=env.timeout_s,
        help="seconds to wait for everyone (env JBPS_TIMEOUT_S)",
    )
    p.add_argument(
        "--min-workers",
        type=argparse_type("num_workers"),
        default=None,
        help="an elastic job (jbps.elastic.run): the fewest workers it goes on with (with --max-workers)",
    )
    p.add_argument(
        "--max-workers",
        type=argparse_type("num_workers"),
        default=None,
        help="an elastic job: the most workers it takes in",
    )
    args = p.parse_args(argv)
    unknown_settings.warn(lambda line: print(line, file=sys.stderr, flush=True))
    elastic = args.min_workers is not None or args.max_workers is not None
    if elastic:
        return _run_elastic(p, args, env)
    if args.num_workers is None or args.num_servers is None:
        reason = "--num-workers and --num-servers are required (or DMLC_NUM_WORKER and DMLC_NUM_SERVER)"
        misspelled = [f"{var} is not read (did you mean {near}?)" for var, near in unknown_settings.unknown() if near]
        if misspelled:
            reason += "; " + "; ".join(misspelled)
        print(f"{p.prog}: error: {reason}", file=sys.stderr, flush=True)
        # The members started beside it would wait out their timeout for it: tell them instead.
        refuse(args.bind, reason, args.timeout)
        return 2
    try:
        scheduler = Scheduler(
            args.num_workers,
            args.num_servers,
            bind=args.bind,
            timeout_s=args.timeout,
            token=env.job_token,
            secret=env.job_secret,
        )
    except (OSError, ValueError, JbpsError) as exc:
        log.error("cannot listen on %s: %s", args.bind, exc)
        return 1
    print(
        f"jbps.scheduler listening on {scheduler.address} for {args.num_workers} workers and "
        f"{args.num_servers} servers",
        flush=True,
    )
    return _serve(scheduler)


def _serve(scheduler: Scheduler) -> int:
    """Runs the rendezvous to its end; the exit status."""
    try:
        scheduler.run()
    except JbpsError:
        return 1  # already logged, and every member was told
    finally:
        scheduler.close()
    return 0


def _run_elastic(p: argparse.ArgumentParser, args: argparse.Namespace, env) -> int:
    if args.min_workers is None or args.max_workers is None:
        p.error("an elastic job needs both --min-workers and --max-workers")
    num_workers = args.num_workers if args.num_workers is not None else args.min_workers
    try:
        scheduler = ElasticScheduler(
            num_workers,
            args.min_workers,
            args.max_workers,
            num_servers=args.num_servers or 0,
            bind=args.bind,
            timeout_s=args.timeout,
            secret=env.job_secret,
        )
    except (OSError, ValueError, JbpsError) as exc:
        log.error("cannot start on %s: %s", args.bind, exc)
        return 1
    print(
        f"jbps.scheduler listening on {scheduler.address} for an elastic job of {args.min_workers} to "
        f"{args.max_workers} workers, starting with {num_workers} and {args.num_servers or 0} dedicated servers",
        flush=True,
    )
    return _serve(scheduler)


if __name__ == "__main__":
    sys.exit(main())
